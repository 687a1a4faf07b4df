"""GEMM on the GPU: three numbered versions side by side as llm.c's dev/cuda does, and the tile family (v4).

``C[M,N] = A[M,K] @ B[K,N]`` (plus the old ``C`` when ``accumulate``). How an element of A or B is
read and how an element of C is written is a parameter: an ``Operands`` triple of device functions
``load_a(A, i, k, z, geom)``, ``load_b(B, k, j, z, geom)`` and ``store_c(C, i, j, z, geom, value,
accumulate)``. ``MATRIX`` reads plain 2-D views of any strides (a transpose is ``w.T`` on the host,
never a copy); kernels/cuda/conv.py passes operands that read the input image *as if* it were the
im2col column matrix and write the NCHW output directly (implicit GEMM), so a whole batch's
convolution is one launch and needs no column scratch. ``z`` is ``blockIdx.z``: the conv operands
use it for the group and the split of a split-K weight gradient. NVVM inlines the device functions
(no ``.func`` calls in the PTX), so a plain GEMM pays nothing for the indirection.

- v1 naive: one thread per output, reading A's row and B's column from global memory. Every input
  element is fetched from DRAM (or L2) M or N times: memory-bound.
- v2 shared-memory tiled: a TILE×TILE block stages a TILE-wide slab of A and of B in shared memory,
  then every thread reads its TILE products from there. Global traffic drops by a factor TILE.
- v3 register-blocked: each thread owns a THREAD_M×THREAD_N patch of C in registers; per k it loads
  THREAD_M values of A and THREAD_N of B from shared memory and does THREAD_M·THREAD_N FMAs, so
  shared-memory traffic per FMA drops too, and the block's tile (BLOCK_M×BLOCK_N) grows without
  more threads.
- v4 the tile family (``make_gemm_tiles``, ``TileConfig``): v3's register tiles, double-buffered
  shared-memory slabs with the next slab's loads in flight during the FMAs, each thread's row and
  column index arithmetic (``prep_a`` / ``prep_b``) done once, not per load, and fragments read from
  shared memory four words at a time at uint32 offsets. Configurations are
  parameters, not copies; ``CANDIDATES`` are the ones a GPU times, ``gemm_table.json`` picks one per
  shape (``choose``), benchmarks/gpu_tile_search.py fills it.

Split-K: a launch may cut the k range into chunks of ``k_chunk`` (split ``z % splits`` takes chunk
``z % splits``, where ``splits = ceil(K / k_chunk)``); each split writes its own partial result and
the caller adds them in a fixed order (conv: the weight gradient, whose K is the batch's pixels and
whose M·N is small, and the deep layers' forward and backward data). With ``k_chunk >= K`` there is one
split, the plain GEMM.

Every version adds the products for one output in the same order (k = k_begin, k_begin + 1, ...,
the old C last), so all three give the same result up to the compiler's FMA contraction, and the
same bits on every run. Tile sizes are closure constants (shared arrays need compile-time shapes):
the ``make_*`` factories build a kernel for any size and any operands, which is how the simulator
tests run them on tiny tiles. ``gemm(...)`` and conv run the table's choice (v4) unless ``use_gemm``
picked a numbered version; the static report (``engine kernels --backend cuda --static``) gives every
build's registers, spills and occupancy.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from numba import config, cuda, float32
from numba import config as numba_config

from kernels.cuda._launch import launch, uint32  # numba's uint32 on a GPU, an exact Python int in the simulator

U32 = uint32
"""Shared-memory offsets in the tile loop are uint32: numba indexes with int64 and, for a signed index,
adds the array's length when it is negative (wraparound); an unsigned index skips both."""

GEOMETRY_LENGTH = 12
"""Length of the ``geom`` tuple every GEMM kernel takes (conv's sizes; zeros for a plain GEMM).

Its last two entries say how ``blockIdx.z`` is cut: ``geom[10]`` phases per group (backward data's
stride², else 1) and ``geom[11]`` splits of K; z = (group · phases + phase) · splits + split."""
NO_GEOMETRY = (0,) * (GEOMETRY_LENGTH - 2) + (1, 1)

PREP_LENGTH = 6
"""Length of the tuple a ``prep_a`` / ``prep_b`` device function returns (unused entries are 0)."""


@dataclass(frozen=True)
class Operands:
    """How a GEMM kernel reads A and B and writes C: numba.cuda device functions.

    ``load_a(A, i, k, z, geom)`` / ``load_b(B, k, j, z, geom)`` read one element. The tile family
    (``make_gemm_tiles``) reads through the split form instead: ``prep_a(A, i, z, geom)`` decodes what
    depends only on the row i (conv: the output channel and group) once per thread, before the k
    loop, and ``load_a_at(A, prep, k, z, geom)`` does the per-k rest; likewise ``prep_b`` for the
    column j (conv forward: the image and pixel, three divisions) and ``load_b_at``. ``load_a`` and
    ``load_b`` are those two composed, so v1–v3 and the family read the same elements.
    """

    name: str
    load_a: Any = field(repr=False)
    load_b: Any = field(repr=False)
    store_c: Any = field(repr=False)
    prep_a: Any = field(repr=False, default=None)
    load_a_at: Any = field(repr=False, default=None)
    prep_b: Any = field(repr=False, default=None)
    load_b_at: Any = field(repr=False, default=None)


def compose_operands(name: str, prep_a: Any, load_a_at: Any, prep_b: Any, load_b_at: Any, store_c: Any) -> Operands:
    """Operands from the split (prep, load_at) form; the one-call loads are the two composed."""

    def load_a(A, i, k, z, geom):
        return load_a_at(A, prep_a(A, i, z, geom), k, z, geom)

    def load_b(B, k, j, z, geom):
        return load_b_at(B, prep_b(B, j, z, geom), k, z, geom)

    device = cuda.jit(device=True)
    return Operands(name, device(load_a), device(load_b), store_c, prep_a, load_a_at, prep_b, load_b_at)


@cuda.jit(device=True)
def _matrix_prep_row(A, i, z, geom):
    return (i, 0, 0, 0, 0, 0)


@cuda.jit(device=True)
def _matrix_a_at(A, prep, k, z, geom):
    return A[U32(prep[0]), U32(k)]  # unsigned: no wraparound test per index (i, k are never negative)


@cuda.jit(device=True)
def _matrix_b_at(B, prep, k, z, geom):
    return B[U32(k), U32(prep[0])]


@cuda.jit(device=True)
def _matrix_store(C, i, j, z, geom, value, accumulate):
    if accumulate:
        value += C[i, j]
    C[i, j] = value


MATRIX = compose_operands("gemm", _matrix_prep_row, _matrix_a_at, _matrix_prep_row, _matrix_b_at, _matrix_store)


@cuda.jit(device=True)
def k_range(K, k_chunk, z):
    """The k range of split ``z % splits`` when K is cut into chunks of ``k_chunk``."""
    splits = max(1, (K + k_chunk - 1) // k_chunk)
    k_begin = (z % splits) * k_chunk
    return k_begin, min(K, k_begin + k_chunk)


def _named(function: Any, name: str) -> Any:
    function.__name__ = function.__qualname__ = name
    return function


def make_gemm_v1_naive(operands: Operands = MATRIX) -> Any:
    """One thread per C[i, j]; threadIdx.x walks j so neighbouring threads read neighbouring B and C."""
    load_a, load_b, store_c = operands.load_a, operands.load_b, operands.store_c

    def kernel(A, B, C, M, N, K, k_chunk, geom, accumulate):
        j, i = cuda.grid(2)
        z = cuda.blockIdx.z
        if i < M and j < N:
            k_begin, k_end = k_range(K, k_chunk, z)
            acc = float32(0.0)
            for k in range(k_begin, k_end):
                acc += load_a(A, i, k, z, geom) * load_b(B, k, j, z, geom)
            store_c(C, i, j, z, geom, acc, accumulate)

    return cuda.jit(_named(kernel, f"{operands.name}_v1_naive"))


def make_gemm_v2_tiled(tile: int, operands: Operands = MATRIX) -> Any:
    """The shared-memory tiled kernel for TILE×TILE blocks (launch with threads (tile, tile))."""
    load_a, load_b, store_c = operands.load_a, operands.load_b, operands.store_c

    def kernel(A, B, C, M, N, K, k_chunk, geom, accumulate):
        a_tile = cuda.shared.array(shape=(tile, tile), dtype=float32)
        b_tile = cuda.shared.array(shape=(tile, tile), dtype=float32)
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        z = cuda.blockIdx.z
        i = cuda.blockIdx.y * tile + ty
        j = cuda.blockIdx.x * tile + tx
        k_begin, k_end = k_range(K, k_chunk, z)
        acc = float32(0.0)
        for k0 in range(k_begin, k_end, tile):
            # Each thread stages one element of A's slab and one of B's; zeros pad the edges.
            if i < M and k0 + tx < k_end:
                a_tile[ty, tx] = load_a(A, i, k0 + tx, z, geom)
            else:
                a_tile[ty, tx] = float32(0.0)
            if k0 + ty < k_end and j < N:
                b_tile[ty, tx] = load_b(B, k0 + ty, j, z, geom)
            else:
                b_tile[ty, tx] = float32(0.0)
            cuda.syncthreads()
            for kk in range(tile):  # past k_end both tiles hold zeros, which add exactly nothing
                acc += a_tile[ty, kk] * b_tile[kk, tx]
            cuda.syncthreads()
        if i < M and j < N:
            store_c(C, i, j, z, geom, acc, accumulate)

    return cuda.jit(_named(kernel, f"{operands.name}_v2_tiled"))


V3_MIN_BLOCKS_PER_SM = 3
"""v3's launch bound: NVVM must fit three 256-thread blocks per SM (at most 85 registers a thread).

Unbounded, ptxas gave v3 108–126 registers, two blocks per SM (25% occupancy, sm_80 and sm_90);
bounded to three it uses 78–80 with no spills (37.5%); four (64 registers) spills 12–76 bytes a
thread. Read off ``engine kernels --backend cuda --static``; whether 37.5% beats 25% on a real GPU
is for the acceptance run to show (the GEMM has no software pipelining, so more resident warps are
what hides its global loads)."""


def _jit_options(threads: int, min_blocks: int | None) -> dict[str, Any]:
    """``launch_bounds`` for the real compiler; the simulator's ``cuda.jit`` takes no such option."""
    if min_blocks is None or config.ENABLE_CUDASIM:
        return {}
    return {"launch_bounds": (threads, min_blocks)}


def make_gemm_v3_register_blocked(
    block_m: int,
    block_n: int,
    block_k: int,
    thread_m: int,
    thread_n: int,
    operands: Operands = MATRIX,
    min_blocks: int | None = V3_MIN_BLOCKS_PER_SM,
) -> Any:
    """The register-blocked kernel: a BLOCK_M×BLOCK_N tile per block, THREAD_M×THREAD_N outputs per thread.

    Launch with threads (block_n // thread_n, block_m // thread_m). Thread (tx, ty) owns rows
    ty + a·threads_y and columns tx + b·threads_x of the block's tile: strided, so a warp's
    reads of b_tile are consecutive. ``min_blocks`` is the launch bound (blocks per SM).
    """
    threads_x = block_n // thread_n
    threads_y = block_m // thread_m
    threads = threads_x * threads_y
    if threads_x * thread_n != block_n or threads_y * thread_m != block_m:
        raise ValueError("block_m and block_n must be multiples of thread_m and thread_n")
    load_a, load_b, store_c = operands.load_a, operands.load_b, operands.store_c

    def kernel(A, B, C, M, N, K, k_chunk, geom, accumulate):
        a_tile = cuda.shared.array(shape=(block_k, block_m), dtype=float32)  # stored k-major
        b_tile = cuda.shared.array(shape=(block_k, block_n), dtype=float32)
        c_tile = cuda.shared.array(shape=(block_m, block_n), dtype=float32)
        acc = cuda.local.array(shape=(thread_m, thread_n), dtype=float32)
        a_frag = cuda.local.array(shape=thread_m, dtype=float32)
        b_frag = cuda.local.array(shape=thread_n, dtype=float32)
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        z = cuda.blockIdx.z
        tid = ty * threads_x + tx
        row0 = cuda.blockIdx.y * block_m
        col0 = cuda.blockIdx.x * block_n
        k_begin, k_end = k_range(K, k_chunk, z)
        for a in range(thread_m):
            for b in range(thread_n):
                acc[a, b] = float32(0.0)
        for k0 in range(k_begin, k_end, block_k):
            # All threads cooperatively stage A[row0 : row0+BM, k0 : k0+BK] and B[k0 : k0+BK, col0 : col0+BN].
            for e in range(tid, block_m * block_k, threads):
                r = e // block_k
                kk = e - r * block_k
                if row0 + r < M and k0 + kk < k_end:
                    a_tile[kk, r] = load_a(A, row0 + r, k0 + kk, z, geom)
                else:
                    a_tile[kk, r] = float32(0.0)
            for e in range(tid, block_k * block_n, threads):
                kk = e // block_n
                c = e - kk * block_n
                if k0 + kk < k_end and col0 + c < N:
                    b_tile[kk, c] = load_b(B, k0 + kk, col0 + c, z, geom)
                else:
                    b_tile[kk, c] = float32(0.0)
            cuda.syncthreads()
            for kk in range(block_k):
                if k0 + kk < k_end:
                    for a in range(thread_m):
                        a_frag[a] = a_tile[kk, ty + a * threads_y]
                    for b in range(thread_n):
                        b_frag[b] = b_tile[kk, tx + b * threads_x]
                    for a in range(thread_m):
                        for b in range(thread_n):
                            acc[a, b] += a_frag[a] * b_frag[b]
            cuda.syncthreads()
        # Through shared memory to C: the copy out of ``acc`` has constant indices once unrolled, so
        # the accumulators stay in registers however costly store_c's index arithmetic is (called
        # in the unrolled loop, conv's stores kept the loop rolled and put acc in local memory);
        # and consecutive threads then store consecutive columns of C.
        for a in range(thread_m):
            for b in range(thread_n):
                c_tile[ty + a * threads_y, tx + b * threads_x] = acc[a, b]
        cuda.syncthreads()
        for e in range(tid, block_m * block_n, threads):
            r = e // block_n
            c = e - r * block_n
            if row0 + r < M and col0 + c < N:
                store_c(C, row0 + r, col0 + c, z, geom, c_tile[r, c], accumulate)

    return cuda.jit(_named(kernel, f"{operands.name}_v3_register_blocked"), **_jit_options(threads, min_blocks))


def _vector(per_thread: int) -> int:
    return next(v for v in (4, 2, 1) if per_thread % v == 0)


@dataclass(frozen=True)
class TileConfig:
    """One member of the tile family: the block's C tile, its k-slab, each thread's C patch, pipelining.

    ``double_buffer``: two shared-memory stages; the next slab's global loads are issued into
    registers before the FMAs of the current one and stored to the other stage after them, so one
    barrier per slab and the loads' latency hides behind the FMAs (Boehm's SGEMM worklog, kernels
    9–10; llm.c's matmul). Without it, the same code stages one slab at a time (two barriers each).
    ``min_blocks``: the launch bound handed to NVVM (None: unbounded); ptxas must then fit that many
    blocks per SM without a spill (tests/kernels/cuda/test_compile_ptx.py).

    Thread (tx, ty) owns groups of ``vector_m`` consecutive rows, ty·vector_m + g·threads_y·vector_m
    + (0 … vector_m − 1) for g = 0, 1, …, and likewise groups of ``vector_n`` columns (CUTLASS's and
    llm.c's layout): per k it reads its A and B fragments from shared memory as thread_m / vector_m and
    thread_n / vector_n loads of 4 words (LDS.128), not thread_m + thread_n scalar loads, and the 8
    threads of each quarter-warp phase read 128 consecutive bytes of B (no bank conflict; A's are
    broadcasts). Which thread computes an output changes, not the order of its products: the same bits.
    Shared-memory offsets in the loop are uint32 bases (no 64-bit address arithmetic, no wraparound test;
    a fragment's index is such a base plus a literal, which LLVM proves non-negative).
    SASS per k-slab, sm_90 (``engine kernels --backend cuda --static``, column "loop SASS/FFMA"): plain
    GEMM 64×64 4×4 5.96 → 1.76 instructions per FFMA, 128×128 8×8 3.28 → 1.31 (with ``_slab_fma``). Loads: thread t stages ``loads_a`` consecutive k of one
    A row (row t // (block_k / loads_a)) and ``loads_b`` k of one B column (column t mod block_n),
    the same row and column for every slab, which is what lets the operands' per-row and per-column
    index arithmetic (``prep_a`` / ``prep_b``) run once per thread instead of once per load.
    """

    block_m: int
    block_n: int
    block_k: int
    thread_m: int
    thread_n: int
    double_buffer: bool = True
    min_blocks: int | None = None

    @property
    def name(self) -> str:
        buffers = "" if self.double_buffer else "-single"
        return f"{self.block_m}x{self.block_n}k{self.block_k}t{self.thread_m}x{self.thread_n}{buffers}"

    @property
    def threads_xy(self) -> tuple[int, int]:
        return self.block_n // self.thread_n, self.block_m // self.thread_m

    @property
    def threads(self) -> int:
        x, y = self.threads_xy
        return x * y

    @property
    def vector_m(self) -> int:
        """Consecutive tile rows a thread owns (4, or thread_m if smaller): its A fragment is read from
        shared memory as thread_m / vector_m loads of vector_m words (LDS.128 when 4)."""
        return _vector(self.thread_m)

    @property
    def vector_n(self) -> int:
        return _vector(self.thread_n)

    @property
    def loads_a(self) -> int:
        return self.block_m * self.block_k // self.threads

    @property
    def loads_b(self) -> int:
        return self.block_k * self.block_n // self.threads

    @property
    def a_stride(self) -> int:
        """Words between consecutive k rows of A's slab in shared memory: block_m, plus 4 when several threads
        stage one A row (``block_k / loads_a`` of them, at k offsets ``loads_a`` apart). Unpadded, their
        stores of one row fall in the same bank (block_m is a multiple of 32 words): a 4-way conflict at
        64×64 k8 (2-way at 128×128) on every A store. With 4 more words per k row, k offset j shifts
        the bank by 4·j·loads_a: conflict-free at 64×64 k8 and 128×128, 2-way at 64×64 k16. A multiple of
        4, so the fragments' LDS.128 stay aligned."""
        return self.block_m + (4 if self.block_k // max(1, self.loads_a) > 1 else 0)

    @property
    def shared_floats(self) -> int:
        """Both stages of A and B, or the epilogue's threads_y × block_n rows, whichever is larger."""
        stages = 2 if self.double_buffer else 1
        return max(stages * self.block_k * (self.a_stride + self.block_n), self.threads_xy[1] * self.block_n)

    def check(self) -> TileConfig:
        """Raise ValueError unless every thread has a fixed A row and B column (what the loads assume)."""
        bm, bn, bk, threads = self.block_m, self.block_n, self.block_k, self.threads
        problems = []
        if bm % self.thread_m or bn % self.thread_n:
            problems.append("block_m and block_n must be multiples of thread_m and thread_n")
        elif threads < bm or (bm * bk) % threads or bk % max(1, self.loads_a):
            problems.append(f"A tile {bm}x{bk} does not split into one row per thread for {threads} threads")
        elif threads % bn or bk % (threads // bn):
            problems.append(f"B tile {bk}x{bn} does not split into one column per thread for {threads} threads")
        if problems:
            raise ValueError(f"tile config {self.name}: {problems[0]}")
        return self


def _slab_fma(a_stride: int, bn: int, bk: int, tm: int, tn: int, vm: int, vn: int, a_group: int, b_group: int) -> Any:
    """The FMAs of one k-slab as a device function whose k loop is spelled out, one call per k.

    Written as ``for kk in range(bk)``, NVVM unrolls the fragment loops inside but keeps the k loop rolled
    (its body is too large for the unroller: 64 FMAs at 8×8), and each trip recomputes its shared-memory
    addresses and a 64-bit loop counter: 86 SASS instructions per 64 FFMAs at 128×128. Generated
    source with the offsets as literals leaves each load ``LDS.128 [base + constant]``. The per-k
    body (``k_step``) is ordinary code; only the sequence of calls is generated."""

    def k_step(smem, a_at, b_at, acc, a_frag, b_frag):  # a_at, b_at: a uint32 base plus a constant, as int64
        for a in range(tm):
            a_frag[a] = smem[a_at + ((a // vm) * a_group + a % vm)]
        for b in range(tn):
            b_frag[b] = smem[b_at + ((b // vn) * b_group + b % vn)]
        for a in range(tm):
            for b in range(tn):
                acc[a, b] += a_frag[a] * b_frag[b]

    calls = "".join(f"    k_step(smem, a_read + {kk * a_stride}, b_read + {kk * bn}, acc, a_frag, b_frag)\n"
                    for kk in range(bk))
    namespace = {"k_step": cuda.jit(device=True)(k_step)}
    exec(f"def slab_fma(smem, a_read, b_read, acc, a_frag, b_frag):\n{calls}", namespace)  # noqa: S102
    return cuda.jit(device=True)(namespace["slab_fma"])


def make_gemm_tiles(config: TileConfig, operands: Operands = MATRIX) -> Any:
    """The tile family's kernel for one configuration and one operand set (launch with threads config.threads_xy)."""
    config.check()
    bm, bn, bk, tm, tn = config.block_m, config.block_n, config.block_k, config.thread_m, config.thread_n
    threads_x, threads_y = config.threads_xy
    threads = config.threads
    la, lb = config.loads_a, config.loads_b
    a_threads_per_row = bk // la  # threads sharing one A row of a slab
    b_rows_step = threads // bn  # k distance between one thread's B loads
    stages = 2 if config.double_buffer else 1
    double = config.double_buffer
    a_stride = config.a_stride  # words between A's k rows in shared memory (block_m, padded)
    a_floats = stages * bk * a_stride  # smem[0 : a_floats] is A (k-major), then B; the epilogue reuses smem[0 : ...]
    vm, vn = config.vector_m, config.vector_n
    smem_alignment = None if numba_config.ENABLE_CUDASIM else 16  # LDS.128 needs 16 bytes; the simulator takes no alignment
    a_group = threads_y * vm  # rows between one thread's groups of vm consecutive rows
    b_group = threads_x * vn
    smem_floats = config.shared_floats
    prep_a, load_a_at, prep_b, load_b_at = operands.prep_a, operands.load_a_at, operands.prep_b, operands.load_b_at
    store_c = operands.store_c

    slab_fma = _slab_fma(a_stride, bn, bk, tm, tn, vm, vn, a_group, b_group)

    def kernel(A, B, C, M, N, K, k_chunk, geom, accumulate):
        smem = cuda.shared.array(shape=smem_floats, dtype=float32, alignment=smem_alignment)
        acc = cuda.local.array(shape=(tm, tn), dtype=float32)
        a_frag = cuda.local.array(shape=tm, dtype=float32)
        b_frag = cuda.local.array(shape=tn, dtype=float32)
        a_next = cuda.local.array(shape=la, dtype=float32)
        b_next = cuda.local.array(shape=lb, dtype=float32)
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        z = cuda.blockIdx.z
        tid = ty * threads_x + tx
        row0 = cuda.blockIdx.y * bm
        col0 = cuda.blockIdx.x * bn
        k_begin, k_end = k_range(K, k_chunk, z)
        # This thread's A row and B column, and their index arithmetic, once for the whole k range.
        a_row = tid // a_threads_per_row
        a_k = (tid - a_row * a_threads_per_row) * la
        a_ok = row0 + a_row < M
        pa = prep_a(A, row0 + a_row if a_ok else 0, z, geom)
        b_col = tid % bn
        b_k = tid // bn
        b_ok = col0 + b_col < N
        pb = prep_b(B, col0 + b_col if b_ok else 0, z, geom)
        a_read0 = U32(ty * vm)
        a_store = U32(a_k * a_stride + a_row)  # this thread's A and B words of stage 0 (uint32 offsets, as the reads)
        b_store = U32(a_floats + b_k * bn + b_col)
        b_read0 = U32(a_floats + tx * vn)
        for a in range(tm):
            for b in range(tn):
                acc[a, b] = float32(0.0)
        slabs = (k_end - k_begin + bk - 1) // bk
        # Prologue: slab 0 into registers, then into stage 0.
        for l in range(la):
            k = k_begin + a_k + l
            a_next[l] = load_a_at(A, pa, k, z, geom) if a_ok and U32(k) < U32(k_end) else float32(0.0)
        for l in range(lb):
            k = k_begin + b_k + l * b_rows_step
            b_next[l] = load_b_at(B, pb, k, z, geom) if b_ok and U32(k) < U32(k_end) else float32(0.0)
        for l in range(la):
            smem[U32(a_store + l * a_stride)] = a_next[l]
        for l in range(lb):
            smem[U32(b_store + l * b_rows_step * bn)] = b_next[l]
        cuda.syncthreads()
        for t in range(slabs):
            stage = t % stages
            k_next = k_begin + (t + 1) * bk
            more = t + 1 < slabs
            if double and more:  # issue the next slab's global loads before this slab's FMAs
                for l in range(la):
                    k = k_next + a_k + l
                    a_next[l] = load_a_at(A, pa, k, z, geom) if a_ok and U32(k) < U32(k_end) else float32(0.0)
                for l in range(lb):
                    k = k_next + b_k + l * b_rows_step
                    b_next[l] = load_b_at(B, pb, k, z, geom) if b_ok and U32(k) < U32(k_end) else float32(0.0)
            # This slab's stage: A's fragment starts at row ty·vm of the stage, B's at column tx·vn (uint32
            # offsets: no negative-index wraparound, no 64-bit address arithmetic in the loop below).
            a_read = U32(stage * (bk * a_stride) + a_read0)
            b_read = U32(stage * (bk * bn) + b_read0)
            slab_fma(smem, a_read, b_read, acc, a_frag, b_frag)  # past k_end both slabs hold zeros: they add 0
            if double:
                if more:  # the other stage was last read before the previous barrier: free to fill
                    other = 1 - stage
                    for l in range(la):
                        smem[U32(a_store + other * (bk * a_stride) + l * a_stride)] = a_next[l]
                    for l in range(lb):
                        smem[U32(b_store + other * (bk * bn) + l * b_rows_step * bn)] = b_next[l]
                cuda.syncthreads()
            else:
                cuda.syncthreads()
                if more:
                    for l in range(la):
                        k = k_next + a_k + l
                        smem[U32(a_store + l * a_stride)] = (
                            load_a_at(A, pa, k, z, geom) if a_ok and U32(k) < U32(k_end) else float32(0.0))
                    for l in range(lb):
                        k = k_next + b_k + l * b_rows_step
                        smem[U32(b_store + l * b_rows_step * bn)] = (
                            load_b_at(B, pb, k, z, geom) if b_ok and U32(k) < U32(k_end) else float32(0.0))
                    cuda.syncthreads()
        # Epilogue through shared memory, threads_y rows of the tile at a time: the copy out of acc has
        # constant indices once unrolled (acc stays in registers), and consecutive threads store
        # consecutive columns of C.
        # acc's indices must be constants after unrolling or acc goes to local memory (ptxas: a stack frame of
        # exactly tm·tn·4 bytes). The loop over a holds stores and barriers and stays rolled for large
        # tiles, so it always copies row 0 and then moves rows 1.. up by one (register renames).
        # Row a of this thread's patch is tile row (a // vm)·a_group + ty·vm + a % vm; column b is
        # (b // vn)·b_group + tx·vn + b % vn.
        for a in range(tm):
            for b in range(tn):
                smem[U32(ty * bn + tx * vn + ((b // vn) * b_group + b % vn))] = acc[0, b]
            for a2 in range(tm - 1):
                for b in range(tn):
                    acc[a2, b] = acc[a2 + 1, b]
            cuda.syncthreads()
            row_a = (a // vm) * a_group + a % vm
            for q in range(tn):
                e = tid + q * threads
                r = e // bn
                c = e - r * bn
                i = row0 + r * vm + row_a
                if i < M and col0 + c < N:
                    store_c(C, i, col0 + c, z, geom, smem[U32(e)], accumulate)
            cuda.syncthreads()

    name = f"{operands.name}_tiles_{config.name.replace('-', '_')}"
    return cuda.jit(_named(kernel, name), **_jit_options(threads, config.min_blocks))


@dataclass(frozen=True)
class GemmVersion:
    """A GEMM version and its launch shape: each block computes a tile_m × tile_n tile of C.

    ``build(operands)`` makes the kernel for a set of operands; ``kernel(operands)`` caches it.
    """

    name: str
    build: Any = field(repr=False)
    threads: tuple[int, int]  # (x, y)
    tile_m: int
    tile_n: int

    def kernel(self, operands: Operands = MATRIX) -> Any:
        return _kernel_for(self, operands)

    def run(
        self,
        operands: Operands,
        A: Any,
        B: Any,
        C: Any,
        M: int,
        N: int,
        K: int,
        geom: tuple[int, ...] = NO_GEOMETRY,
        z: int = 1,
        k_chunk: int | None = None,
        accumulate: bool = False,
    ) -> None:
        """One launch: a grid of C tiles, ``z`` deep (groups × splits for conv)."""
        blocks = ((N + self.tile_n - 1) // self.tile_n, (M + self.tile_m - 1) // self.tile_m, z)
        chunk = max(1, K) if k_chunk is None else int(k_chunk)
        launch(self.kernel(operands), blocks, self.threads, A, B, C, M, N, K, chunk, geom, bool(accumulate))

    def __call__(self, A: Any, B: Any, C: Any, accumulate: bool = False) -> None:
        M, K = A.shape
        if B.shape[0] != K or C.shape != (M, B.shape[1]):
            raise ValueError(f"gemm {self.name}: shapes A{A.shape} @ B{B.shape} -> C{C.shape} do not match")
        self.run(MATRIX, A, B, C, M, C.shape[1], K, accumulate=accumulate)


@functools.cache
def _kernel_for(version: GemmVersion, operands: Operands) -> Any:
    return version.build(operands)


@functools.cache
def naive_version(threads: int = 16) -> GemmVersion:
    return GemmVersion("v1_naive", make_gemm_v1_naive, (threads, threads), threads, threads)


@functools.cache
def tiled_version(tile: int = 16) -> GemmVersion:
    return GemmVersion("v2_tiled", functools.partial(make_gemm_v2_tiled, tile), (tile, tile), tile, tile)


@functools.cache
def register_blocked_version(
    block_m: int = 64, block_n: int = 64, block_k: int = 8, thread_m: int = 4, thread_n: int = 4
) -> GemmVersion:
    build = functools.partial(make_gemm_v3_register_blocked, block_m, block_n, block_k, thread_m, thread_n)
    threads = (block_n // thread_n, block_m // thread_m)
    return GemmVersion("v3_register_blocked", build, threads, block_m, block_n)


@functools.cache
def tile_version(config: TileConfig) -> GemmVersion:
    """The tile family's member for ``config`` as a GemmVersion (cached: one kernel per config and operands)."""
    config.check()
    return GemmVersion(f"tiles_{config.name}", functools.partial(make_gemm_tiles, config), config.threads_xy,
                       config.block_m, config.block_n)


# The numbered versions (what compile_ptx builds): 16×16 threads for v1; 16×16 tiles for v2; 64×64 block
# tiles, k-slabs of 8 and 4×4 outputs per thread for v3 (256 threads). "v4" is the tile family with a
# configuration chosen per shape from the table (below).
VERSIONS = {
    "v1": naive_version,
    "v2": tiled_version,
    "v3": register_blocked_version,
}
gemm_v1_naive = naive_version().kernel()
gemm_v2_tiled = tiled_version().kernel()
gemm_v3_register_blocked = register_blocked_version().kernel()

CANDIDATES: dict[str, TileConfig] = {
    c.name: c.check()
    for c in (
        TileConfig(64, 64, 8, 4, 4, min_blocks=2),
        TileConfig(64, 64, 8, 4, 4, double_buffer=False, min_blocks=2),
        TileConfig(64, 64, 16, 4, 4, min_blocks=2),
        TileConfig(128, 64, 8, 8, 4),
        TileConfig(64, 128, 8, 4, 8, min_blocks=2),
        TileConfig(128, 128, 8, 8, 8, min_blocks=1),
        TileConfig(32, 32, 8, 2, 2, min_blocks=2),
    )
}
"""The configurations the tile search (benchmarks/gpu_tile_search.py) times on each shape; the table names
one of them per shape. From Boehm's worklog and the first H100 run (kernels/README.md): 128×128 with 8×8
per thread won the large square GEMMs (v3 tiles, no pipelining), small tiles won the deep 4×4 layers
whose outputs are few tiles; the others are the steps between. Every one is built to SASS with its
registers, spills and occupancy in the static report."""

DEFAULT_CONFIG = "64x64k8t4x4"
"""The configuration for shapes the table does not name: v3's tile, double-buffered (what the first H100
run and the static report support without a measurement of the family)."""

SIMULATOR_CONFIG = TileConfig(8, 8, 8, 2, 2)
"""Under the simulator every CUDA thread is a Python thread: the same kernel on an 8×8 tile of 16 threads
(one barrier per 8-deep slab: a conv forward at 2×8×8×8 ran in 4.0 s against v3 8×8's 6.3 s here)."""

TABLE_PATH = os.path.join(os.path.dirname(__file__), "gemm_table.json")
TABLE_ENV = "ENGINE_GEMM_TABLE"
"""Set to another table file (the tile search's fresh output) to run with it without committing it."""


@dataclass(frozen=True)
class Choice:
    """What one GEMM launch runs: the version (kernel family member) and how many k-splits."""

    version: GemmVersion
    splits: int = 1


def shape_key(op: str, M: int, N: int, K: int, z: int) -> str:
    """The table's key for one GEMM: operand set, sizes and grid depth (groups × phases)."""
    return f"{op}:{int(M)}x{int(N)}x{int(K)}:z{int(z)}"


@functools.cache
def _load_table(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as handle:
        table = json.load(handle)
    entries = table.get("entries", {})
    default = table.get("default", DEFAULT_CONFIG)
    for key, entry in [("default", {"config": default}), *entries.items()]:
        if entry.get("config") not in CANDIDATES:
            raise ValueError(f"GEMM table {path}: {key} names config {entry.get('config')!r}, not one of "
                             f"{', '.join(CANDIDATES)}: refill it with benchmarks/gpu_tile_search.py")
        if int(entry.get("splits", 1)) < 1:
            raise ValueError(f"GEMM table {path}: {key} has splits {entry.get('splits')}, must be >= 1")
    return {"default": default, "entries": entries}


def gemm_table() -> dict[str, Any]:
    """The table in use: $ENGINE_GEMM_TABLE if set, else kernels/cuda/gemm_table.json."""
    return _load_table(os.environ.get(TABLE_ENV) or TABLE_PATH)


_active: list[GemmVersion] = []
_forced: list[Choice] = []


def use_gemm(version: str | GemmVersion | None) -> GemmVersion | None:
    """Choose the GEMM conv and dense run: "v1", "v2", "v3", a built version, or None / "v4" (the table).

    The benchmarks call this to time each version; tests call it with tiny tiles for the simulator.
    Returns the previous choice (None: the table) so a caller can put it back.
    """
    previous = _active[0] if _active else None
    if version is None or version == "v4":
        _active.clear()
        return previous
    if isinstance(version, str):
        try:
            version = VERSIONS[version]()
        except KeyError:
            raise ValueError(f"unknown GEMM version {version!r}; choose one of {', '.join(VERSIONS)} or v4") from None
    _active[:] = [version]
    return previous


@contextmanager
def forced_choice(config: TileConfig | GemmVersion, splits: int = 1) -> Iterator[Choice]:
    """Every GEMM inside the block runs ``config`` with ``splits`` k-splits (the tile search, the tests).

    The conv launchers and their ``*_workspace_size`` functions both read the choice, so scratch sized
    inside the block fits the launch inside it.
    """
    version = tile_version(config) if isinstance(config, TileConfig) else config
    choice = Choice(version, int(splits))
    _forced.append(choice)
    try:
        yield choice
    finally:
        _forced.remove(choice)


def choose(op: str, M: int, N: int, K: int, z: int, splits: int = 1) -> Choice:
    """The version and k-splits for one GEMM: a forced choice, else the table (version unless use_gemm
    picked one; splits from the table where it names them, else ``splits``, the caller's heuristic).

    Under the simulator the table's tiles are replaced by ``SIMULATOR_CONFIG`` (the same kernel), its
    splits kept: results depend on the splits, never on the tile.
    """
    if _forced:
        return _forced[-1]
    table = gemm_table()
    entry = table["entries"].get(shape_key(op, M, N, K, z), {})
    splits = int(entry.get("splits", splits))
    if _active:
        return Choice(_active[0], splits)
    if config.ENABLE_CUDASIM:
        return Choice(tile_version(SIMULATOR_CONFIG), splits)
    return Choice(tile_version(CANDIDATES[entry.get("config", table["default"])]), splits)


def active_gemm() -> GemmVersion:
    """The version a plain GEMM of unknown shape would run (use_gemm's choice, else the table's default)."""
    if _active:
        return _active[0]
    if config.ENABLE_CUDASIM:
        return tile_version(SIMULATOR_CONFIG)
    return tile_version(CANDIDATES[gemm_table()["default"]])


def gemm(A: Any, B: Any, C: Any, accumulate: bool = False) -> None:
    """C = A @ B (+ C when accumulate) with the chosen version; A, B, C are 2-D float32 views (never split)."""
    M, K = A.shape
    choose("gemm", M, C.shape[1], K, 1).version(A, B, C, accumulate)

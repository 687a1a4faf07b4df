"""GEMM on the GPU in three numbered versions, side by side as llm.c's dev/cuda does.

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

Split-K: a launch may cut the k range into chunks of ``k_chunk`` (split ``z % splits`` takes chunk
``z % splits``, where ``splits = ceil(K / k_chunk)``); each split writes its own partial result and
the caller adds them in a fixed order (conv's weight gradient, whose K is the batch's pixels and
whose M·N is small). With ``k_chunk >= K`` there is one split, the plain GEMM.

Every version adds the products for one output in the same order (k = k_begin, k_begin + 1, ...,
the old C last), so all three give the same result up to the compiler's FMA contraction, and the
same bits on every run. Tile sizes are closure constants (shared arrays need compile-time shapes):
the ``make_*`` factories build a kernel for any size and any operands, which is how the simulator
tests run them on tiny tiles. ``gemm(...)`` and conv run the version ``use_gemm`` picked (v3 unless
told otherwise); the static report (``engine kernels --backend cuda --static``) shows why v3: no
spills, and the most FMAs per shared-memory load.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from numba import config, cuda, float32

from kernels.cuda._launch import launch

GEOMETRY_LENGTH = 11
"""Length of the ``geom`` tuple every GEMM kernel takes (conv's sizes; zeros for a plain GEMM)."""
NO_GEOMETRY = (0,) * GEOMETRY_LENGTH


@dataclass(frozen=True)
class Operands:
    """How a GEMM kernel reads A and B and writes C: three numba.cuda device functions."""

    name: str
    load_a: Any = field(repr=False)
    load_b: Any = field(repr=False)
    store_c: Any = field(repr=False)


@cuda.jit(device=True)
def _matrix_a(A, i, k, z, geom):
    return A[i, k]


@cuda.jit(device=True)
def _matrix_b(B, k, j, z, geom):
    return B[k, j]


@cuda.jit(device=True)
def _matrix_store(C, i, j, z, geom, value, accumulate):
    if accumulate:
        value += C[i, j]
    C[i, j] = value


MATRIX = Operands("gemm", _matrix_a, _matrix_b, _matrix_store)


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


# The production versions (what compile_ptx builds and a GPU runs): 16×16 threads for v1; 16×16 tiles
# for v2; 64×64 block tiles, k-slabs of 8 and 4×4 outputs per thread for v3, so 256 threads and
# 4 KiB of shared memory per block.
VERSIONS = {
    "v1": naive_version,
    "v2": tiled_version,
    "v3": register_blocked_version,
}
gemm_v1_naive = naive_version().kernel()
gemm_v2_tiled = tiled_version().kernel()
gemm_v3_register_blocked = register_blocked_version().kernel()

_active: list[GemmVersion] = []


def use_gemm(version: str | GemmVersion) -> GemmVersion:
    """Choose the GEMM that conv and dense run: "v1", "v2", "v3" (default sizes) or a built version.

    The benchmark calls this to time each version; tests call it with tiny tiles for the simulator.
    Returns the previous choice so a caller can put it back.
    """
    previous = active_gemm()
    if isinstance(version, str):
        try:
            version = VERSIONS[version]()
        except KeyError:
            raise ValueError(f"unknown GEMM version {version!r}; choose one of {', '.join(VERSIONS)}") from None
    _active[:] = [version]
    return previous


def active_gemm() -> GemmVersion:
    """The chosen version; by default v3, built with 8×8 block tiles under the simulator.

    The simulator runs each CUDA thread as a Python thread and pays per block and per barrier, so a
    64×64 tile of 256 threads makes a tiny network crawl there; the small build runs the same code.
    """
    if not _active:
        if config.ENABLE_CUDASIM:
            _active.append(register_blocked_version(8, 8, 8, 4, 4))
        else:
            _active.append(register_blocked_version())
    return _active[0]


def gemm(A: Any, B: Any, C: Any, accumulate: bool = False) -> None:
    """C = A @ B (+ C when accumulate) with the chosen version; A, B, C are 2-D float32 views."""
    active_gemm()(A, B, C, accumulate)

"""GEMM on the GPU in three numbered versions, side by side as llm.c's dev/cuda does.

``C[M,N] = A[M,K] @ B[K,N]`` (plus the old ``C`` when ``accumulate``). A, B and C are 2-D views of
any strides, so a transpose is just ``w.T`` on the host: conv and dense never copy to transpose.

- v1 naive: one thread per output, reading A's row and B's column from global memory. Every input
  element is fetched from DRAM (or L2) M or N times: memory-bound.
- v2 shared-memory tiled: a TILE×TILE block stages a TILE-wide slab of A and of B in shared memory,
  then every thread reads its TILE products from there. Global traffic drops by a factor TILE.
- v3 register-blocked: each thread owns a THREAD_M×THREAD_N patch of C in registers; per k it loads
  THREAD_M values of A and THREAD_N of B from shared memory and does THREAD_M·THREAD_N FMAs, so
  shared-memory traffic per FMA drops too, and the block's tile (BLOCK_M×BLOCK_N) grows without
  more threads.

Every version adds the products for one output in the same order (k = 0, 1, ..., K-1, the old C
last), so all three give the same result up to the compiler's FMA contraction, and the same bits on
every run. Tile sizes are closure constants (shared arrays need compile-time shapes): the
``make_*`` factories build a kernel for any size, which is how the simulator tests run them on tiny
tiles. ``gemm(...)`` runs the version ``use_gemm`` picked (v3 unless told otherwise). The choice
is untimed: this project had no GPU to measure on, so v3 is the default because it does the most
arithmetic per byte loaded, not because a benchmark here said so.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from numba import config, cuda, float32

from kernels.cuda._launch import launch


@cuda.jit
def gemm_v1_naive(A, B, C, accumulate):
    """One thread per C[i, j]; threadIdx.x walks j so neighbouring threads read neighbouring B and C."""
    j, i = cuda.grid(2)
    M = C.shape[0]
    N = C.shape[1]
    K = A.shape[1]
    if i < M and j < N:
        acc = float32(0.0)
        for k in range(K):
            acc += A[i, k] * B[k, j]
        if accumulate:
            acc += C[i, j]
        C[i, j] = acc


def make_gemm_v2_tiled(tile: int) -> Any:
    """The shared-memory tiled kernel for TILE×TILE blocks (launch with threads (tile, tile))."""

    @cuda.jit
    def gemm_v2_tiled(A, B, C, accumulate):
        a_tile = cuda.shared.array(shape=(tile, tile), dtype=float32)
        b_tile = cuda.shared.array(shape=(tile, tile), dtype=float32)
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        i = cuda.blockIdx.y * tile + ty
        j = cuda.blockIdx.x * tile + tx
        M = C.shape[0]
        N = C.shape[1]
        K = A.shape[1]
        acc = float32(0.0)
        for k0 in range(0, K, tile):
            # Each thread stages one element of A's slab and one of B's; zeros pad the edges.
            if i < M and k0 + tx < K:
                a_tile[ty, tx] = A[i, k0 + tx]
            else:
                a_tile[ty, tx] = float32(0.0)
            if k0 + ty < K and j < N:
                b_tile[ty, tx] = B[k0 + ty, j]
            else:
                b_tile[ty, tx] = float32(0.0)
            cuda.syncthreads()
            for kk in range(tile):  # past K both tiles hold zeros, which add exactly nothing
                acc += a_tile[ty, kk] * b_tile[kk, tx]
            cuda.syncthreads()
        if i < M and j < N:
            if accumulate:
                acc += C[i, j]
            C[i, j] = acc

    return gemm_v2_tiled


def make_gemm_v3_register_blocked(block_m: int, block_n: int, block_k: int, thread_m: int, thread_n: int) -> Any:
    """The register-blocked kernel: a BLOCK_M×BLOCK_N tile per block, THREAD_M×THREAD_N outputs per thread.

    Launch with threads (block_n // thread_n, block_m // thread_m). Thread (tx, ty) owns rows
    ty + a·threads_y and columns tx + b·threads_x of the block's tile: strided, so a warp's stores
    to C and its reads of b_tile are consecutive.
    """
    threads_x = block_n // thread_n
    threads_y = block_m // thread_m
    threads = threads_x * threads_y
    if threads_x * thread_n != block_n or threads_y * thread_m != block_m:
        raise ValueError("block_m and block_n must be multiples of thread_m and thread_n")

    @cuda.jit
    def gemm_v3_register_blocked(A, B, C, accumulate):
        a_tile = cuda.shared.array(shape=(block_k, block_m), dtype=float32)  # stored k-major
        b_tile = cuda.shared.array(shape=(block_k, block_n), dtype=float32)
        acc = cuda.local.array(shape=(thread_m, thread_n), dtype=float32)
        a_frag = cuda.local.array(shape=thread_m, dtype=float32)
        b_frag = cuda.local.array(shape=thread_n, dtype=float32)
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        tid = ty * threads_x + tx
        row0 = cuda.blockIdx.y * block_m
        col0 = cuda.blockIdx.x * block_n
        M = C.shape[0]
        N = C.shape[1]
        K = A.shape[1]
        for a in range(thread_m):
            for b in range(thread_n):
                acc[a, b] = float32(0.0)
        for k0 in range(0, K, block_k):
            # All threads cooperatively stage A[row0 : row0+BM, k0 : k0+BK] and B[k0 : k0+BK, col0 : col0+BN].
            for e in range(tid, block_m * block_k, threads):
                r = e // block_k
                kk = e - r * block_k
                if row0 + r < M and k0 + kk < K:
                    a_tile[kk, r] = A[row0 + r, k0 + kk]
                else:
                    a_tile[kk, r] = float32(0.0)
            for e in range(tid, block_k * block_n, threads):
                kk = e // block_n
                c = e - kk * block_n
                if k0 + kk < K and col0 + c < N:
                    b_tile[kk, c] = B[k0 + kk, col0 + c]
                else:
                    b_tile[kk, c] = float32(0.0)
            cuda.syncthreads()
            for kk in range(block_k):
                if k0 + kk < K:
                    for a in range(thread_m):
                        a_frag[a] = a_tile[kk, ty + a * threads_y]
                    for b in range(thread_n):
                        b_frag[b] = b_tile[kk, tx + b * threads_x]
                    for a in range(thread_m):
                        for b in range(thread_n):
                            acc[a, b] += a_frag[a] * b_frag[b]
            cuda.syncthreads()
        for a in range(thread_m):
            i = row0 + ty + a * threads_y
            for b in range(thread_n):
                j = col0 + tx + b * threads_x
                if i < M and j < N:
                    value = acc[a, b]
                    if accumulate:
                        value += C[i, j]
                    C[i, j] = value

    return gemm_v3_register_blocked


@dataclass(frozen=True)
class GemmVersion:
    """A GEMM kernel and its launch shape: each block computes a tile_m × tile_n tile of C."""

    name: str
    kernel: Any
    threads: tuple[int, int]  # (x, y)
    tile_m: int
    tile_n: int

    def __call__(self, A: Any, B: Any, C: Any, accumulate: bool = False) -> None:
        M, K = A.shape
        if B.shape[0] != K or C.shape != (M, B.shape[1]):
            raise ValueError(f"gemm {self.name}: shapes A{A.shape} @ B{B.shape} -> C{C.shape} do not match")
        N = C.shape[1]
        blocks = ((N + self.tile_n - 1) // self.tile_n, (M + self.tile_m - 1) // self.tile_m)
        launch(self.kernel, blocks, self.threads, A, B, C, bool(accumulate))


def naive_version(threads: int = 16) -> GemmVersion:
    return GemmVersion("v1_naive", gemm_v1_naive, (threads, threads), threads, threads)


@functools.cache
def tiled_version(tile: int = 16) -> GemmVersion:
    kernel = gemm_v2_tiled if tile == 16 else make_gemm_v2_tiled(tile)
    return GemmVersion("v2_tiled", kernel, (tile, tile), tile, tile)


@functools.cache
def register_blocked_version(
    block_m: int = 64, block_n: int = 64, block_k: int = 8, thread_m: int = 4, thread_n: int = 4
) -> GemmVersion:
    if (block_m, block_n, block_k, thread_m, thread_n) == (64, 64, 8, 4, 4):
        kernel = gemm_v3_register_blocked
    else:
        kernel = make_gemm_v3_register_blocked(block_m, block_n, block_k, thread_m, thread_n)
    threads = (block_n // thread_n, block_m // thread_m)
    return GemmVersion("v3_register_blocked", kernel, threads, block_m, block_n)


# The production kernels (what compile_ptx builds and a GPU runs): 16×16 tiles; 64×64 block tiles,
# k-slabs of 8 and 4×4 outputs per thread, so 256 threads and 4 KiB of shared memory per block.
gemm_v2_tiled = make_gemm_v2_tiled(16)
gemm_v3_register_blocked = make_gemm_v3_register_blocked(64, 64, 8, 4, 4)

VERSIONS = {
    "v1": naive_version,
    "v2": tiled_version,
    "v3": register_blocked_version,
}

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

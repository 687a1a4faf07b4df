"""Per-channel helpers shared by conv, dense and batch norm: bias add and deterministic channel sums.

A channel sum runs in one block: each thread adds a strided slice in a fixed order into its own
shared-memory slot, then a tree halves the slots until slot 0 holds the total (the same tree is
written out in batch norm, the loss and depthwise backward-weight: numba-cuda compiles a device
function for the *current* GPU, which would stop compile_ptx from proving the kernels build on a
machine without one). No atomics: for a
given shape the block size, and so every rounding step, is the same on every run.
"""

from __future__ import annotations

from typing import Any

from numba import cuda, float32

from kernels.cuda._launch import MAX_REDUCTION_THREADS, THREADS_PER_BLOCK, blocks_for, launch, reduction_threads


@cuda.jit
def channel_sum(x, out):
    """out[c] = Σ_{n, p} x[n, c, p]: block c reduces channel c (x is an [N, C, P] view)."""
    partial = cuda.shared.array(shape=MAX_REDUCTION_THREADS, dtype=float32)
    c = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    threads = cuda.blockDim.x
    P = x.shape[2]
    count = x.shape[0] * P
    acc = float32(0.0)
    for e in range(tid, count, threads):
        n = e // P
        acc += x[n, c, e - n * P]
    partial[tid] = acc
    cuda.syncthreads()
    step = threads // 2
    while step > 0:  # fixed-order tree: slot t adds slot t + step, halving until slot 0 holds the total
        if tid < step:
            partial[tid] += partial[tid + step]
        cuda.syncthreads()
        step //= 2
    if tid == 0:
        out[c] = partial[0]


@cuda.jit
def add_channel_bias(x, bias):
    """x[n, c, p] += bias[c], one thread per element (x is an [N, C, P] view)."""
    e = cuda.grid(1)
    C = x.shape[1]
    P = x.shape[2]
    if e < x.shape[0] * C * P:
        n = e // (C * P)
        rest = e - n * C * P
        c = rest // P
        x[n, c, rest - c * P] += bias[c]


def sum_channels(x3: Any, out: Any) -> None:
    """out[c] = sum of channel c of the [N, C, P] view x3, deterministically."""
    N, C, P = x3.shape
    launch(channel_sum, C, reduction_threads(N * P), x3, out)


def add_bias(x3: Any, bias: Any) -> None:
    launch(add_channel_bias, blocks_for(x3.size), THREADS_PER_BLOCK, x3, bias)

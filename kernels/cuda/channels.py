"""Per-channel helpers shared by conv, dense and batch norm: bias add and deterministic channel sums.

A channel sum runs in one block: each thread adds a strided slice in a fixed order, then
``block_sum`` (kernels/cuda/reduce.py, the one tree every reduction uses) adds the threads'
totals. No atomics: for a given shape the block size, and so every rounding step, is the same on
every run.
"""

from __future__ import annotations

from typing import Any

from numba import cuda, float32

from kernels.cuda._launch import MAX_REDUCTION_THREADS, THREADS_PER_BLOCK, blocks_for, launch, reduction_threads
from kernels.cuda.reduce import block_sum, channel_range_sum


@cuda.jit
def channel_sum(x, out):
    """out[c] = Σ_{n, p} x[n, c, p]: block c reduces channel c (x is an [N, C, P] view)."""
    partial = cuda.shared.array(shape=MAX_REDUCTION_THREADS, dtype=float32)
    c = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    threads = cuda.blockDim.x
    P = x.shape[2]
    total = block_sum(partial, channel_range_sum(x, c, tid, x.shape[0] * P, threads, P))
    if tid == 0:
        out[c] = total


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

"""The one block reduction every CUDA kernel uses: a fixed-order shared-memory tree.

Each thread puts its partial sum (of a strided slice it added in a fixed order) into its own slot of
a shared buffer; the tree halves the active threads each step, slot t adding slot t + step, until
slot 0 holds the total. The block size is a power of two fixed by the problem's shape
(``reduction_threads``), so every rounding step is the same on every run: no atomics anywhere.

Channel sums (bias gradients), batch-norm statistics and gradients, the loss mean and the depthwise
weight gradient all call ``block_sum``; it was written out six times before. A thread's walk over its
values of one channel (``channel_cursor``, ``channel_range_sum``) is shared by the channel sums and batch norm. NVVM inlines it into
each kernel (no call in the PTX). A numba-cuda device function is compiled on first use for the
*current* GPU, so ``compile_ptx`` on a machine without one needs the stand-in device of
``engine/bench/cuda_static.py`` (which is how the PTX test and the static report build them).
"""

from __future__ import annotations

from numba import cuda, float32


@cuda.jit(device=True)
def block_sum(partial, value):
    """Sum ``value`` over the (1-D, power-of-two) block; every thread gets the total.

    ``partial`` is a shared float32 buffer of at least blockDim.x slots. It may be reused as soon as
    this returns: the last barrier comes after every thread has read the total.
    """
    tid = cuda.threadIdx.x
    partial[tid] = value
    cuda.syncthreads()
    step = cuda.blockDim.x // 2
    while step > 0:
        if tid < step:
            partial[tid] += partial[tid + step]
        cuda.syncthreads()
        step //= 2
    total = partial[0]
    cuda.syncthreads()
    return total


@cuda.jit(device=True)
def channel_cursor(first, threads, P):
    """Where a thread's walk over a channel's N·P values starts, value ``first`` as (n, p), and the step
    (q, r) it moves (n, p) by for every ``threads`` values: the loops then need no division per value."""
    q = threads // P
    n = first // P
    return q, threads - q * P, n, first - n * P


@cuda.jit(device=True)
def channel_step(n, p, q, r, P):
    """(n, p) moved by ``channel_cursor``'s step (q, r): the next value of the thread's walk, no division."""
    n += q
    p += r
    if p >= P:
        p -= P
        n += 1
    return n, p


@cuda.jit(device=True)
def channel_range_sum(x, c, first, end, threads, P):
    """Σ x[·, c, ·] over the thread's values first, first + T, … below end of channel c of an [N, C, P] view
    (``channel_cursor``'s walk): batch-norm statistics, channel sums."""
    q, r, n, p = channel_cursor(first, threads, P)
    acc = float32(0.0)
    for _ in range(first, end, threads):
        acc += x[n, c, p]
        n, p = channel_step(n, p, q, r, P)
    return acc

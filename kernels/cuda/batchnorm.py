"""Batch normalization on the GPU: statistics by fixed-order tree reductions, no atomics.

A channel of at most ``Split.chunk`` values (N·H·W) is one block's work, in one kernel each way, as
before: block c sums channel c (mean), then the squared deviations (the two-pass variance, which does
not lose digits the way E[x²] − E[x]² does), updates the running statistics, and normalizes; backward
is two tree sums (Σ dout and Σ dout·x̂) and then dx. A larger channel is split over
``blocks_per_channel`` blocks (a grid of blocks × channels), because one block per channel left most
of a GPU idle: on an H200, ResNet-18's 20 training batch norms took 0.67 ms a step at CIFAR batch 32
(roofline 0.047 ms) and 0.89 ms at 224×224 batch 8, the backward 0.62 / 0.87 ms (roofline 0.070),
with 64 blocks of 256 threads, each looping over 32,768–100,352 values three times. Split, it takes
two launches each way:

- forward: ``batchnorm_partial_stats_kernel`` writes each block's (mean, M2) of its chunk (two passes
  over the chunk, the second from L1/L2); ``batchnorm_normalize_kernel`` combines the channel's
  partials in every block (Chan et al.'s pairwise update, in a fixed tree order, so every block gets the
  same bits), block 0 writes the saved and running statistics, and every block normalizes its chunk.
- backward: ``batchnorm_backward_partials_kernel`` writes each block's Σ dout and Σ dout·x̂;
  ``batchnorm_backward_apply_kernel`` sums the channel's partials (fixed order) and writes dx.

The partials live in the caller's scratch: forward's in ``save_mean`` past its first C values
(``batchnorm_forward_train_workspace_size``), backward's in ``scratch``
(``batchnorm_backward_from_output_workspace_size``): the layer declares them as its working memory,
as conv declares its split-K partials. Every sum is ``block_sum`` (kernels/cuda/reduce.py) or the same
tree over Chan's update, with block and chunk sizes fixed by the shape: the same bits on every run.
Why two launches and not one for the large channels: normalizing needs the whole channel's statistics,
a grid-wide dependency; one launch would need a cooperative launch (a grid barrier). The eager path
pays ~90 µs of host per launch (engine/bench/roofline.py), so only the channels larger than one chunk
take the second launch: ResNet-18 at CIFAR batch 32 has 10 such batch norms (64 and 128 channels at
32×32 and 16×16), +20 launches a step.

``batchnorm_backward_from_output`` rebuilds x̂ = (out − β) / γ from the output (In-Place ABN, see
kernels/cpu/batchnorm.py); every kernel uses γ with |γ| raised to ``GAMMA_MIN``, as the CPU's. The
input-based backward is only the NumPy reference's (kernels/reference/batchnorm.py), what this one
is tested against: no layer calls it, so neither backend keeps a copy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from numba import cuda, float32, int64

from kernels.cuda._launch import (
    MAX_REDUCTION_THREADS,
    THREADS_PER_BLOCK,
    blocks_for,
    check_scratch,
    f32,
    launch,
    reduction_threads,
)
from kernels.cuda.reduce import block_sum, channel_cursor, channel_range_sum, channel_step

GAMMA_MIN = 1e-5

MAX_PARTIALS = 256
"""Blocks per channel at most: past 256 × ``Split.chunk`` values a channel's chunks grow instead."""


@dataclass(frozen=True)
class Split:
    """How a large channel is cut: ``threads`` per block (a power of two, at most the reduction buffer)
    and ``per_thread`` values each, so a block's chunk is threads × per_thread values (more when a
    channel would need over ``MAX_PARTIALS`` blocks). 256 × 16: a 4,096-value chunk, so ResNet-18's
    channels at CIFAR batch 32 split 8 ways at 32×32 and 2 ways at 16×16 (512 and 256 blocks), the
    smaller ones stay one block each (256–512 blocks); at 224×224 batch 8 the stem's 64 channels split
    25 ways (1,600 blocks). Tests shrink it so the simulator runs the split path at tiny shapes."""

    threads: int = 256
    per_thread: int = 16

    @property
    def chunk(self) -> int:
        return self.threads * self.per_thread


_split = [Split()]


def use_split(split: Split) -> Split:
    """Set the split (tests use a tiny one); returns the previous. Workspace sizes follow it."""
    if split.threads & (split.threads - 1) or not 1 <= split.threads <= MAX_REDUCTION_THREADS:
        raise ValueError(f"batch norm split: threads must be a power of two up to {MAX_REDUCTION_THREADS}, "
                         f"got {split.threads}")
    previous = _split[0]
    _split[0] = split
    return previous


def blocks_per_channel(count: int) -> tuple[int, int]:
    """(blocks, chunk) for a channel of ``count`` values: one block when it fits one chunk."""
    chunk = max(_split[0].chunk, -(-int(count) // MAX_PARTIALS))
    return -(-int(count) // chunk), chunk

@cuda.jit(device=True)
def _floored_gamma(g):
    """γ with the floor every kernel here divides by (module docstring): |γ| >= GAMMA_MIN, its sign kept."""
    if abs(g) < float32(GAMMA_MIN):
        return float32(-GAMMA_MIN) if g < float32(0.0) else float32(GAMMA_MIN)
    return g


@cuda.jit(device=True)
def _save_statistics(save_mean, save_invstd, running_mean, running_var, c, mean, invstd, var, count, momentum):
    """Channel c's saved mean and 1/std, and the running statistics moved (the unbiased variance, as torch)."""
    save_mean[c] = mean
    save_invstd[c] = invstd
    unbiased = var * float32(count) / float32(count - 1)
    running_mean[c] = (float32(1.0) - momentum) * running_mean[c] + momentum * mean
    running_var[c] = (float32(1.0) - momentum) * running_var[c] + momentum * unbiased


@cuda.jit(device=True)
def _squares(x, c, mean, first, end, threads, P):
    """Σ (x − mean)² over the thread's values, as ``channel_range_sum``."""
    q, r, n, p = channel_cursor(first, threads, P)
    acc = float32(0.0)
    for _ in range(first, end, threads):
        d = x[n, c, p] - mean
        acc += d * d
        n, p = channel_step(n, p, q, r, P)
    return acc


@cuda.jit(device=True)
def _normalize(x, out, c, mean, scale, shift, first, end, threads, P):
    """out = (x − mean)·scale + shift over the thread's values, as ``channel_range_sum``."""
    q, r, n, p = channel_cursor(first, threads, P)
    for _ in range(first, end, threads):
        out[n, c, p] = (x[n, c, p] - mean) * scale + shift
        n, p = channel_step(n, p, q, r, P)


@cuda.jit(device=True)
def _gradient_sums(y, dout, c, bias, inv_g, first, end, threads, P):
    """(Σ dout, Σ dout·x̂) with x̂ = (y − β)/γ over the thread's values, as ``channel_range_sum``."""
    q, r, n, p = channel_cursor(first, threads, P)
    acc_dout = float32(0.0)
    acc_dout_xhat = float32(0.0)
    for _ in range(first, end, threads):
        d = dout[n, c, p]
        acc_dout += d
        acc_dout_xhat += d * ((y[n, c, p] - bias) * inv_g)
        n, p = channel_step(n, p, q, r, P)
    return acc_dout, acc_dout_xhat


@cuda.jit(device=True)
def _dx(y, dout, dx, c, bias, inv_g, scale, mean_dout, mean_dout_xhat, first, end, threads, P):
    """dx = scale·(dout − mean(dout) − x̂·mean(dout·x̂)) over the thread's values, as ``channel_range_sum``."""
    q, r, n, p = channel_cursor(first, threads, P)
    for _ in range(first, end, threads):
        xhat = (y[n, c, p] - bias) * inv_g
        dx[n, c, p] = scale * (dout[n, c, p] - mean_dout - xhat * mean_dout_xhat)
        n, p = channel_step(n, p, q, r, P)


@cuda.jit
def batchnorm_train_kernel(x, gamma, beta, running_mean, running_var, out, save_mean, save_invstd, momentum, eps):
    """Block c: batch mean and biased variance of channel c, running-stat update, normalized output.

    x and out are [N, C, H·W] views.
    """
    partial = cuda.shared.array(shape=MAX_REDUCTION_THREADS, dtype=float32)
    c = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    threads = cuda.blockDim.x
    P = x.shape[2]
    count = x.shape[0] * P
    mean = block_sum(partial, channel_range_sum(x, c, tid, count, threads, P)) / float32(count)
    var = block_sum(partial, _squares(x, c, mean, tid, count, threads, P)) / float32(count)
    invstd = float32(1.0) / math.sqrt(var + eps)

    if tid == 0:
        _save_statistics(save_mean, save_invstd, running_mean, running_var, c, mean, invstd, var, count, momentum)

    g = _floored_gamma(gamma[c])
    _normalize(x, out, c, mean, g * invstd, beta[c], tid, count, threads, P)


@cuda.jit
def batchnorm_infer_kernel(x, gamma, beta, running_mean, running_var, out, eps):
    """out = (x − running_mean) · gamma / sqrt(running_var + eps) + beta, one thread per element."""
    e = cuda.grid(1)
    C = x.shape[1]
    P = x.shape[2]
    if e < x.shape[0] * C * P:
        n = e // (C * P)
        rest = e - n * (C * P)
        c = rest // P
        p = rest - c * P
        g = _floored_gamma(gamma[c])
        scale = g / math.sqrt(running_var[c] + eps)
        out[n, c, p] = (x[n, c, p] - running_mean[c]) * scale + beta[c]


@cuda.jit
def batchnorm_backward_from_output_kernel(y, dout, gamma, beta, save_invstd, dx, dgamma, dbeta):
    """Block c: dbeta = Σ dout, dgamma = Σ dout·x̂ with x̂ = (out − β) / γ, then
    dx = γ·invstd·(dout − (dbeta + x̂·dgamma)/count)."""
    partial = cuda.shared.array(shape=MAX_REDUCTION_THREADS, dtype=float32)
    c = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    threads = cuda.blockDim.x
    P = y.shape[2]
    count = y.shape[0] * P
    g = _floored_gamma(gamma[c])
    inv_g = float32(1.0) / g
    b = beta[c]
    invstd = save_invstd[c]

    acc_dout, acc_dout_xhat = _gradient_sums(y, dout, c, b, inv_g, tid, count, threads, P)
    total_dout = block_sum(partial, acc_dout)
    total_dout_xhat = block_sum(partial, acc_dout_xhat)
    if tid == 0:
        dbeta[c] = total_dout
        dgamma[c] = total_dout_xhat
    _dx(y, dout, dx, c, b, inv_g, g * invstd, total_dout / float32(count), total_dout_xhat / float32(count), tid,
        count, threads, P)


@cuda.jit(device=True)
def _chan(na, ma, m2a, nb, mb, m2b):
    """(count, mean, M2) of two sets from each one's (Chan, Golub and LeVeque's pairwise update); an
    empty set (count 0) leaves the other as it is."""
    if nb == 0:
        return na, ma, m2a
    if na == 0:
        return nb, mb, m2b
    n = na + nb
    delta = mb - ma
    fb = float32(nb) / float32(n)
    return n, ma + delta * fb, m2a + m2b + delta * delta * (float32(na) * fb)


@cuda.jit(device=True)
def _channel_statistics(counts, means, m2s, part_mean, part_m2, c, chunk, count):
    """Mean and M2 of channel c from its blocks' partials: each thread folds partials tid, tid + T, …
    in order, then a halving tree over the block (as ``block_sum``). Every block gets the same bits."""
    tid = cuda.threadIdx.x
    threads = cuda.blockDim.x
    k = int64(0)
    mean = float32(0.0)
    m2 = float32(0.0)
    for b in range(tid, part_mean.shape[1], threads):
        k, mean, m2 = _chan(k, mean, m2, min(chunk, count - b * chunk), part_mean[c, b], part_m2[c, b])
    counts[tid] = k
    means[tid] = mean
    m2s[tid] = m2
    cuda.syncthreads()
    step = threads // 2
    while step > 0:
        if tid < step:
            k, mean, m2 = _chan(counts[tid], means[tid], m2s[tid], counts[tid + step], means[tid + step],
                                m2s[tid + step])
            counts[tid] = k
            means[tid] = mean
            m2s[tid] = m2
        cuda.syncthreads()
        step //= 2
    mean = means[0]
    m2 = m2s[0]
    cuda.syncthreads()
    return mean, m2


@cuda.jit
def batchnorm_partial_stats_kernel(x, part_mean, part_m2, chunk):
    """Block (b, c): mean and M2 (Σ squared deviations from that mean) of chunk b of channel c.

    x is an [N, C, H·W] view; chunk b is the channel's values b·chunk … (b + 1)·chunk − 1 in (n, h·w)
    order, thread t taking every T-th from t (coalesced). The position steps by T without a division
    per value: T = q·P + r, so (n, p) advances by (q, r) and carries once when p passes P.
    """
    partial = cuda.shared.array(shape=MAX_REDUCTION_THREADS, dtype=float32)
    b = cuda.blockIdx.x
    c = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    threads = cuda.blockDim.x
    P = x.shape[2]
    start = b * chunk
    end = min(start + chunk, x.shape[0] * P)
    mean = block_sum(partial, channel_range_sum(x, c, start + tid, end, threads, P)) / float32(end - start)
    m2 = block_sum(partial, _squares(x, c, mean, start + tid, end, threads, P))
    if tid == 0:
        part_mean[c, b] = mean
        part_m2[c, b] = m2


@cuda.jit
def batchnorm_normalize_kernel(x, gamma, beta, running_mean, running_var, out, save_mean, save_invstd, part_mean,
                               part_m2, chunk, momentum, eps):
    """Block (b, c): channel c's statistics from all its partials, then chunk b normalized; block 0 also
    saves the mean and 1/std and moves the running statistics (unbiased variance)."""
    counts = cuda.shared.array(shape=MAX_REDUCTION_THREADS, dtype=int64)
    means = cuda.shared.array(shape=MAX_REDUCTION_THREADS, dtype=float32)
    m2s = cuda.shared.array(shape=MAX_REDUCTION_THREADS, dtype=float32)
    b = cuda.blockIdx.x
    c = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    threads = cuda.blockDim.x
    P = x.shape[2]
    count = x.shape[0] * P
    mean, m2 = _channel_statistics(counts, means, m2s, part_mean, part_m2, c, chunk, count)
    var = m2 / float32(count)
    invstd = float32(1.0) / math.sqrt(var + eps)
    if b == 0 and tid == 0:
        _save_statistics(save_mean, save_invstd, running_mean, running_var, c, mean, invstd, var, count, momentum)

    g = _floored_gamma(gamma[c])
    start = b * chunk
    _normalize(x, out, c, mean, g * invstd, beta[c], start + tid, min(start + chunk, count), threads, P)


@cuda.jit
def batchnorm_backward_partials_kernel(y, dout, gamma, beta, part_dout, part_dout_xhat, chunk):
    """Block (b, c): Σ dout and Σ dout·x̂ over chunk b of channel c (x̂ = (out − β)/γ), the chunks and
    their order as in ``batchnorm_partial_stats_kernel``."""
    partial = cuda.shared.array(shape=MAX_REDUCTION_THREADS, dtype=float32)
    b = cuda.blockIdx.x
    c = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    threads = cuda.blockDim.x
    P = y.shape[2]
    g = _floored_gamma(gamma[c])
    inv_g = float32(1.0) / g
    bias = beta[c]
    start = b * chunk
    end = min(start + chunk, y.shape[0] * P)
    acc_dout, acc_dout_xhat = _gradient_sums(y, dout, c, bias, inv_g, start + tid, end, threads, P)
    total_dout = block_sum(partial, acc_dout)
    total_dout_xhat = block_sum(partial, acc_dout_xhat)
    if tid == 0:
        part_dout[c, b] = total_dout
        part_dout_xhat[c, b] = total_dout_xhat


@cuda.jit
def batchnorm_backward_apply_kernel(y, dout, gamma, beta, save_invstd, dx, dgamma, dbeta, part_dout, part_dout_xhat,
                                    chunk):
    """Block (b, c): channel c's Σ dout and Σ dout·x̂ from all its partials (each thread adds partials tid,
    tid + T, … in order, then ``block_sum``), block 0 writes dbeta and dgamma, every block its chunk of dx."""
    partial = cuda.shared.array(shape=MAX_REDUCTION_THREADS, dtype=float32)
    b = cuda.blockIdx.x
    c = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    threads = cuda.blockDim.x
    P = y.shape[2]
    count = y.shape[0] * P
    acc_dout = float32(0.0)
    acc_dout_xhat = float32(0.0)
    for k in range(tid, part_dout.shape[1], threads):
        acc_dout += part_dout[c, k]
        acc_dout_xhat += part_dout_xhat[c, k]
    total_dout = block_sum(partial, acc_dout)
    total_dout_xhat = block_sum(partial, acc_dout_xhat)
    if b == 0 and tid == 0:
        dbeta[c] = total_dout
        dgamma[c] = total_dout_xhat

    g = _floored_gamma(gamma[c])
    inv_g = float32(1.0) / g
    bias = beta[c]
    start = b * chunk
    _dx(y, dout, dx, c, bias, inv_g, g * save_invstd[c], total_dout / float32(count), total_dout_xhat / float32(count),
        start + tid, min(start + chunk, count), threads, P)


def _view3(x: Any) -> Any:
    if x.ndim != 4:
        raise ValueError(f"batch norm: expected a 4-D NCHW array, got shape {tuple(x.shape)}")
    N, C, H, W = x.shape
    return x.reshape(N, C, H * W)


def batchnorm_forward_train_workspace_size(x_shape: Any) -> int:
    """float32 elements of ``save_mean``: the C batch means, then (a channel split over several blocks)
    each block's mean and M2 of its chunk."""
    N, C, H, W = (int(d) for d in x_shape)
    blocks, _ = blocks_per_channel(N * H * W)
    return C + (2 * C * blocks if blocks > 1 else 0)


def batchnorm_backward_from_output_workspace_size(x_shape: Any) -> int:
    """float32 elements of backward's scratch: each block's Σ dout and Σ dout·x̂ (0 when a channel is one block)."""
    N, C, H, W = (int(d) for d in x_shape)
    blocks, _ = blocks_per_channel(N * H * W)
    return 2 * C * blocks if blocks > 1 else 0


def _check_save_mean(save_mean: Any, needed: int) -> None:
    if save_mean.ndim != 1 or save_mean.size < needed:
        raise ValueError(
            f"batchnorm_forward_train: save_mean has shape {tuple(save_mean.shape)} but this shape needs "
            f"{needed} float32 elements (the batch means, then the partial statistics); size it with "
            f"batchnorm_forward_train_workspace_size(x.shape)"
        )


def batchnorm_forward_train(
    x: Any,
    gamma: Any,
    beta: Any,
    running_mean: Any,
    running_var: Any,
    out: Any,
    save_mean: Any,
    save_invstd: Any,
    momentum: float,
    eps: float,
) -> None:
    x3 = _view3(x)
    N, C, P = x3.shape
    _check_save_mean(save_mean, batchnorm_forward_train_workspace_size(x.shape))
    blocks, chunk = blocks_per_channel(N * P)
    if blocks == 1:
        launch(batchnorm_train_kernel, C, reduction_threads(N * P), x3, gamma, beta, running_mean, running_var,
               _view3(out), save_mean[:C], save_invstd, f32(momentum), f32(eps))
        return
    part_mean = save_mean[C:C + C * blocks].reshape(C, blocks)
    part_m2 = save_mean[C + C * blocks:C + 2 * C * blocks].reshape(C, blocks)
    threads = _split[0].threads
    launch(batchnorm_partial_stats_kernel, (blocks, C), threads, x3, part_mean, part_m2, chunk)
    launch(batchnorm_normalize_kernel, (blocks, C), threads, x3, gamma, beta, running_mean, running_var, _view3(out),
           save_mean[:C], save_invstd, part_mean, part_m2, chunk, f32(momentum), f32(eps))


def batchnorm_forward_infer(
    x: Any, gamma: Any, beta: Any, running_mean: Any, running_var: Any, out: Any, eps: float
) -> None:
    launch(
        batchnorm_infer_kernel,
        blocks_for(x.size),
        THREADS_PER_BLOCK,
        _view3(x),
        gamma,
        beta,
        running_mean,
        running_var,
        _view3(out),
        f32(eps),
    )


def batchnorm_backward_from_output(
    out: Any, dout: Any, gamma: Any, beta: Any, save_invstd: Any, dx: Any, dgamma: Any, dbeta: Any, scratch: Any = None
) -> None:
    y3 = _view3(out)
    N, C, P = y3.shape
    blocks, chunk = blocks_per_channel(N * P)
    if blocks == 1:
        launch(batchnorm_backward_from_output_kernel, C, reduction_threads(N * P), y3, _view3(dout), gamma, beta,
               save_invstd, _view3(dx), dgamma, dbeta)
        return
    op = "batchnorm_backward_from_output"
    scratch = check_scratch(scratch, batchnorm_backward_from_output_workspace_size(out.shape), op)
    part_dout = scratch[:C * blocks].reshape(C, blocks)
    part_dout_xhat = scratch[C * blocks:].reshape(C, blocks)
    threads = _split[0].threads
    launch(batchnorm_backward_partials_kernel, (blocks, C), threads, y3, _view3(dout), gamma, beta, part_dout,
           part_dout_xhat, chunk)
    launch(batchnorm_backward_apply_kernel, (blocks, C), threads, y3, _view3(dout), gamma, beta, save_invstd,
           _view3(dx), dgamma, dbeta, part_dout, part_dout_xhat, chunk)

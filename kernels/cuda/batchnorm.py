"""Batch normalization on the GPU: one block per channel, statistics by fixed-order tree reductions.

Training runs in a single kernel: block c sums channel c (mean), then the squared deviations (the
two-pass variance, which does not lose digits the way E[x²] − E[x]² does), updates the running
statistics, and normalizes the channel. Backward is one kernel too: two tree sums (Σ dout and
Σ dout·x̂) and then dx. Every sum is ``block_sum`` (kernels/cuda/reduce.py), a shared-memory tree
with a block size fixed by the shape: no atomics, the same bits on every run.

``batchnorm_backward_from_output`` rebuilds x̂ = (out − β) / γ from the output (In-Place ABN, see
kernels/cpu/batchnorm.py); every kernel uses γ with |γ| raised to ``GAMMA_MIN``, as the CPU's. The
input-based backward is only the NumPy reference's (kernels/reference/batchnorm.py), what this one
is tested against: no layer calls it, so neither backend keeps a copy.
"""

from __future__ import annotations

import math
from typing import Any

from numba import cuda, float32

from kernels.cuda._launch import MAX_REDUCTION_THREADS, THREADS_PER_BLOCK, blocks_for, f32, launch, reduction_threads
from kernels.cuda.reduce import block_sum

GAMMA_MIN = 1e-5

# The floor is written out in each kernel: a device function makes compile_ptx start the driver.

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

    acc = float32(0.0)
    for e in range(tid, count, threads):
        n = e // P
        acc += x[n, c, e - n * P]
    mean = block_sum(partial, acc) / float32(count)

    acc = float32(0.0)
    for e in range(tid, count, threads):
        n = e // P
        d = x[n, c, e - n * P] - mean
        acc += d * d
    var = block_sum(partial, acc) / float32(count)
    invstd = float32(1.0) / math.sqrt(var + eps)

    if tid == 0:
        save_mean[c] = mean
        save_invstd[c] = invstd
        unbiased = var * float32(count) / float32(count - 1)
        running_mean[c] = (float32(1.0) - momentum) * running_mean[c] + momentum * mean
        running_var[c] = (float32(1.0) - momentum) * running_var[c] + momentum * unbiased

    g = gamma[c]
    if abs(g) < float32(GAMMA_MIN):  # the γ floor (module docstring)
        g = float32(-GAMMA_MIN) if g < float32(0.0) else float32(GAMMA_MIN)
    scale = g * invstd
    shift = beta[c]
    for e in range(tid, count, threads):
        n = e // P
        p = e - n * P
        out[n, c, p] = (x[n, c, p] - mean) * scale + shift


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
        g = gamma[c]
        if abs(g) < float32(GAMMA_MIN):  # the γ floor (module docstring)
            g = float32(-GAMMA_MIN) if g < float32(0.0) else float32(GAMMA_MIN)
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
    g = gamma[c]
    if abs(g) < float32(GAMMA_MIN):  # the γ floor (module docstring)
        g = float32(-GAMMA_MIN) if g < float32(0.0) else float32(GAMMA_MIN)
    inv_g = float32(1.0) / g
    b = beta[c]
    invstd = save_invstd[c]

    acc_dout = float32(0.0)
    acc_dout_xhat = float32(0.0)
    for e in range(tid, count, threads):
        n = e // P
        p = e - n * P
        d = dout[n, c, p]
        acc_dout += d
        acc_dout_xhat += d * ((y[n, c, p] - b) * inv_g)
    total_dout = block_sum(partial, acc_dout)
    total_dout_xhat = block_sum(partial, acc_dout_xhat)
    if tid == 0:
        dbeta[c] = total_dout
        dgamma[c] = total_dout_xhat

    scale = g * invstd
    mean_dout = total_dout / float32(count)
    mean_dout_xhat = total_dout_xhat / float32(count)
    for e in range(tid, count, threads):
        n = e // P
        p = e - n * P
        xhat = (y[n, c, p] - b) * inv_g
        dx[n, c, p] = scale * (dout[n, c, p] - mean_dout - xhat * mean_dout_xhat)


def _view3(x: Any) -> Any:
    if x.ndim != 4:
        raise ValueError(f"batch norm: expected a 4-D NCHW array, got shape {tuple(x.shape)}")
    N, C, H, W = x.shape
    return x.reshape(N, C, H * W)


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
    launch(
        batchnorm_train_kernel,
        C,
        reduction_threads(N * P),
        x3,
        gamma,
        beta,
        running_mean,
        running_var,
        _view3(out),
        save_mean,
        save_invstd,
        f32(momentum),
        f32(eps),
    )


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
    out: Any, dout: Any, gamma: Any, beta: Any, save_invstd: Any, dx: Any, dgamma: Any, dbeta: Any
) -> None:
    y3 = _view3(out)
    N, C, P = y3.shape
    launch(
        batchnorm_backward_from_output_kernel,
        C,
        reduction_threads(N * P),
        y3,
        _view3(dout),
        gamma,
        beta,
        save_invstd,
        _view3(dx),
        dgamma,
        dbeta,
    )

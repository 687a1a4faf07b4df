"""Batch normalization (2-D, per channel) in plain NumPy, with PyTorch's semantics.

Training normalizes with the batch mean and the *biased* batch variance, saves mean and 1/std for
backward, and moves the running statistics towards the batch ones by ``momentum``, using the
*unbiased* variance (n / (n - 1) times the biased one) for running_var. Inference uses the running
statistics only.

Every kernel uses γ with its magnitude raised to ``GAMMA_MIN`` (``safe_gamma``), so that
``batchnorm_backward_from_output`` can rebuild x̂ = (out − β) / γ from the output (In-Place ABN).
"""

from __future__ import annotations

import numpy as np

from kernels.reference import elementwise

GAMMA_MIN = 1e-5


def safe_gamma(gamma: np.ndarray) -> np.ndarray:
    """γ with |γ| raised to GAMMA_MIN, sign kept (0 becomes +GAMMA_MIN)."""
    gamma = np.asarray(gamma)
    return np.where(np.abs(gamma) >= GAMMA_MIN, gamma, np.where(gamma < 0, -GAMMA_MIN, GAMMA_MIN)).astype(gamma.dtype)


def batchnorm_forward_train(
    x: np.ndarray,
    gamma: np.ndarray,
    beta: np.ndarray,
    running_mean: np.ndarray,
    running_var: np.ndarray,
    out: np.ndarray,
    save_mean: np.ndarray,
    save_invstd: np.ndarray,
    momentum: float,
    eps: float,
) -> None:
    N, C, H, W = x.shape
    count = N * H * W
    x64 = x.astype(np.float64)
    mean = x64.mean(axis=(0, 2, 3))
    var = ((x64 - mean[None, :, None, None]) ** 2).mean(axis=(0, 2, 3))  # biased: normalizes
    invstd = 1.0 / np.sqrt(var + eps)
    xhat = (x64 - mean[None, :, None, None]) * invstd[None, :, None, None]
    out[...] = safe_gamma(gamma)[None, :, None, None] * xhat + beta[None, :, None, None]
    save_mean[:C] = mean  # a GPU's save_mean is longer: its partial statistics follow (workspace_size below)
    save_invstd[...] = invstd
    unbiased_var = var * count / (count - 1)
    running_mean[...] = (1 - momentum) * running_mean + momentum * mean
    running_var[...] = (1 - momentum) * running_var + momentum * unbiased_var


def batchnorm_forward_infer(
    x: np.ndarray,
    gamma: np.ndarray,
    beta: np.ndarray,
    running_mean: np.ndarray,
    running_var: np.ndarray,
    out: np.ndarray,
    eps: float,
) -> None:
    invstd = 1.0 / np.sqrt(running_var.astype(np.float64) + eps)
    scale = safe_gamma(gamma) * invstd
    shift = beta - running_mean * scale
    out[...] = x * scale[None, :, None, None] + shift[None, :, None, None]


def batchnorm_backward(
    x: np.ndarray,
    dout: np.ndarray,
    gamma: np.ndarray,
    save_mean: np.ndarray,
    save_invstd: np.ndarray,
    dx: np.ndarray,
    dgamma: np.ndarray,
    dbeta: np.ndarray,
) -> None:
    """Gradients of the training forward (batch statistics depend on x, so dx has three terms).

    With xhat = (x - mean) * invstd and M = N*H*W per channel:
        dbeta  = sum(dout)
        dgamma = sum(dout * xhat)
        dx     = gamma * invstd / M * (M * dout - dbeta - xhat * dgamma)
    """
    N, C, H, W = x.shape
    count = N * H * W
    mean = save_mean.astype(np.float64)[None, :, None, None]
    invstd = save_invstd.astype(np.float64)[None, :, None, None]
    dout64 = dout.astype(np.float64)
    xhat = (x - mean) * invstd
    sum_dout = dout64.sum(axis=(0, 2, 3))
    sum_dout_xhat = (dout64 * xhat).sum(axis=(0, 2, 3))
    dbeta[...] = sum_dout
    dgamma[...] = sum_dout_xhat
    g = safe_gamma(gamma).astype(np.float64)[None, :, None, None]
    dx[...] = (
        g
        * invstd
        / count
        * (count * dout64 - sum_dout[None, :, None, None] - xhat * sum_dout_xhat[None, :, None, None])
    )


def batchnorm_backward_from_output(
    out: np.ndarray,
    dout: np.ndarray,
    gamma: np.ndarray,
    beta: np.ndarray,
    save_invstd: np.ndarray,
    dx: np.ndarray,
    dgamma: np.ndarray,
    dbeta: np.ndarray,
    scratch: np.ndarray | None = None,
) -> None:
    """``batchnorm_backward`` with x̂ rebuilt from the output: x̂ = (out − β) / γ (In-Place ABN).
    ``scratch`` is the GPU's partial sums (``batchnorm_backward_from_output_workspace_size``); none here."""
    g = safe_gamma(gamma).astype(np.float64)[None, :, None, None]
    xhat = (out.astype(np.float64) - beta.astype(np.float64)[None, :, None, None]) / g
    count = out.shape[0] * out.shape[2] * out.shape[3]
    invstd = save_invstd.astype(np.float64)[None, :, None, None]
    dout64 = dout.astype(np.float64)
    sum_dout = dout64.sum(axis=(0, 2, 3))
    sum_dout_xhat = (dout64 * xhat).sum(axis=(0, 2, 3))
    dbeta[...] = sum_dout
    dgamma[...] = sum_dout_xhat
    dx[...] = g * invstd / count * (count * dout64 - sum_dout[None, :, None, None]
                                    - xhat * sum_dout_xhat[None, :, None, None])


def batchnorm_forward_train_workspace_size(x_shape: tuple[int, ...]) -> int:
    """float32 elements of ``save_mean``: the C batch means (the CUDA kernels keep partial statistics after them)."""
    return int(x_shape[1])


def batchnorm_backward_from_output_workspace_size(x_shape: tuple[int, ...]) -> int:
    """float32 elements of backward's scratch: none here (the CUDA kernels keep partial sums in it)."""
    return 0


# ---- batch norm over chunks of images (kernels/cpu/batchnorm.py says what the sums are) ------------


def batchnorm_chunk_statistics(x: np.ndarray, sums: np.ndarray, first: bool) -> None:
    if first:
        sums[:, 0] = x[0, :, 0, 0]
        sums[:, 1:] = 0.0
    d = x.astype(np.float64) - sums[None, :, 0, None, None]
    sums[:, 1] += d.sum(axis=(0, 2, 3))
    sums[:, 2] += (d * d).sum(axis=(0, 2, 3))


def batchnorm_chunk_finish(sums: np.ndarray, count: int, gamma: np.ndarray, beta: np.ndarray,
                           running_mean: np.ndarray, running_var: np.ndarray, scale_shift: np.ndarray,
                           save_invstd: np.ndarray, momentum: float, eps: float) -> None:
    shifted_mean = sums[:, 1] / count
    mean = sums[:, 0] + shifted_mean
    squares = np.maximum(sums[:, 2] - sums[:, 1] * shifted_mean, 0.0)
    invstd = 1.0 / np.sqrt(squares / count + eps)
    scale = safe_gamma(gamma).astype(np.float64) * invstd
    scale_shift[:, 0] = scale
    scale_shift[:, 1] = beta - mean * scale
    save_invstd[...] = invstd
    running_mean[...] = (1 - momentum) * running_mean + momentum * mean
    running_var[...] = (1 - momentum) * running_var + momentum * squares / (count - 1)


def batchnorm_chunk_apply(z: np.ndarray, scale_shift: np.ndarray, activation: str | None, y: np.ndarray | None,
                          out: np.ndarray) -> None:
    v = (z * scale_shift[None, :, 0, None, None] + scale_shift[None, :, 1, None, None]).astype(np.float32)
    if y is not None:
        y[...] = v
    if activation == "relu":
        v = np.maximum(v, np.float32(0))
    elif activation == "relu6":
        v = np.minimum(np.maximum(v, np.float32(0)), np.float32(6))
    out[...] = v


def _masked(y: np.ndarray, dy: np.ndarray, activation: str | None) -> np.ndarray:
    """dy through the activation's backward (the reference's own relu_backward / relu6_backward), from y."""
    if activation is None:
        return dy
    dx = np.empty_like(dy)
    {"relu": elementwise.relu_backward, "relu6": elementwise.relu6_backward}[activation](y, dy, dx)
    return dx


def batchnorm_chunk_gradient_sums(y: np.ndarray, dy: np.ndarray, gamma: np.ndarray, beta: np.ndarray,
                                  sums: np.ndarray, first: bool, activation: str | None = None) -> None:
    dy = _masked(y, dy, activation)
    if first:
        sums[...] = 0.0
    g = safe_gamma(gamma).astype(np.float64)[None, :, None, None]
    xhat = (y.astype(np.float64) - beta.astype(np.float64)[None, :, None, None]) / g
    d = dy.astype(np.float64)
    sums[:, 0] += d.sum(axis=(0, 2, 3))
    sums[:, 1] += (d * xhat).sum(axis=(0, 2, 3))


def batchnorm_chunk_dx(y: np.ndarray, dy: np.ndarray, gamma: np.ndarray, beta: np.ndarray, save_invstd: np.ndarray,
                       sums: np.ndarray, count: int, dx: np.ndarray, activation: str | None = None) -> None:
    dy = _masked(y, dy, activation)
    g = safe_gamma(gamma).astype(np.float64)[None, :, None, None]
    xhat = (y.astype(np.float64) - beta.astype(np.float64)[None, :, None, None]) / g
    k = g * save_invstd.astype(np.float64)[None, :, None, None]
    dx[...] = k * (dy - sums[None, :, 0, None, None] / count - xhat * sums[None, :, 1, None, None] / count)

"""Dense (fully connected) layer on the GPU: three GEMMs over transposed views, plus bias kernels.

``w`` is [O, I] as PyTorch stores it, so the forward multiplies by ``w.T``: a strided view, never a
copy. The bias gradient is a deterministic per-column sum of dout (one block per output).
"""

from __future__ import annotations

from typing import Any

from kernels.cuda.channels import add_bias, sum_channels
from kernels.cuda.gemm import gemm


def _check(name: str, array: Any, shape: tuple[int, ...]) -> None:
    if tuple(array.shape) != shape:
        raise ValueError(f"dense: {name} has shape {tuple(array.shape)}, expected {shape}")


def dense_forward(x: Any, w: Any, bias: Any, out: Any) -> None:
    """out[N,O] = x[N,I] @ w[O,I].T (+ bias[O])."""
    N, I = x.shape
    O = w.shape[0]
    _check("w", w, (O, I))
    _check("out", out, (N, O))
    gemm(x, w.T, out)
    if bias is not None:
        add_bias(out.reshape(N, O, 1), bias)


def dense_backward(x: Any, w: Any, dout: Any, dx: Any, dw: Any, dbias: Any) -> None:
    """dx = dout @ w (skipped when dx is None), dw = dout.T @ x, dbias = dout summed over the batch."""
    N, I = x.shape
    O = w.shape[0]
    _check("dout", dout, (N, O))
    _check("dw", dw, (O, I))
    if dx is not None:
        _check("dx", dx, (N, I))
        gemm(dout, w, dx)
    gemm(dout.T, x, dw)
    if dbias is not None:
        sum_channels(dout.reshape(N, O, 1), dbias)

"""Dense (fully connected) layer in plain NumPy: out = x @ w.T + bias, w in PyTorch's [out, in] layout."""

from __future__ import annotations

import numpy as np


def dense_forward(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None, out: np.ndarray) -> None:
    """out[N,O] = x[N,I] @ w[O,I].T (+ bias[O])."""
    out[...] = x @ w.T
    if bias is not None:
        out += bias


def dense_backward(
    x: np.ndarray,
    w: np.ndarray,
    dout: np.ndarray,
    dx: np.ndarray | None,
    dw: np.ndarray,
    dbias: np.ndarray | None,
) -> None:
    """Gradients of dense_forward: dx = dout @ w, dw = dout.T @ x, dbias = dout summed over the batch."""
    if dx is not None:
        dx[...] = dout @ w
    dw[...] = dout.T @ x
    if dbias is not None:
        dbias[...] = dout.sum(axis=0)

"""Element-wise ops in plain NumPy: relu, relu6, leaky relu, the residual add and dropout.

The activations' backward takes the forward *output*, not the input: the layer can then drop its
input after the forward (and ``relu_forward`` can run in place), since out > 0 exactly where x > 0.
"""

from __future__ import annotations

import numpy as np


def relu_forward(x: np.ndarray, out: np.ndarray) -> None:
    np.maximum(x, 0, out=out)


def relu_backward(out: np.ndarray, dout: np.ndarray, dx: np.ndarray) -> None:
    """dx = dout where the output was positive, else 0."""
    dx[...] = np.where(out > 0, dout, 0)


def relu6_forward(x: np.ndarray, out: np.ndarray) -> None:
    np.clip(x, 0, 6, out=out)


def relu6_backward(out: np.ndarray, dout: np.ndarray, dx: np.ndarray) -> None:
    """dx = dout where 0 < out < 6 (the linear part), else 0: PyTorch's hardtanh rule."""
    dx[...] = np.where((out > 0) & (out < 6), dout, 0)


def leaky_relu_forward(x: np.ndarray, out: np.ndarray, negative_slope: float) -> None:
    """out = x where x > 0, else negative_slope · x (``negative_slope`` >= 0)."""
    out[...] = np.where(x > 0, x, np.float32(negative_slope) * x)


def leaky_relu_backward(out: np.ndarray, dout: np.ndarray, dx: np.ndarray, negative_slope: float) -> None:
    """dx = dout where out > 0, else negative_slope · dout: with a slope >= 0, out > 0 exactly where
    x > 0, so the output serves as the mask (at x = 0 PyTorch also takes the slope)."""
    dx[...] = np.where(out > 0, dout, np.float32(negative_slope) * dout)


def add_forward(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """The residual add; its backward is the identity on both inputs, so it needs no kernel."""
    np.add(a, b, out=out)


def dropout_forward(x: np.ndarray, mask: np.ndarray, scale: float, out: np.ndarray) -> None:
    """out = x * mask * scale: mask is 0/1 (uint8), scale = 1 / (1 - p) keeps the expected value."""
    out[...] = x * mask * scale


def dropout_backward(dout: np.ndarray, mask: np.ndarray, scale: float, dx: np.ndarray) -> None:
    dx[...] = dout * mask * scale

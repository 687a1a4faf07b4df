"""Pooling in plain NumPy: max pool (with the argmax for backward), average pool, global average pool.

Windows are square (``kernel`` x ``kernel``) with one ``stride`` and ``pad``; the output size is
floor((H + 2 pad - kernel) / stride) + 1, as PyTorch with ceil_mode=False. Loops are over output
positions so the code reads like the definition; the CPU kernels are the fast versions.
"""

from __future__ import annotations

import numpy as np


def pool_output_size(size: int, kernel: int, stride: int, pad: int) -> int:
    return (size + 2 * pad - kernel) // stride + 1


def maxpool2d_forward(x: np.ndarray, out: np.ndarray, argmax: np.ndarray, kernel: int, stride: int, pad: int) -> None:
    """out = max over each window (padding never wins); argmax = h * W + w of the first maximum (int32), or
    its place r * kernel + s in the window (uint8). A window holding NaN gives its last NaN, as PyTorch's CPU
    kernel (``val > maxval || isnan(val)``: each NaN takes over)."""
    N, C, H, W = x.shape
    OH, OW = out.shape[2], out.shape[3]
    for oh in range(OH):
        for ow in range(OW):
            h0, w0 = oh * stride - pad, ow * stride - pad
            h_lo, h_hi = max(h0, 0), min(h0 + kernel, H)
            w_lo, w_hi = max(w0, 0), min(w0 + kernel, W)
            window = x[:, :, h_lo:h_hi, w_lo:w_hi].reshape(N, C, -1)
            nan = np.isnan(window)
            last_nan = window.shape[2] - 1 - nan[:, :, ::-1].argmax(axis=2)
            winner = np.where(nan.any(axis=2), last_nan, window.argmax(axis=2))  # else the first maximum, row-major
            wh = w_hi - w_lo
            out[:, :, oh, ow] = np.take_along_axis(window, winner[:, :, None], axis=2)[:, :, 0]
            h, w = h_lo + winner // wh, w_lo + winner % wh
            argmax[:, :, oh, ow] = (h - h0) * kernel + (w - w0) if argmax.dtype == np.uint8 else h * W + w


def maxpool2d_backward(dout: np.ndarray, argmax: np.ndarray, dx: np.ndarray, kernel: int = 0, stride: int = 0,
                       pad: int = 0) -> None:
    """Each output's gradient goes to the input element that won its window (summed where windows overlap).

    A uint8 argmax holds the place in the window: decoded with ``kernel``, ``stride`` and ``pad``."""
    N, C, H, W = dx.shape
    dx[...] = 0
    if argmax.dtype == np.uint8:
        OH, OW = dout.shape[2], dout.shape[3]
        oh = np.arange(OH)[:, None]
        ow = np.arange(OW)[None, :]
        place = argmax.astype(np.int64)
        argmax = (oh * stride - pad + place // kernel) * W + (ow * stride - pad + place % kernel)
    flat_dx = dx.reshape(N * C, H * W)
    flat_dout = dout.reshape(N * C, -1)
    flat_argmax = argmax.reshape(N * C, -1)
    for plane in range(N * C):
        np.add.at(flat_dx[plane], flat_argmax[plane], flat_dout[plane])


def avgpool2d_forward(x: np.ndarray, out: np.ndarray, kernel: int, stride: int, pad: int) -> None:
    """out = sum over each window / kernel**2: padding counts as zeros (count_include_pad=True)."""
    OH, OW = out.shape[2], out.shape[3]
    padded = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    for oh in range(OH):
        for ow in range(OW):
            h0, w0 = oh * stride, ow * stride
            out[:, :, oh, ow] = padded[:, :, h0 : h0 + kernel, w0 : w0 + kernel].sum(axis=(2, 3)) / (kernel * kernel)


def avgpool2d_backward(dout: np.ndarray, dx: np.ndarray, kernel: int, stride: int, pad: int) -> None:
    """Each output's gradient is spread evenly over its window; the share falling on padding is dropped."""
    N, C, H, W = dx.shape
    OH, OW = dout.shape[2], dout.shape[3]
    padded = np.zeros((N, C, H + 2 * pad, W + 2 * pad), dtype=dx.dtype)
    for oh in range(OH):
        for ow in range(OW):
            h0, w0 = oh * stride, ow * stride
            padded[:, :, h0 : h0 + kernel, w0 : w0 + kernel] += dout[:, :, oh, ow, None, None] / (kernel * kernel)
    dx[...] = padded[:, :, pad : pad + H, pad : pad + W]


def global_avgpool_forward(x: np.ndarray, out: np.ndarray) -> None:
    """out[N,C] = the mean of each H x W plane."""
    out[...] = x.mean(axis=(2, 3))


def global_avgpool_backward(dout: np.ndarray, dx: np.ndarray) -> None:
    H, W = dx.shape[2], dx.shape[3]
    dx[...] = dout[:, :, None, None] / (H * W)

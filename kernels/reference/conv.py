"""Convolution in plain NumPy: the ground truth every faster conv2d is checked against.

A 2-D convolution (really a cross-correlation, as in every deep-learning framework) slides a
``R×S`` window over the zero-padded input. Writing it as one multiply-add per window offset
``(r, s)`` keeps the reference short and obviously right: for each offset, the input pixels it
touches form a strided view of the padded input, and the whole offset contributes
``w[:, :, r, s] @ view`` to the output. The backward passes are the same loop read backwards.

Groups split the channels into ``groups`` independent convolutions: input channels
``[g*C/g, (g+1)*C/g)`` feed only output channels ``[g*K/g, (g+1)*K/g)``. Depthwise convolution is
``groups == C == K``. Sums run in float64 so the reference is more accurate than what it checks.
These functions allocate freely; they are for reading and testing, not for speed.
"""

from __future__ import annotations

import numpy as np


def conv2d_output_size(size: int, kernel: int, stride: int, pad: int) -> int:
    """Output height (or width) of a convolution; PyTorch's formula with dilation 1."""
    return (size + 2 * pad - kernel) // stride + 1


def check_conv2d_shapes(x_shape, w_shape, stride: int, pad: int, groups: int) -> tuple[int, int]:
    """Raise a ValueError naming the problem when the shapes cannot be convolved; return (OH, OW)."""
    if len(x_shape) != 4 or len(w_shape) != 4:
        raise ValueError(f"conv2d wants x as N×C×H×W and w as K×C/groups×R×S; got x {x_shape}, w {w_shape}")
    n, c, h, wd = x_shape
    k, cg, r, s = w_shape
    if stride < 1 or pad < 0 or groups < 1:
        raise ValueError(f"conv2d wants stride >= 1, pad >= 0, groups >= 1; got {stride}, {pad}, {groups}")
    if c % groups or k % groups:
        raise ValueError(f"conv2d: channels in ({c}) and out ({k}) must both divide by groups ({groups})")
    if cg != c // groups:
        raise ValueError(f"conv2d: w has {cg} input channels per group, x has {c} channels / {groups} groups")
    if r != s:
        raise ValueError(f"conv2d supports square kernels only; got {r}×{s}")
    oh = conv2d_output_size(h, r, stride, pad)
    ow = conv2d_output_size(wd, s, stride, pad)
    if oh < 1 or ow < 1:
        raise ValueError(f"conv2d: a {r}×{s} kernel with pad {pad} does not fit a {h}×{wd} input")
    return oh, ow


def _window(xp: np.ndarray, r: int, s: int, stride: int, oh: int, ow: int) -> np.ndarray:
    """The padded-input pixels that kernel offset (r, s) multiplies, one per output pixel."""
    return xp[:, :, r : r + stride * (oh - 1) + 1 : stride, s : s + stride * (ow - 1) + 1 : stride]


def conv2d_forward(x, w, bias, out, stride: int, pad: int, groups: int, scratch=None) -> None:
    """out[n, k] = bias[k] + Σ_{c in k's group, r, s} w[k, c, r, s] · x_padded[n, c, oh·stride + r, ow·stride + s]."""
    oh, ow = check_conv2d_shapes(x.shape, w.shape, stride, pad, groups)
    k_total, cg, kr, ks = w.shape
    kg = k_total // groups
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    w64 = w.astype(np.float64)
    result = np.zeros((x.shape[0], k_total, oh, ow))
    for g in range(groups):
        xg = xp[:, g * cg : (g + 1) * cg]
        wg = w64[g * kg : (g + 1) * kg]
        for r in range(kr):
            for s in range(ks):
                view = _window(xg, r, s, stride, oh, ow)
                result[:, g * kg : (g + 1) * kg] += np.einsum("nchw,kc->nkhw", view, wg[:, :, r, s], optimize=True)
    if bias is not None:
        result += bias.astype(np.float64)[None, :, None, None]
    out[...] = result


def conv2d_backward_data(dout, w, dx, stride: int, pad: int, groups: int, scratch=None) -> None:
    """dx = the forward's transpose: every output gradient flows back to the pixels its window read."""
    n, c, h, wd = dx.shape
    oh, ow = check_conv2d_shapes(dx.shape, w.shape, stride, pad, groups)
    k_total, cg, kr, ks = w.shape
    kg = k_total // groups
    d64 = dout.astype(np.float64)
    w64 = w.astype(np.float64)
    dxp = np.zeros((n, c, h + 2 * pad, wd + 2 * pad))
    for g in range(groups):
        dg = d64[:, g * kg : (g + 1) * kg]
        wg = w64[g * kg : (g + 1) * kg]
        for r in range(kr):
            for s in range(ks):
                view = _window(dxp[:, g * cg : (g + 1) * cg], r, s, stride, oh, ow)
                view += np.einsum("nkhw,kc->nchw", dg, wg[:, :, r, s], optimize=True)
    dx[...] = dxp[:, :, pad : pad + h, pad : pad + wd]


def conv2d_backward_weight(x, dout, dw, dbias, stride: int, pad: int, groups: int, scratch=None) -> None:
    """dw[k, c, r, s] = Σ_{n, oh, ow} dout[n, k, oh, ow] · (the input pixel w[k, c, r, s] multiplied)."""
    oh, ow = check_conv2d_shapes(x.shape, dw.shape, stride, pad, groups)
    k_total, cg, kr, ks = dw.shape
    kg = k_total // groups
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    d64 = dout.astype(np.float64)
    result = np.zeros(dw.shape)
    for g in range(groups):
        xg = xp[:, g * cg : (g + 1) * cg]
        dg = d64[:, g * kg : (g + 1) * kg]
        for r in range(kr):
            for s in range(ks):
                view = _window(xg, r, s, stride, oh, ow)
                result[g * kg : (g + 1) * kg, :, r, s] = np.einsum("nkhw,nchw->kc", dg, view, optimize=True)
    dw[...] = result
    if dbias is not None:
        dbias[...] = d64.sum(axis=(0, 2, 3))


def conv2d_forward_workspace_size(x_shape, w_shape, stride: int, pad: int, groups: int) -> int:
    """The reference allocates its own temporaries: it needs no scratch."""
    return 0


def conv2d_backward_data_workspace_size(x_shape, w_shape, stride: int, pad: int, groups: int) -> int:
    return 0


def conv2d_backward_weight_workspace_size(x_shape, w_shape, stride: int, pad: int, groups: int) -> int:
    return 0



def _columns32(x: np.ndarray, kr: int, ks: int, stride: int, pad: int, oh: int, ow: int) -> np.ndarray:
    """im2col in float32, groups 1: cols[n, (c·R + r)·S + s, oh·OW + ow]."""
    xp = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    taps = [_window(xp, r, s, stride, oh, ow) for r in range(kr) for s in range(ks)]  # each n, c, oh, ow
    cols = np.stack(taps, axis=2)  # n, c, R·S, oh, ow
    return np.ascontiguousarray(cols.reshape(x.shape[0], -1, oh * ow), dtype=np.float32)


def gemm32(direction: str, x_shape, w_shape, stride: int, pad: int, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """One direction of a groups-1 conv as a float32 im2col GEMM (NumPy's sgemm), float32 throughout: the rounding
    of a float32 GEMM, which ``kernels.cpu.conv.CONV_MODES``' float32-GEMM-level paths are held to.

    ``(a, b)`` = (x, w) forward → out; (dout, w) "data" → dx (col2im adds in float32); (x, dout) "weight" → dw
    (one GEMM over the whole batch's columns)."""
    n, c, h, wd = x_shape
    k, _, kr, ks = w_shape
    oh, ow = check_conv2d_shapes(tuple(x_shape), tuple(w_shape), stride, pad, 1)
    if direction == "forward":
        return np.matmul(b.reshape(k, -1), _columns32(a, kr, ks, stride, pad, oh, ow)).reshape(n, k, oh, ow)
    if direction == "weight":
        cols = _columns32(a, kr, ks, stride, pad, oh, ow).transpose(1, 0, 2).reshape(c * kr * ks, n * oh * ow)
        dout = np.ascontiguousarray(b.transpose(1, 0, 2, 3)).reshape(k, n * oh * ow)
        return (dout @ cols.T).reshape(w_shape)
    dcols = np.matmul(b.reshape(k, -1).T, a.reshape(n, k, oh * ow)).reshape(n, c, kr, ks, oh, ow)
    dxp = np.zeros((n, c, h + 2 * pad, wd + 2 * pad), np.float32)
    for r in range(kr):
        for s in range(ks):
            _window(dxp, r, s, stride, oh, ow)[...] += dcols[:, :, r, s]
    return dxp[:, :, pad : pad + h, pad : pad + wd]

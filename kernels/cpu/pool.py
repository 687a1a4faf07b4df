"""Pooling CPU kernels: max pool (recording the winner for backward), average pool, global average.

Every kernel runs ``prange`` over the N*C planes: a plane's outputs (forward) or its input gradient
(backward) belong to one thread, so backward can add overlapping windows' shares without races and
the result does not depend on the thread count. Windows are clipped to the input instead of padding
it, so no padded copy is ever made.

The argmax is int32 (h * W + w in the input plane) or uint8 (the winner's place in its window,
r * kernel + s, for windows of at most 16 values, e.g. 3x3): a quarter of the bytes kept for backward,
and backward, given the window geometry, finds the same input element. Same bits either way.
"""

from __future__ import annotations

import numpy as np
from numba import get_num_threads, njit, prange

from kernels.cpu.checks import check_array
from kernels.cpu.threads import run_ranges


@njit(cache=True, inline="always")
def _take(v, k, best, at):
    """The window scan's step without a branch: v wins if larger, or if NaN (later NaNs win, as in the loop)."""
    wins = (v > best) | (v != v)
    return (v if wins else best), (k if wins else at)


@njit(cache=True, parallel=True, nogil=True)
def _maxpool_forward(x, out, argmax, kernel, stride, pad, local):
    """Why a 3×3 window inside the plane is unrolled: the general loop's data-dependent branch (which value wins)
    mispredicts on random data, and with the bounds and the loop around it the ResNet-18 stem's pool (32×64×112×112
    → 56×56, 3×3 s2 p1) took 113.6 ms of a 224 training step's forward (a per-layer profile of the step, two
    threads, 2026-11-27); the interior windows as nine selects instead: 57.0–60.8 ms in the same profile
    (``python benchmarks/step_profile.py --model resnet18 --image-size 224``, quiet). The same winner: the
    first maximum in row-major order, a NaN over any number, a later NaN over an earlier one (PyTorch's rule)."""
    N, C, H, W = x.shape
    OH, OW = out.shape[2], out.shape[3]
    for plane in prange(N * C):
        n, c = plane // C, plane % C
        for oh in range(OH):
            h_lo = max(oh * stride - pad, 0)
            h_hi = min(oh * stride - pad + kernel, H)
            for ow in range(OW):
                w_lo = max(ow * stride - pad, 0)
                w_hi = min(ow * stride - pad + kernel, W)
                if kernel == 3 and h_hi - h_lo == 3 and w_hi - w_lo == 3:  # a whole 3×3 window
                    r0, r1, r2 = x[n, c, h_lo], x[n, c, h_lo + 1], x[n, c, h_lo + 2]
                    best, at = r0[w_lo], 0  # the first value wins against the loop's -inf start, NaN or not
                    best, at = _take(r0[w_lo + 1], 1, best, at)
                    best, at = _take(r0[w_lo + 2], 2, best, at)
                    best, at = _take(r1[w_lo], 3, best, at)
                    best, at = _take(r1[w_lo + 1], 4, best, at)
                    best, at = _take(r1[w_lo + 2], 5, best, at)
                    best, at = _take(r2[w_lo], 6, best, at)
                    best, at = _take(r2[w_lo + 1], 7, best, at)
                    best, at = _take(r2[w_lo + 2], 8, best, at)
                    out[n, c, oh, ow] = best
                    if local:  # the window lies inside the plane: its place is the place in the window
                        argmax[n, c, oh, ow] = at
                    else:
                        argmax[n, c, oh, ow] = (h_lo + at // 3) * W + w_lo + at % 3
                    continue
                best = -np.inf
                best_h, best_w = h_lo, w_lo
                for h in range(h_lo, h_hi):
                    for w in range(w_lo, w_hi):
                        v = x[n, c, h, w]
                        if v > best or np.isnan(v):  # the first maximum wins; a NaN wins, as in PyTorch
                            best = v
                            best_h, best_w = h, w
                out[n, c, oh, ow] = best
                if local:  # uint8: the place in the window (which may start in the padding)
                    argmax[n, c, oh, ow] = (best_h - (oh * stride - pad)) * kernel + best_w - (ow * stride - pad)
                else:
                    argmax[n, c, oh, ow] = best_h * W + best_w


@njit(cache=True, parallel=True, nogil=True)
def _maxpool_backward(dout, argmax, dx):
    """dout, argmax: [planes, OH*OW]; dx: [planes, H*W]."""
    for plane in prange(dx.shape[0]):
        dx[plane, :] = 0
        for i in range(dout.shape[1]):
            dx[plane, argmax[plane, i]] += dout[plane, i]


@njit(cache=True, parallel=True, nogil=True)
def _maxpool_backward_local(dout, argmax, dx, OW, W, kernel, stride, pad):
    """As _maxpool_backward, the winner decoded from its place in the window (uint8 argmax)."""
    for plane in prange(dx.shape[0]):
        dx[plane, :] = 0
        for i in range(dout.shape[1]):
            oh, ow = i // OW, i % OW
            place = np.int64(argmax[plane, i])
            h = oh * stride - pad + place // kernel
            w = ow * stride - pad + place % kernel
            dx[plane, h * W + w] += dout[plane, i]


@njit(cache=True, parallel=True, nogil=True)
def _avgpool_forward(x, out, kernel, stride, pad):
    N, C, H, W = x.shape
    OH, OW = out.shape[2], out.shape[3]
    inv_area = np.float32(1.0 / (kernel * kernel))  # padding counts in the divisor (count_include_pad)
    for plane in prange(N * C):
        n, c = plane // C, plane % C
        for oh in range(OH):
            h_lo = max(oh * stride - pad, 0)
            h_hi = min(oh * stride - pad + kernel, H)
            for ow in range(OW):
                w_lo = max(ow * stride - pad, 0)
                w_hi = min(ow * stride - pad + kernel, W)
                total = np.float32(0.0)
                for h in range(h_lo, h_hi):
                    for w in range(w_lo, w_hi):
                        total += x[n, c, h, w]
                out[n, c, oh, ow] = total * inv_area


@njit(cache=True, parallel=True, nogil=True)
def _avgpool_backward(dout, dx, kernel, stride, pad):
    N, C, H, W = dx.shape
    OH, OW = dout.shape[2], dout.shape[3]
    inv_area = np.float32(1.0 / (kernel * kernel))
    for plane in prange(N * C):
        n, c = plane // C, plane % C
        dx[n, c, :, :] = 0
        for oh in range(OH):
            h_lo = max(oh * stride - pad, 0)
            h_hi = min(oh * stride - pad + kernel, H)
            for ow in range(OW):
                w_lo = max(ow * stride - pad, 0)
                w_hi = min(ow * stride - pad + kernel, W)
                share = dout[n, c, oh, ow] * inv_area
                for h in range(h_lo, h_hi):
                    for w in range(w_lo, w_hi):
                        dx[n, c, h, w] += share


@njit(cache=True, nogil=True)
def _global_avgpool_forward(x, out, lo, hi):
    """x: [planes, H*W]; out: [planes]; planes [lo, hi). Each plane's sum runs in float64, in order.

    The global pools are serial kernels over a range of planes (``threads.run_ranges``), not
    ``prange`` loops, for the first run: as ``parallel=True`` kernels they compiled in 0.32 and 0.47 s
    of every CNN's warm-up (engine/warmup.py). The same bits: a plane is one thread's, in order."""
    area = x.shape[1]
    for plane in range(lo, hi):
        total = 0.0
        for i in range(area):
            total += x[plane, i]
        out[plane] = total / area


@njit(cache=True, nogil=True)
def _global_avgpool_backward(dout, dx, lo, hi):
    area = dx.shape[1]
    for plane in range(lo, hi):
        share = dout[plane] / np.float32(area)
        for i in range(area):
            dx[plane, i] = share


def pool_output_size(size: int, kernel: int, stride: int, pad: int) -> int:
    return (size + 2 * pad - kernel) // stride + 1


def _check_window(op: str, x: np.ndarray, out_shape: tuple[int, ...], kernel: int, stride: int, pad: int):
    if x.ndim != 4:
        raise ValueError(f"{op}: input must be NCHW (4-D), got shape {x.shape}")
    if kernel < 1 or stride < 1 or pad < 0:
        raise ValueError(f"{op}: need kernel >= 1, stride >= 1, pad >= 0; got {kernel}, {stride}, {pad}")
    if 2 * pad > kernel:
        raise ValueError(f"{op}: pad {pad} must be at most half the kernel {kernel} (as in PyTorch)")
    N, C, H, W = x.shape
    expected = (N, C, pool_output_size(H, kernel, stride, pad), pool_output_size(W, kernel, stride, pad))
    if min(expected[2:]) < 1:
        raise ValueError(f"{op}: a {kernel}x{kernel} window does not fit in a {H}x{W} input with pad {pad}")
    if tuple(out_shape) != expected:
        raise ValueError(f"{op}: output has shape {tuple(out_shape)}, expected {expected}")


def argmax_is_local(argmax: np.ndarray, kernel: int, op: str) -> bool:
    """True for a uint8 argmax (place in the window), False for int32 (place in the plane)."""
    if np.dtype(argmax.dtype) == np.uint8:
        if not 1 <= kernel <= 16 or kernel * kernel > 256:
            raise ValueError(f"{op}: a uint8 argmax holds windows of at most 256 values (16x16), got kernel {kernel}")
        return True
    if np.dtype(argmax.dtype) != np.int32:
        raise ValueError(f"{op}: argmax must be int32 or uint8, got {argmax.dtype}")
    return False


def maxpool2d_forward(x: np.ndarray, out: np.ndarray, argmax: np.ndarray, kernel: int, stride: int, pad: int) -> None:
    """out = each window's maximum; argmax = its flat h * W + w in the input plane (int32) or r * kernel + s
    in its window (uint8)."""
    op = "maxpool2d_forward"
    check_array(op, "x", x)
    _check_window(op, x, out.shape, kernel, stride, pad)
    check_array(op, "out", out)
    local = argmax_is_local(argmax, kernel, op)
    check_array(op, "argmax", argmax, out.shape, argmax.dtype)
    _maxpool_forward(x, out, argmax, int(kernel), int(stride), int(pad), local)


def maxpool2d_backward(dout: np.ndarray, argmax: np.ndarray, dx: np.ndarray, kernel: int = 0, stride: int = 0,
                       pad: int = 0) -> None:
    """dx = 0, then each output's gradient added at its argmax (a uint8 argmax needs the window geometry)."""
    op = "maxpool2d_backward"
    check_array(op, "dout", dout)
    if np.dtype(argmax.dtype) == np.uint8 and (kernel < 1 or stride < 1 or pad < 0):
        raise ValueError(f"{op}: a uint8 argmax needs kernel, stride and pad, got {kernel}, {stride}, {pad}")
    local = argmax_is_local(argmax, kernel, op) if np.dtype(argmax.dtype) == np.uint8 else False
    check_array(op, "argmax", argmax, dout.shape, np.uint8 if local else np.int32)
    check_array(op, "dx", dx)
    if dx.ndim != 4 or dout.ndim != 4 or dx.shape[:2] != dout.shape[:2]:
        raise ValueError(f"{op}: dx {dx.shape} and dout {dout.shape} must be NCHW with the same N and C")
    planes = dx.shape[0] * dx.shape[1]
    if local:
        _maxpool_backward_local(dout.reshape(planes, -1), argmax.reshape(planes, -1), dx.reshape(planes, -1),
                                dout.shape[3], dx.shape[3], int(kernel), int(stride), int(pad))
    else:
        _maxpool_backward(dout.reshape(planes, -1), argmax.reshape(planes, -1), dx.reshape(planes, -1))


def avgpool2d_forward(x: np.ndarray, out: np.ndarray, kernel: int, stride: int, pad: int) -> None:
    """out = window sum / kernel**2 (zero padding counts, PyTorch's count_include_pad=True)."""
    op = "avgpool2d_forward"
    check_array(op, "x", x)
    _check_window(op, x, out.shape, kernel, stride, pad)
    check_array(op, "out", out)
    _avgpool_forward(x, out, int(kernel), int(stride), int(pad))


def avgpool2d_backward(dout: np.ndarray, dx: np.ndarray, kernel: int, stride: int, pad: int) -> None:
    """dx = each output's gradient / kernel**2 spread over its window (dx zeroed first)."""
    op = "avgpool2d_backward"
    check_array(op, "dx", dx)
    _check_window(op, dx, dout.shape, kernel, stride, pad)
    check_array(op, "dout", dout)
    _avgpool_backward(dout, dx, int(kernel), int(stride), int(pad))


def global_avgpool_forward(x: np.ndarray, out: np.ndarray) -> None:
    """out[N,C] = mean of each H x W plane."""
    op = "global_avgpool_forward"
    check_array(op, "x", x)
    if x.ndim != 4:
        raise ValueError(f"{op}: x must be NCHW (4-D), got shape {x.shape}")
    N, C, H, W = x.shape
    check_array(op, "out", out, (N, C))
    x2, out1 = x.reshape(N * C, H * W), out.reshape(N * C)
    run_ranges(lambda lo, hi: _global_avgpool_forward(x2, out1, lo, hi), N * C, get_num_threads(), H * W)


def global_avgpool_backward(dout: np.ndarray, dx: np.ndarray) -> None:
    """dx[N,C,H,W] = dout[N,C] / (H * W) everywhere in the plane."""
    op = "global_avgpool_backward"
    check_array(op, "dx", dx)
    if dx.ndim != 4:
        raise ValueError(f"{op}: dx must be NCHW (4-D), got shape {dx.shape}")
    N, C, H, W = dx.shape
    check_array(op, "dout", dout, (N, C))
    dout1, dx2 = dout.reshape(N * C), dx.reshape(N * C, H * W)
    run_ranges(lambda lo, hi: _global_avgpool_backward(dout1, dx2, lo, hi), N * C, get_num_threads(), H * W)

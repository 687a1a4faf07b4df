"""Pooling CPU kernels: max pool (recording the winner for backward), average pool, global average.

Every kernel runs over the N*C planes (max pool and the global pools as serial kernels over ranges of planes on
``threads.run_ranges``, the average pools as ``prange`` loops): a plane's outputs (forward) or its input gradient
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
def _pair(a, i, b, j):
    """The winner of two window values, b the later one in row-major order: b if larger, or if NaN. Applied as a
    tree it gives the sequential scan's winner (the first maximum; the last NaN over any number): combining two
    runs' winners the same way is that rule again."""
    wins = (b > a) | (b != b)
    return (b if wins else a), (j if wins else i)


@njit(cache=True, inline="always")
def _row_winners(row, stride, values, places, first):
    """For each window k of ``values``: the winner of ``row``'s three columns from ``k * stride`` on, and its place
    (``first`` + 0, 1 or 2). The caller hands views that start at the first window: indices from 0 up are what
    lets the compiler vectorize the loop (from a run-time start it must allow for NumPy's negative indices:
    6.7 against 2.2 ms for a chunk of the stem's pool)."""
    for k in range(values.shape[0]):
        b = k * stride
        v, at = _pair(row[b], np.uint8(0), row[b + 1], np.uint8(1))
        v, at = _pair(v, at, row[b + 2], np.uint8(2))
        values[k] = v
        places[k] = at + first


@njit(cache=True, inline="always")
def _column_winners(values, places, out, argmax):
    """The winners of three rows' winners (``values``, ``places``: 3 × windows), top row first, into ``out`` and
    ``argmax`` (views from the first window, as in ``_row_winners``)."""
    for k in range(out.shape[0]):
        v, at = _pair(values[0, k], places[0, k], values[1, k], places[1, k])
        v, at = _pair(v, at, values[2, k], places[2, k])
        out[k] = v
        argmax[k] = at


@njit(cache=True, inline="always")
def _plane_place(place, h0, w0, kernel, W):
    """The flat h * W + w in the plane of a window's ``place`` (r * kernel + s from the window's (h0, w0))."""
    return (h0 + place // kernel) * W + w0 + place % kernel


@njit(cache=True, nogil=True)
def _window_scan(xp, W, H, h0, w0, kernel):
    """The general window (clipped to the plane): its winner and place (r * kernel + s, from the window's
    (h0, w0), which may lie in the padding)."""
    best = -np.inf
    h_lo, h_hi = max(h0, 0), min(h0 + kernel, H)
    w_lo, w_hi = max(w0, 0), min(w0 + kernel, W)
    best_h, best_w = h_lo, w_lo
    for h in range(h_lo, h_hi):
        for w in range(w_lo, w_hi):
            v = xp[h * W + w]
            if v > best or np.isnan(v):  # the first maximum wins; a NaN wins, as in PyTorch
                best = v
                best_h, best_w = h, w
    return best, (best_h - h0) * kernel + best_w - w0


@njit(cache=True, nogil=True)
def _maxpool_forward(x, out, argmax, kernel, stride, pad, local, lo, hi):
    """Planes [lo, hi) of x: [planes, H, W]; out, argmax: [planes, OH, OW]. The argmax is the window place
    (``local``, uint8) or the flat h * W + w in the input plane (int32). A serial kernel over a range of planes,
    run on the threads by ``threads.run_ranges`` (a plane is one thread's: the same bits at any thread count), not
    a ``prange`` loop: as ``parallel=True`` this kernel compiled in 4.0 s of the 224 first run, 1.4 s now
    (backward 0.7 → 0.35 s).

    Why a 3×3 window inside the plane has loops of its own: first each of its three rows' winner across its
    three columns (``_pair`` twice, for every window of the output row: a loop the compiler vectorizes), then the
    three rows' winners, top first. The same winner as the scan: the first maximum in row-major order is the
    first row's first maximum among the rows' maxima, a NaN over any number and a later NaN over an earlier one
    (PyTorch's rule) hold row by row and then across the rows (``_pair``'s docstring). How it got here, ResNet-18's
    stem pool (32×64×112×112 → 56×56, 3×3 s2 p1): the scan with its data-dependent branch (which value wins)
    took 113.6 ms of a 224 training step's forward; nine selects in a chain 57.0–60.8 ms in the same per-layer
    profile (``python benchmarks/step_profile.py --model resnet18 --image-size 224``, two threads, 2026-11-27).
    One 8-image chunk of it, best of 7, two threads, 2026-11-28: the chain 19.0–20.8 ms; a tree of pairs per
    window (depth 4) 10.8 ms; rows then columns 9.8 ms with run-time loop starts, 3.2 ms with views from the first
    window (``_row_winners``). In the step's profile (four chunks): 62–70 → 13.3 ms a step."""
    planes, H, W = x.shape
    OW = out.shape[2]
    OH = out.shape[1]
    # the columns whose window lies inside the plane: ow * stride - pad >= 0 and ow * stride - pad + kernel <= W
    ow_lo = min((pad + stride - 1) // stride, OW)
    ow_hi = max(ow_lo, min(OW, (W - kernel + pad) // stride + 1))
    for plane in range(lo, hi):
        xp = x[plane].reshape(H * W)
        op = out[plane].reshape(OH * OW)
        ap = argmax[plane].reshape(OH * OW)
        rows = np.empty((3, OW), np.float32)  # a row's winners across, per output column, for the three rows
        places = np.empty((3, OW), np.uint8)
        for oh in range(OH):
            h0 = oh * stride - pad
            inner_lo, inner_hi = OW, OW  # no inner run: every window of the row by the general scan
            if kernel == 3 and h0 >= 0 and h0 + 3 <= H and ow_lo < ow_hi:
                inner_lo, inner_hi = ow_lo, ow_hi
                for r in range(3):  # each row's three columns first: the compiler's vectors
                    start = (h0 + r) * W + ow_lo * stride - pad
                    row, values, at = xp[start:], rows[r, ow_lo:ow_hi], places[r, ow_lo:ow_hi]
                    if stride == 2:  # ResNet's stem: a constant stride (run-time: 8.6 against 4.9 ms a stem chunk)
                        _row_winners(row, 2, values, at, np.uint8(3 * r))
                    else:
                        _row_winners(row, stride, values, at, np.uint8(3 * r))
                _column_winners(rows[:, ow_lo:ow_hi], places[:, ow_lo:ow_hi], op[oh * OW + ow_lo:oh * OW + ow_hi],
                                ap[oh * OW + ow_lo:oh * OW + ow_hi])  # then the three rows, top first
                if not local:  # the place in the plane, from the place in the window
                    for ow in range(ow_lo, ow_hi):
                        ap[oh * OW + ow] = _plane_place(np.int64(ap[oh * OW + ow]), h0, ow * stride - pad, 3, W)
            for part in range(2):  # the windows left of the inner run, then right of it
                start, stop = (0, inner_lo) if part == 0 else (inner_hi, OW)
                for ow in range(start, stop):
                    w0 = ow * stride - pad
                    best, place = _window_scan(xp, W, H, h0, w0, kernel)
                    op[oh * OW + ow] = best
                    if local:
                        ap[oh * OW + ow] = place
                    else:
                        ap[oh * OW + ow] = _plane_place(place, h0, w0, kernel, W)


@njit(cache=True, nogil=True)
def _maxpool_backward(dout, argmax, dx, lo, hi):
    """Planes [lo, hi) of dout, argmax: [planes, OH*OW]; dx: [planes, H*W] (serial, as ``_maxpool_forward``)."""
    for plane in range(lo, hi):
        dx[plane, :] = 0
        for i in range(dout.shape[1]):
            dx[plane, argmax[plane, i]] += dout[plane, i]


@njit(cache=True, nogil=True)
def _maxpool_backward_local(dout, argmax, dx, OW, W, kernel, stride, pad, lo, hi):
    """As _maxpool_backward, the winner decoded from its place in the window (uint8 argmax): a place's offset
    from its window's first element comes from a table, the window's from the row and column loops. Decoding
    with four integer divisions per output (i // OW, i % OW, place // kernel, place % kernel) took 4.5 ms for
    an 8-image chunk of ResNet-18's 224 stem; the table 1.5 ms (best of 7, two threads, 2026-11-28). The same
    additions in the same order."""
    offsets = np.empty(kernel * kernel, np.int64)
    for place in range(kernel * kernel):
        offsets[place] = (place // kernel) * W + place % kernel
    OH = dout.shape[1] // OW
    for plane in range(lo, hi):
        dxp = dx[plane]
        dp = dout[plane]
        ap = argmax[plane]
        dxp[:] = 0
        for oh in range(OH):
            row = (oh * stride - pad) * W - pad
            for ow in range(OW):
                i = oh * OW + ow
                dxp[row + ow * stride + offsets[ap[i]]] += dp[i]


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
    N, C, H, W = x.shape
    OH, OW = out.shape[2], out.shape[3]
    x3, out3, argmax3 = x.reshape(N * C, H, W), out.reshape(N * C, OH, OW), argmax.reshape(N * C, OH, OW)
    kernel, stride, pad = int(kernel), int(stride), int(pad)
    run_ranges(lambda lo, hi: _maxpool_forward(x3, out3, argmax3, kernel, stride, pad, local, lo, hi), N * C,
               get_num_threads(), H * W)


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
    d2, a2, dx2 = dout.reshape(planes, -1), argmax.reshape(planes, -1), dx.reshape(planes, -1)
    if local:
        OW, W, kernel, stride, pad = dout.shape[3], dx.shape[3], int(kernel), int(stride), int(pad)
        run_ranges(lambda lo, hi: _maxpool_backward_local(d2, a2, dx2, OW, W, kernel, stride, pad, lo, hi), planes,
                   get_num_threads(), dx2.shape[1])
    else:
        run_ranges(lambda lo, hi: _maxpool_backward(d2, a2, dx2, lo, hi), planes, get_num_threads(), dx2.shape[1])


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

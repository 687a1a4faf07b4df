"""Pooling on the GPU: max (with argmax), average (count_include_pad) and global average.

Forward kernels run one thread per output. Backward kernels must not race where windows overlap, so
both gather: one thread per dx element sums the outputs whose windows cover it (average pool), or
those whose winner it is (max pool), in ascending output order. No atomics: gradients are the same
bits on every run. A uint8 argmax holds the winner's place in its window
(r * kernel + s; kernels/cpu/pool.py says why), decoded by ``maxpool_backward_kernel`` (``local``).
"""

from __future__ import annotations

import math
from typing import Any

from numba import cuda, float32, int64

from kernels.cuda._launch import THREADS_PER_BLOCK, blocks_for, launch, pair_shape


@cuda.jit
def maxpool_forward_kernel(x, out, argmax, kernel, stride, pad, local):
    """out = the first maximum of each window in row-major order; argmax = its h·W + w."""
    e = cuda.grid(1)
    N, C, OH, OW = out.shape
    H = x.shape[2]
    W = x.shape[3]
    if e < N * C * OH * OW:
        plane = e // (OH * OW)
        p = e - plane * (OH * OW)
        n = plane // C
        c = plane - n * C
        oh = p // OW
        ow = p - oh * OW
        best = float32(-math.inf)
        best_index = -1
        for r in range(kernel):
            h = oh * stride - pad + r
            if 0 <= h < H:
                for s in range(kernel):
                    w = ow * stride - pad + s
                    if 0 <= w < W:
                        v = x[n, c, h, w]
                        if best_index < 0 or v > best:
                            best = v
                            best_index = r * kernel + s if local else h * W + w
        out[n, c, oh, ow] = best
        argmax[n, c, oh, ow] = best_index


@cuda.jit(device=True)
def _covering_windows(e, dx, dout, kernel, stride, pad):
    """Element e of dx as (n, c, h, w), and the output windows covering it: rows oh_lo..oh_hi, columns
    ow_lo..ow_hi (window oh covers h when oh·stride − pad <= h < oh·stride − pad + kernel). What every
    pooling backward gathers over."""
    C, H, W = dx.shape[1], dx.shape[2], dx.shape[3]
    plane = e // (H * W)
    hw = e - plane * (H * W)
    n = plane // C
    c = plane - n * C
    h = hw // W
    w = hw - h * W
    oh_lo = max(0, (h + pad - kernel + stride) // stride)
    oh_hi = min(dout.shape[2] - 1, (h + pad) // stride)
    ow_lo = max(0, (w + pad - kernel + stride) // stride)
    ow_hi = min(dout.shape[3] - 1, (w + pad) // stride)
    return n, c, h, w, oh_lo, oh_hi, ow_lo, ow_hi


@cuda.jit
def maxpool_backward_kernel(dout, argmax, dx, kernel, stride, pad, local):
    """dx[h, w] = Σ dout over the windows covering (h, w) whose winner is this pixel: argmax = h·W + w (int32),
    or with ``local`` its place r·kernel + s in the window (uint8), which for window (oh, ow) is
    (h − oh·stride + pad)·kernel + (w − ow·stride + pad).

    A gather, one thread per dx element: it visits the at most ceil(kernel/stride)² windows that can
    hold the pixel in ascending output order and adds from 0, which is the order (and so the bits) of
    the scatter it replaced (dx zeroed, then ``dx[argmax[o]] += dout[o]`` for o ascending: one thread
    per (n, c) plane, 5.44 ms for ResNet-18's 224×224 stem pool at batch 8 on an H200, 512 threads in
    all; the roofline is 0.010 ms). No atomics: the same bits on every run.
    """
    e = cuda.grid(1)
    N, C, H, W = dx.shape
    if e < N * C * H * W:
        n, c, h, w, oh_lo, oh_hi, ow_lo, ow_hi = _covering_windows(e, dx, dout, kernel, stride, pad)
        acc = float32(0.0)
        for oh in range(oh_lo, oh_hi + 1):
            row = (h - oh * stride + pad) * kernel + w + pad
            for ow in range(ow_lo, ow_hi + 1):
                # int64 compare: uint8 arithmetic would wrap (and overflows under the simulator)
                if int64(argmax[n, c, oh, ow]) == (row - ow * stride if local else h * W + w):
                    acc += dout[n, c, oh, ow]
        dx[n, c, h, w] = acc


@cuda.jit
def avgpool_forward_kernel(x, out, kernel, stride, pad):
    """out = window sum / kernel²: padding counts as zeros (count_include_pad=True)."""
    e = cuda.grid(1)
    N, C, OH, OW = out.shape
    H = x.shape[2]
    W = x.shape[3]
    if e < N * C * OH * OW:
        plane = e // (OH * OW)
        p = e - plane * (OH * OW)
        n = plane // C
        c = plane - n * C
        oh = p // OW
        ow = p - oh * OW
        acc = float32(0.0)
        for r in range(kernel):
            h = oh * stride - pad + r
            if 0 <= h < H:
                for s in range(kernel):
                    w = ow * stride - pad + s
                    if 0 <= w < W:
                        acc += x[n, c, h, w]
        out[n, c, oh, ow] = acc / float32(kernel * kernel)


@cuda.jit
def avgpool_backward_kernel(dout, dx, kernel, stride, pad):
    """dx[h, w] = Σ over the windows covering (h, w) of dout / kernel²: a gather, one thread per dx element."""
    e = cuda.grid(1)
    N, C, H, W = dx.shape
    if e < N * C * H * W:
        n, c, h, w, oh_lo, oh_hi, ow_lo, ow_hi = _covering_windows(e, dx, dout, kernel, stride, pad)
        acc = float32(0.0)
        for oh in range(oh_lo, oh_hi + 1):
            for ow in range(ow_lo, ow_hi + 1):
                acc += dout[n, c, oh, ow]
        dx[n, c, h, w] = acc / float32(kernel * kernel)


@cuda.jit
def global_avgpool_forward_kernel(x, out):
    """out[plane] = mean of x[plane, :], one thread per (n, c) plane, summed in order."""
    plane = cuda.grid(1)
    if plane < x.shape[0]:
        acc = float32(0.0)
        for i in range(x.shape[1]):
            acc += x[plane, i]
        out[plane] = acc / float32(x.shape[1])


@cuda.jit
def global_avgpool_backward_kernel(dout, dx):
    e = cuda.grid(1)
    P = dx.shape[1]
    if e < dx.shape[0] * P:
        plane = e // P
        dx[plane, e - plane * P] = dout[plane] / float32(P)


def _pool_args(x: Any, out: Any, kernel: Any, stride: Any, pad: Any) -> tuple[int, int, int]:
    kernel = pair_shape(kernel, "kernel")
    stride = pair_shape(stride, "stride")
    pad = pair_shape(pad, "pad")
    N, C, H, W = x.shape
    expected = (N, C, (H + 2 * pad - kernel) // stride + 1, (W + 2 * pad - kernel) // stride + 1)
    if tuple(out.shape) != expected:
        raise ValueError(
            f"pool: output shape {tuple(out.shape)} does not match input {tuple(x.shape)} with "
            f"kernel {kernel}, stride {stride}, pad {pad}: expected {expected}"
        )
    return kernel, stride, pad


def maxpool2d_forward(x: Any, out: Any, argmax: Any, kernel: Any, stride: Any, pad: Any) -> None:
    kernel, stride, pad = _pool_args(x, out, kernel, stride, pad)
    local = str(argmax.dtype) == "uint8"
    if local and kernel * kernel > 256:
        raise ValueError(f"maxpool2d_forward: a uint8 argmax holds windows of at most 256 values, got kernel {kernel}")
    launch(maxpool_forward_kernel, blocks_for(out.size), THREADS_PER_BLOCK, x, out, argmax, kernel, stride, pad,
           local)


def maxpool2d_backward(dout: Any, argmax: Any, dx: Any, kernel: int = 0, stride: int = 0, pad: int = 0) -> None:
    """Both argmax encodings need the geometry here (the table's defaults of 0 serve the CPU, whose
    int32 backward scatters): the gather visits the windows that cover each dx element."""
    if kernel < 1 or stride < 1 or pad < 0:
        raise ValueError(f"maxpool2d_backward: the CUDA backward needs the pool's kernel, stride and pad, got "
                         f"{kernel}, {stride}, {pad}")
    kernel, stride, pad = _pool_args(dx, dout, kernel, stride, pad)
    launch(maxpool_backward_kernel, blocks_for(dx.size), THREADS_PER_BLOCK, dout, argmax, dx, kernel, stride, pad,
           str(argmax.dtype) == "uint8")


def avgpool2d_forward(x: Any, out: Any, kernel: Any, stride: Any, pad: Any) -> None:
    kernel, stride, pad = _pool_args(x, out, kernel, stride, pad)
    launch(avgpool_forward_kernel, blocks_for(out.size), THREADS_PER_BLOCK, x, out, kernel, stride, pad)


def avgpool2d_backward(dout: Any, dx: Any, kernel: Any, stride: Any, pad: Any) -> None:
    kernel, stride, pad = _pool_args(dx, dout, kernel, stride, pad)
    launch(avgpool_backward_kernel, blocks_for(dx.size), THREADS_PER_BLOCK, dout, dx, kernel, stride, pad)


def global_avgpool_forward(x: Any, out: Any) -> None:
    N, C, H, W = x.shape
    launch(global_avgpool_forward_kernel, blocks_for(N * C), THREADS_PER_BLOCK, x.reshape(N * C, H * W), out.reshape(-1))


def global_avgpool_backward(dout: Any, dx: Any) -> None:
    N, C, H, W = dx.shape
    launch(
        global_avgpool_backward_kernel, blocks_for(dx.size), THREADS_PER_BLOCK, dout.reshape(-1), dx.reshape(N * C, H * W)
    )

"""Pooling on the GPU: max (with argmax), average (count_include_pad) and global average.

Forward kernels run one thread per output. Backward kernels must not race where windows overlap:
average-pool backward gathers (one thread per dx element sums the outputs whose windows cover it),
and max-pool backward scatters one (n, c) plane per thread in output order. Neither uses atomics,
so gradients are the same bits on every run. A uint8 argmax holds the winner's place in its window
(r * kernel + s; kernels/cpu/pool.py says why), decoded by ``maxpool_backward_local_kernel``.
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


@cuda.jit
def maxpool_backward_kernel(dout, argmax, dx):
    """One thread per (n, c) plane: zero dx's plane, then add each output's gradient to its winner.

    Views: dout and argmax are [planes, OH·OW], dx is [planes, H·W].
    """
    plane = cuda.grid(1)
    if plane < dx.shape[0]:
        for i in range(dx.shape[1]):
            dx[plane, i] = float32(0.0)
        for o in range(dout.shape[1]):
            dx[plane, argmax[plane, o]] += dout[plane, o]


@cuda.jit
def maxpool_backward_local_kernel(dout, argmax, dx, OW, W, kernel, stride, pad):
    """As maxpool_backward_kernel, the winner decoded from its place in the window (uint8 argmax)."""
    plane = cuda.grid(1)
    if plane < dx.shape[0]:
        for i in range(dx.shape[1]):
            dx[plane, i] = float32(0.0)
        for o in range(dout.shape[1]):
            oh = o // OW
            ow = o - oh * OW
            place = int64(argmax[plane, o])  # uint8 arithmetic would wrap (and overflows under the simulator)
            r = place // kernel
            h = oh * stride - pad + r
            w = ow * stride - pad + (place - r * kernel)
            dx[plane, h * W + w] += dout[plane, o]


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
    OH = dout.shape[2]
    OW = dout.shape[3]
    if e < N * C * H * W:
        plane = e // (H * W)
        hw = e - plane * (H * W)
        n = plane // C
        c = plane - n * C
        h = hw // W
        w = hw - h * W
        # Windows oh cover h when oh·stride − pad <= h < oh·stride − pad + kernel.
        oh_lo = max(0, (h + pad - kernel + stride) // stride)
        oh_hi = min(OH - 1, (h + pad) // stride)
        ow_lo = max(0, (w + pad - kernel + stride) // stride)
        ow_hi = min(OW - 1, (w + pad) // stride)
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
    N, C, H, W = dx.shape
    planes = N * C
    if str(argmax.dtype) == "uint8":
        if kernel < 1 or stride < 1 or pad < 0:
            raise ValueError(f"maxpool2d_backward: a uint8 argmax needs kernel, stride and pad, got {kernel}, "
                             f"{stride}, {pad}")
        launch(maxpool_backward_local_kernel, blocks_for(planes), THREADS_PER_BLOCK, dout.reshape(planes, -1),
               argmax.reshape(planes, -1), dx.reshape(planes, H * W), dout.shape[3], W, int(kernel), int(stride),
               int(pad))
        return
    launch(
        maxpool_backward_kernel,
        blocks_for(planes),
        THREADS_PER_BLOCK,
        dout.reshape(planes, -1),
        argmax.reshape(planes, -1),
        dx.reshape(planes, H * W),
    )


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

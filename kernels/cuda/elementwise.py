"""Element-wise ops on the GPU: one thread per element over flat (1-D) views of any shape.

Memory-bound: each kernel reads its inputs and writes its output once, which is all the work there
is. ``out`` may be ``x`` (in place): every thread reads its element before writing it.
"""

from __future__ import annotations

from typing import Any

from numba import cuda, float32

from kernels.cuda._launch import THREADS_PER_BLOCK, blocks_for, f32, launch


@cuda.jit
def relu_forward_kernel(x, out):
    i = cuda.grid(1)
    if i < x.size:
        v = x[i]
        out[i] = v if v > float32(0.0) else float32(0.0)


@cuda.jit
def relu_backward_kernel(out, dout, dx):
    i = cuda.grid(1)
    if i < out.size:
        dx[i] = dout[i] if out[i] > float32(0.0) else float32(0.0)


@cuda.jit
def relu6_forward_kernel(x, out):
    i = cuda.grid(1)
    if i < x.size:
        v = x[i]
        if v < float32(0.0):
            v = float32(0.0)
        elif v > float32(6.0):
            v = float32(6.0)
        out[i] = v


@cuda.jit
def relu6_backward_kernel(out, dout, dx):
    i = cuda.grid(1)
    if i < out.size:
        v = out[i]
        dx[i] = dout[i] if float32(0.0) < v < float32(6.0) else float32(0.0)


@cuda.jit
def leaky_relu_forward_kernel(x, slope, out):
    i = cuda.grid(1)
    if i < x.size:
        v = x[i]
        out[i] = v if v > float32(0.0) else slope * v


@cuda.jit
def leaky_relu_backward_kernel(out, dout, slope, dx):
    i = cuda.grid(1)
    if i < out.size:
        dx[i] = dout[i] if out[i] > float32(0.0) else slope * dout[i]


@cuda.jit
def add_kernel(a, b, out):
    i = cuda.grid(1)
    if i < a.size:
        out[i] = a[i] + b[i]


@cuda.jit
def dropout_kernel(x, mask, scale, out):
    """out = x · mask · scale (used for forward and backward: the mask is the same linear map)."""
    i = cuda.grid(1)
    if i < x.size:
        out[i] = x[i] * float32(mask[i]) * scale


@cuda.jit
def copy_kernel(x, out):
    """out[i] = x[i]."""
    i = cuda.grid(1)
    if i < x.size:
        out[i] = x[i]


def copy(x: Any, out: Any) -> None:
    """out = x as a kernel launch: inside a step captured as a CUDA graph a copy must be a launch (the
    simulator's stand-in graph replays launches only; engine/cuda_graph.py copies the loss out)."""
    _run(copy_kernel, *_flat(x, out))


def _flat(*arrays: Any) -> list[Any]:
    shape = arrays[0].shape
    for a in arrays[1:]:
        if a.shape != shape:
            raise ValueError(f"element-wise op: shapes {[tuple(b.shape) for b in arrays]} must all be equal")
    return [a.reshape(-1) for a in arrays]


def _run(kernel: Any, *args: Any) -> None:
    launch(kernel, blocks_for(args[0].size), THREADS_PER_BLOCK, *args)


def relu_forward(x: Any, out: Any) -> None:
    _run(relu_forward_kernel, *_flat(x, out))


def relu_backward(out: Any, dout: Any, dx: Any) -> None:
    _run(relu_backward_kernel, *_flat(out, dout, dx))


def relu6_forward(x: Any, out: Any) -> None:
    _run(relu6_forward_kernel, *_flat(x, out))


def relu6_backward(out: Any, dout: Any, dx: Any) -> None:
    _run(relu6_backward_kernel, *_flat(out, dout, dx))


def _slope(op: str, negative_slope: float) -> Any:
    if not negative_slope >= 0:  # the output is the backward's mask only for a slope >= 0
        raise ValueError(f"{op}: negative_slope must be >= 0, got {negative_slope}")
    return f32(negative_slope)


def leaky_relu_forward(x: Any, out: Any, negative_slope: float) -> None:
    x1, out1 = _flat(x, out)
    _run(leaky_relu_forward_kernel, x1, _slope("leaky_relu_forward", negative_slope), out1)


def leaky_relu_backward(out: Any, dout: Any, dx: Any, negative_slope: float) -> None:
    out1, dout1, dx1 = _flat(out, dout, dx)
    _run(leaky_relu_backward_kernel, out1, dout1, _slope("leaky_relu_backward", negative_slope), dx1)


def add_forward(a: Any, b: Any, out: Any) -> None:
    _run(add_kernel, *_flat(a, b, out))


def dropout_forward(x: Any, mask: Any, scale: float, out: Any) -> None:
    x1, mask1, out1 = _flat(x, mask, out)
    _run(dropout_kernel, x1, mask1, f32(scale), out1)


def dropout_backward(dout: Any, mask: Any, scale: float, dx: Any) -> None:
    dout1, mask1, dx1 = _flat(dout, mask, dx)
    _run(dropout_kernel, dout1, mask1, f32(scale), dx1)

"""Element-wise CPU kernels: relu, relu6, leaky relu, residual add and dropout.

Each kernel sees its arrays flattened to 1-D (a free view of a C-contiguous array), so one compiled
version serves every shape, and ``prange`` splits the flat index range across threads. Every output
element depends on one input element only, so the result is the same for any thread count.

Why these keep ``prange`` (batch norm, the optimizers, the global pools and the dense bias moved to
serial kernels over ``threads.run_ranges`` for the first run's compile time). Tried: the same for
these, serial ``@njit`` over ``[lo, hi)`` with unsigned indices, split by ``run_ranges``: the same bits
(201 outputs at 1, 2, 3 threads), 4.2 → 1.0 s of compile CPU in ResNet-18's warm-up, but MobileNetV2's
training step went 0.30 → 0.42–0.46 s. The layers call them in place (``relu6_backward(out, dout,
dout)``), and a serial kernel's vectorized loop is guarded by a runtime overlap check of its arrays,
which in place fails: the scalar loop ran, 5 ns per element (2.0 ms for 393,216 elements against
0.1 ms). A parfor's gufunc is compiled with ``noalias`` on its array arguments (Numba's parfor
lowering), so it has no such check."""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from kernels.cpu.checks import check_array


@njit(cache=True, parallel=True, nogil=True)
def _relu_forward(x, out):
    for i in prange(x.size):
        v = x[i]
        out[i] = np.float32(0.0) if v < 0 else v  # NaN passes through, as in PyTorch


@njit(cache=True, parallel=True, nogil=True)
def _relu_backward(out, dout, dx):
    for i in prange(out.size):
        dx[i] = dout[i] if out[i] > 0 else np.float32(0.0)


@njit(cache=True, parallel=True, nogil=True)
def _relu6_forward(x, out):
    for i in prange(x.size):
        v = x[i]
        out[i] = np.float32(0.0) if v < 0 else (np.float32(6.0) if v > 6 else v)


@njit(cache=True, parallel=True, nogil=True)
def _relu6_backward(out, dout, dx):
    for i in prange(out.size):
        v = out[i]
        dx[i] = dout[i] if (v > 0 and v < 6) else np.float32(0.0)


@njit(cache=True, parallel=True, nogil=True)
def _clamp_forward_sums(x, words, cap, out):
    """out = min(max(x, 0), cap) as ReLU (cap = +inf: never taken, the same bits as ``_relu_forward``)
    and ReLU6 (cap = 6) compute it, and (Σ wᵢ, Σ (i+1)·wᵢ) mod 2⁶⁴ over x's 32-bit words wᵢ in the
    same pass: one kernel for both (variants by parameter, one compile)."""
    s1 = np.uint64(0)
    s2 = np.uint64(0)
    for i in prange(x.size):
        v = x[i]
        w = np.uint64(words[i])
        out[i] = np.float32(0.0) if v < 0 else (cap if v > cap else v)
        s1 += w
        s2 += w * np.uint64(i + 1)
    return s1, s2


@njit(cache=True, parallel=True, nogil=True)
def _leaky_relu_forward(x, slope, out):
    for i in prange(x.size):
        v = x[i]
        out[i] = v if v > 0 else slope * v


@njit(cache=True, parallel=True, nogil=True)
def _leaky_relu_backward(out, dout, slope, dx):
    for i in prange(out.size):
        dx[i] = dout[i] if out[i] > 0 else slope * dout[i]


@njit(cache=True, parallel=True, nogil=True)
def _add_forward(a, b, out):
    for i in prange(a.size):
        out[i] = a[i] + b[i]


@njit(cache=True, parallel=True, nogil=True)
def _dropout(x, mask, scale, out):
    scale32 = np.float32(scale)
    for i in prange(x.size):
        out[i] = x[i] * scale32 if mask[i] != 0 else np.float32(0.0)


def _flat(
    op: str, name: str, array: np.ndarray, shape: tuple[int, ...] | None = None, dtype: type = np.float32
) -> np.ndarray:
    """The checked array as a 1-D view (no copy: it is C-contiguous)."""
    return check_array(op, name, array, shape, dtype).reshape(-1)


def relu_forward(x: np.ndarray, out: np.ndarray) -> None:
    """out = max(x, 0); ``out`` may be ``x``."""
    _relu_forward(_flat("relu_forward", "x", x), _flat("relu_forward", "out", out, x.shape))


def relu_backward(out: np.ndarray, dout: np.ndarray, dx: np.ndarray) -> None:
    """dx = dout where the forward output was positive; ``dx`` may be ``dout``."""
    op = "relu_backward"
    _relu_backward(_flat(op, "out", out), _flat(op, "dout", dout, out.shape), _flat(op, "dx", dx, out.shape))


def relu6_forward(x: np.ndarray, out: np.ndarray) -> None:
    """out = min(max(x, 0), 6); ``out`` may be ``x``."""
    _relu6_forward(_flat("relu6_forward", "x", x), _flat("relu6_forward", "out", out, x.shape))


def relu6_backward(out: np.ndarray, dout: np.ndarray, dx: np.ndarray) -> None:
    """dx = dout where 0 < out < 6; ``dx`` may be ``dout``."""
    op = "relu6_backward"
    _relu6_backward(_flat(op, "out", out), _flat(op, "dout", dout, out.shape), _flat(op, "dx", dx, out.shape))


def relu_forward_checksum(x: np.ndarray, out: np.ndarray) -> tuple[int, int]:
    """``relu_forward`` (the same bits) and (Σ wᵢ, Σ (i+1)·wᵢ) mod 2⁶⁴ over ``x``'s 32-bit words wᵢ, in one
    pass over ``x``; ``out`` may be ``x``.

    The offload scheduler's check of a tensor that a ReLU rebuild reads back from the swap file: any
    change of one byte changes the first sum (by d·2⁸ᵏ, 0 < |d| < 2⁸, never 0 mod 2⁶⁴), the second also
    sees words that moved. Integer sums: the same value at any thread count."""
    op = "relu_forward_checksum"
    flat_x = _flat(op, "x", x)
    s1, s2 = _clamp_forward_sums(flat_x, flat_x.view(np.uint32), np.float32(np.inf), _flat(op, "out", out, x.shape))
    return int(s1), int(s2)


def relu6_forward_checksum(x: np.ndarray, out: np.ndarray) -> tuple[int, int]:
    """``relu6_forward`` (the same bits) and ``relu_forward_checksum``'s sums of ``x``, in one pass;
    ``out`` may be ``x``."""
    op = "relu6_forward_checksum"
    flat_x = _flat(op, "x", x)
    s1, s2 = _clamp_forward_sums(flat_x, flat_x.view(np.uint32), np.float32(6.0), _flat(op, "out", out, x.shape))
    return int(s1), int(s2)


def _slope(op: str, negative_slope: float) -> np.float32:
    if not negative_slope >= 0:  # the output is the backward's mask only for a slope >= 0 (NaN refused too)
        raise ValueError(f"{op}: negative_slope must be >= 0, got {negative_slope}")
    return np.float32(negative_slope)


def leaky_relu_forward(x: np.ndarray, out: np.ndarray, negative_slope: float) -> None:
    """out = x where x > 0, else negative_slope · x; ``out`` may be ``x``."""
    op = "leaky_relu_forward"
    _leaky_relu_forward(_flat(op, "x", x), _slope(op, negative_slope), _flat(op, "out", out, x.shape))


def leaky_relu_backward(out: np.ndarray, dout: np.ndarray, dx: np.ndarray, negative_slope: float) -> None:
    """dx = dout where out > 0, else negative_slope · dout; ``dx`` may be ``dout``."""
    op = "leaky_relu_backward"
    _leaky_relu_backward(_flat(op, "out", out), _flat(op, "dout", dout, out.shape), _slope(op, negative_slope),
                         _flat(op, "dx", dx, out.shape))


def add_forward(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """out = a + b (the residual add); ``out`` may be ``a`` or ``b``."""
    op = "add_forward"
    _add_forward(_flat(op, "a", a), _flat(op, "b", b, a.shape), _flat(op, "out", out, a.shape))


def dropout_forward(x: np.ndarray, mask: np.ndarray, scale: float, out: np.ndarray) -> None:
    """out = x * mask * scale with a 0/1 uint8 mask drawn by the caller (so backward reuses it)."""
    op = "dropout_forward"
    _dropout(
        _flat(op, "x", x),
        _flat(op, "mask", mask, x.shape, np.uint8),
        float(scale),
        _flat(op, "out", out, x.shape),
    )


def dropout_backward(dout: np.ndarray, mask: np.ndarray, scale: float, dx: np.ndarray) -> None:
    """dx = dout * mask * scale: the same scaling, so the same kernel."""
    op = "dropout_backward"
    _dropout(
        _flat(op, "dout", dout),
        _flat(op, "mask", mask, dout.shape, np.uint8),
        float(scale),
        _flat(op, "dx", dx, dout.shape),
    )

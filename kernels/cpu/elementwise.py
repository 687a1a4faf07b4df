"""Element-wise CPU kernels: relu, relu6, leaky relu, residual add and dropout.

Each kernel sees its arrays flattened to 1-D (a free view of a C-contiguous array), so one compiled
version serves every shape, and runs over a range ``[lo, hi)`` of it; ``threads.run_ranges`` splits the
flat index range across the threads (``MIN_SHARE`` elements or more each). Every output element
depends on one input element only, so the result is the same for any thread count.

Why serial kernels and Python threads, not ``prange``: the first run. A ``parallel=True`` kernel
compiles 3–4× longer on a cold cache (Numba's parfor passes and gufunc), and the element-wise
kernels were compiled by every model's warm-up (engine/warmup.py has the figures). The indices are
unsigned, as the ``prange`` index of a gufunc is: a signed index makes Numba check it for wrap-around
on every access, which keeps LLVM from vectorizing.
"""

from __future__ import annotations

import numpy as np
from numba import get_num_threads, njit, uint64

from kernels.cpu.checks import check_array
from kernels.cpu.threads import run_ranges

MIN_SHARE = 1 << 16
"""Elements a thread's range holds at least (256 KiB of float32): a smaller array runs on the calling
thread, which is quicker than a pool round trip (tens of microseconds)."""


@njit(cache=True, nogil=True)
def _relu_forward(x, out, lo, hi):
    for i in range(uint64(lo), uint64(hi)):
        v = x[i]
        out[i] = np.float32(0.0) if v < 0 else v  # NaN passes through, as in PyTorch


@njit(cache=True, nogil=True)
def _relu_backward(out, dout, dx, lo, hi):
    for i in range(uint64(lo), uint64(hi)):
        dx[i] = dout[i] if out[i] > 0 else np.float32(0.0)


@njit(cache=True, nogil=True)
def _relu6_forward(x, out, lo, hi):
    for i in range(uint64(lo), uint64(hi)):
        v = x[i]
        out[i] = np.float32(0.0) if v < 0 else (np.float32(6.0) if v > 6 else v)


@njit(cache=True, nogil=True)
def _relu6_backward(out, dout, dx, lo, hi):
    for i in range(uint64(lo), uint64(hi)):
        v = out[i]
        dx[i] = dout[i] if (v > 0 and v < 6) else np.float32(0.0)


@njit(cache=True, nogil=True)
def _clamp_forward_sums(x, words, cap, out, lo, hi):
    """out = min(max(x, 0), cap) as ReLU (cap = +inf: never taken, the same bits as ``_relu_forward``)
    and ReLU6 (cap = 6) compute it, and (Σ wᵢ, Σ (i+1)·wᵢ) mod 2⁶⁴ over x's 32-bit words wᵢ, i in
    [lo, hi), in the same pass: one kernel for both (variants by parameter, one compile). The ranges'
    sums add up mod 2⁶⁴ to the whole array's, in any order."""
    s1 = np.uint64(0)
    s2 = np.uint64(0)
    for i in range(uint64(lo), uint64(hi)):
        v = x[i]
        w = np.uint64(words[i])
        out[i] = np.float32(0.0) if v < 0 else (cap if v > cap else v)
        s1 += w
        s2 += w * (i + np.uint64(1))
    return s1, s2


@njit(cache=True, nogil=True)
def _leaky_relu_forward(x, slope, out, lo, hi):
    for i in range(uint64(lo), uint64(hi)):
        v = x[i]
        out[i] = v if v > 0 else slope * v


@njit(cache=True, nogil=True)
def _leaky_relu_backward(out, dout, slope, dx, lo, hi):
    for i in range(uint64(lo), uint64(hi)):
        dx[i] = dout[i] if out[i] > 0 else slope * dout[i]


@njit(cache=True, nogil=True)
def _add_forward(a, b, out, lo, hi):
    for i in range(uint64(lo), uint64(hi)):
        out[i] = a[i] + b[i]


@njit(cache=True, nogil=True)
def _dropout(x, mask, scale, out, lo, hi):
    scale32 = np.float32(scale)
    for i in range(uint64(lo), uint64(hi)):
        out[i] = x[i] * scale32 if mask[i] != 0 else np.float32(0.0)


def _over_threads(kernel, items: int, *args) -> None:
    """``kernel(*args, lo, hi)`` over the threads' ranges of ``[0, items)``."""
    run_ranges(lambda lo, hi: kernel(*args, lo, hi), items, get_num_threads(), MIN_SHARE)


def _flat(
    op: str, name: str, array: np.ndarray, shape: tuple[int, ...] | None = None, dtype: type = np.float32
) -> np.ndarray:
    """The checked array as a 1-D view (no copy: it is C-contiguous)."""
    return check_array(op, name, array, shape, dtype).reshape(-1)


def relu_forward(x: np.ndarray, out: np.ndarray) -> None:
    """out = max(x, 0); ``out`` may be ``x``."""
    _over_threads(_relu_forward, x.size, _flat("relu_forward", "x", x), _flat("relu_forward", "out", out, x.shape))


def relu_backward(out: np.ndarray, dout: np.ndarray, dx: np.ndarray) -> None:
    """dx = dout where the forward output was positive; ``dx`` may be ``dout``."""
    op = "relu_backward"
    _over_threads(_relu_backward, out.size, _flat(op, "out", out), _flat(op, "dout", dout, out.shape),
                  _flat(op, "dx", dx, out.shape))


def relu6_forward(x: np.ndarray, out: np.ndarray) -> None:
    """out = min(max(x, 0), 6); ``out`` may be ``x``."""
    _over_threads(_relu6_forward, x.size, _flat("relu6_forward", "x", x), _flat("relu6_forward", "out", out, x.shape))


def relu6_backward(out: np.ndarray, dout: np.ndarray, dx: np.ndarray) -> None:
    """dx = dout where 0 < out < 6; ``dx`` may be ``dout``."""
    op = "relu6_backward"
    _over_threads(_relu6_backward, out.size, _flat(op, "out", out), _flat(op, "dout", dout, out.shape),
                  _flat(op, "dx", dx, out.shape))


def _clamp_with_sums(x: np.ndarray, cap: np.float32, out: np.ndarray) -> tuple[int, int]:
    """``_clamp_forward_sums`` over the threads' ranges; its sums added mod 2⁶⁴ (range order: any order
    gives the same integers)."""
    sums: list[tuple[int, int]] = []
    words = x.view(np.uint32)
    run_ranges(lambda lo, hi: sums.append(_clamp_forward_sums(x, words, cap, out, lo, hi)), x.size,
               get_num_threads(), MIN_SHARE)
    mask = (1 << 64) - 1
    return sum(int(s1) for s1, _ in sums) & mask, sum(int(s2) for _, s2 in sums) & mask


def relu_forward_checksum(x: np.ndarray, out: np.ndarray) -> tuple[int, int]:
    """``relu_forward`` (the same bits) and (Σ wᵢ, Σ (i+1)·wᵢ) mod 2⁶⁴ over ``x``'s 32-bit words wᵢ, in one
    pass over ``x``; ``out`` may be ``x``.

    The offload scheduler's check of a tensor that a ReLU rebuild reads back from the swap file: any
    change of one byte changes the first sum (by d·2⁸ᵏ, 0 < |d| < 2⁸, never 0 mod 2⁶⁴), the second also
    sees words that moved. Integer sums: the same value at any thread count."""
    op = "relu_forward_checksum"
    return _clamp_with_sums(_flat(op, "x", x), np.float32(np.inf), _flat(op, "out", out, x.shape))


def relu6_forward_checksum(x: np.ndarray, out: np.ndarray) -> tuple[int, int]:
    """``relu6_forward`` (the same bits) and ``relu_forward_checksum``'s sums of ``x``, in one pass;
    ``out`` may be ``x``."""
    op = "relu6_forward_checksum"
    return _clamp_with_sums(_flat(op, "x", x), np.float32(6.0), _flat(op, "out", out, x.shape))


def _slope(op: str, negative_slope: float) -> np.float32:
    if not negative_slope >= 0:  # the output is the backward's mask only for a slope >= 0 (NaN refused too)
        raise ValueError(f"{op}: negative_slope must be >= 0, got {negative_slope}")
    return np.float32(negative_slope)


def leaky_relu_forward(x: np.ndarray, out: np.ndarray, negative_slope: float) -> None:
    """out = x where x > 0, else negative_slope · x; ``out`` may be ``x``."""
    op = "leaky_relu_forward"
    _over_threads(_leaky_relu_forward, x.size, _flat(op, "x", x), _slope(op, negative_slope),
                  _flat(op, "out", out, x.shape))


def leaky_relu_backward(out: np.ndarray, dout: np.ndarray, dx: np.ndarray, negative_slope: float) -> None:
    """dx = dout where out > 0, else negative_slope · dout; ``dx`` may be ``dout``."""
    op = "leaky_relu_backward"
    _over_threads(_leaky_relu_backward, out.size, _flat(op, "out", out), _flat(op, "dout", dout, out.shape),
                  _slope(op, negative_slope), _flat(op, "dx", dx, out.shape))


def add_forward(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """out = a + b (the residual add); ``out`` may be ``a`` or ``b``."""
    op = "add_forward"
    _over_threads(_add_forward, a.size, _flat(op, "a", a), _flat(op, "b", b, a.shape), _flat(op, "out", out, a.shape))


def dropout_forward(x: np.ndarray, mask: np.ndarray, scale: float, out: np.ndarray) -> None:
    """out = x * mask * scale with a 0/1 uint8 mask drawn by the caller (so backward reuses it)."""
    op = "dropout_forward"
    _over_threads(
        _dropout,
        x.size,
        _flat(op, "x", x),
        _flat(op, "mask", mask, x.shape, np.uint8),
        float(scale),
        _flat(op, "out", out, x.shape),
    )


def dropout_backward(dout: np.ndarray, mask: np.ndarray, scale: float, dx: np.ndarray) -> None:
    """dx = dout * mask * scale: the same scaling, so the same kernel."""
    op = "dropout_backward"
    _over_threads(
        _dropout,
        dout.size,
        _flat(op, "dout", dout),
        _flat(op, "mask", mask, dout.shape, np.uint8),
        float(scale),
        _flat(op, "dx", dx, dout.shape),
    )

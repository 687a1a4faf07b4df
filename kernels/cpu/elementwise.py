"""Element-wise CPU kernels: relu, relu6, leaky relu, residual add and dropout.

Each kernel sees its arrays flattened to 1-D (a free view of a C-contiguous array), so one compiled
version serves every shape, and ``threads.run_ranges`` splits the flat index range across threads (a
call under ``RANGE_MIN_VALUES`` runs on the calling thread). Every output element depends on one input
element only, so the result is the same for any thread count.

**Serial kernels with an in-place branch** (2026-11-28). They were ``prange`` kernels: a ``parallel=True``
kernel compiles several times longer on a cold cache (Numba's parfor passes and gufunc), and they were the
last ones in a ResNet-18 warm-up (``_relu_forward`` 0.43 s, ``_clamp_forward_sums`` 0.44, ``_relu_backward``
0.25, ``_add_forward`` 0.22 s of exclusive compile CPU, ``numba:compile`` events on an empty cache). Tried
first (the batch-norm session): serial kernels over ``[lo, hi)``, which made MobileNetV2's step 0.30 →
0.42–0.46 s. The layers call these kernels in place (``relu6_backward(out, dout, dout)``), and a serial
loop that writes one array and reads another is vectorized behind a run-time overlap check of the two,
which fails when they are the same memory: the scalar loop ran, 5 ns an element (2.0 ms for 393,216
elements against 0.1 ms). A parfor's gufunc has no such check (Numba lowers it with ``noalias``). So each
kernel here takes ``same`` (the written array *is* the read one, decided by its address in Python) and has
a loop for that case that reads and writes one array only: nothing to check, vectorized. One kernel per
formula, the variants by parameter: ReLU and ReLU6 are one clamp (the cap +inf for ReLU: never taken,
the same bits), their gradients one mask (``_passes``).

Measured (two threads, median of 15 calls, ms, prange → serial, not in place / in place): ReLU forward
on 32×64×32×32 0.160 / 0.085 → 0.175 / 0.105, on 8×96×112×112 1.92 / 1.16 → 2.01 / 1.00, 32×96×56×56
2.02 / 0.85 → 1.66 / 0.82; backward 0.274 / 0.153 → 0.305 / 0.183, 2.86 / 1.73 → 2.90 / 1.74, 2.74 /
1.80 → 2.92 / 1.74; on 32×512×4×4 all 0.04–0.06 either way. Level but on CIFAR's 2-million-element
tensors, where the range hand-out costs ~15–30 µs a call (~40 calls a ResNet-18 step: < 1 ms of ~420).
Compile: 0.11 s a kernel against 0.22–0.44 (the parfor's own passes, first-call figures above).

The ``prange`` kernels' arithmetic, expression for expression (``tests/kernels/cpu/test_elementwise.py`` compares
every kernel's bits with the reference's on a tensor the threads split, in place and not, at one thread and at up to
three, as many as Numba's pool has). ``out`` may be ``x`` (the same array); an array that overlaps another only in
part is not a supported argument.
"""

from __future__ import annotations

import numpy as np
from numba import get_num_threads, njit, uint64

from kernels.cpu.checks import check_array, same_memory
from kernels.cpu.threads import run_ranges

_NO_CAP = np.float32(np.inf)
"""ReLU's cap in the clamp: never taken, so ``_clamp`` with it gives ReLU's bits."""

_NO_LIMIT = np.float32(np.nan)
"""ReLU's limit in ``_passes``: ``v >= NaN`` is never true, so every positive output passes (+inf too)."""


@njit(cache=True, nogil=True, inline="always")
def _clamped(v, cap):
    return np.float32(0.0) if v < 0 else (cap if v > cap else v)  # NaN passes through, as in PyTorch


@njit(cache=True, nogil=True, inline="always")
def _passes(v, limit):
    """Whether the gradient passes an activation whose output is ``v``: 0 < v, and v < 6 for ReLU6
    (``limit`` 6; ReLU's ``_NO_LIMIT`` makes the second test always pass)."""
    return v > 0 and not v >= limit


@njit(cache=True, nogil=True)
def _clamp(x, out, cap, same, lo, hi):
    """out[i] = min(max(x[i], 0), cap) for i in [lo, hi); ``same``: out is x."""
    if same:
        for i in range(uint64(lo), uint64(hi)):
            x[i] = _clamped(x[i], cap)
    else:
        for i in range(uint64(lo), uint64(hi)):
            out[i] = _clamped(x[i], cap)


@njit(cache=True, nogil=True)
def _clamp_sums(x, words, out, cap, lo, hi):
    """``_clamp`` over [lo, hi) and (Σ wᵢ, Σ (i+1)·wᵢ) mod 2⁶⁴ over x's 32-bit words there. No in-place loop:
    the offload scheduler, its one caller, never passes out = x (in place it is still right, on the scalar
    loop)."""
    s1 = np.uint64(0)
    s2 = np.uint64(0)
    for i in range(uint64(lo), uint64(hi)):
        w = np.uint64(words[i])
        out[i] = _clamped(x[i], cap)
        s1 += w
        s2 += w * (i + np.uint64(1))
    return s1, s2


@njit(cache=True, nogil=True)
def _mask(out, dout, dx, limit, same, lo, hi):
    """dx[i] = dout[i] where ``_passes(out[i], limit)``, else 0; ``same``: dx is dout."""
    if same:
        for i in range(uint64(lo), uint64(hi)):
            dout[i] = dout[i] if _passes(out[i], limit) else np.float32(0.0)
    else:
        for i in range(uint64(lo), uint64(hi)):
            dx[i] = dout[i] if _passes(out[i], limit) else np.float32(0.0)


@njit(cache=True, nogil=True)
def _leaky_relu_forward(x, slope, out, same, lo, hi):
    if same:
        for i in range(uint64(lo), uint64(hi)):
            v = x[i]
            x[i] = v if v > 0 else slope * v
    else:
        for i in range(uint64(lo), uint64(hi)):
            v = x[i]
            out[i] = v if v > 0 else slope * v


@njit(cache=True, nogil=True)
def _leaky_relu_backward(out, dout, slope, dx, same, lo, hi):
    if same:
        for i in range(uint64(lo), uint64(hi)):
            dout[i] = dout[i] if out[i] > 0 else slope * dout[i]
    else:
        for i in range(uint64(lo), uint64(hi)):
            dx[i] = dout[i] if out[i] > 0 else slope * dout[i]


@njit(cache=True, nogil=True)
def _add(a, b, out, same, lo, hi):
    """out = a + b; ``same``: out is a (the caller swaps a and b when out is b: a float sum commutes)."""
    if same:
        for i in range(uint64(lo), uint64(hi)):
            a[i] += b[i]
    else:
        for i in range(uint64(lo), uint64(hi)):
            out[i] = a[i] + b[i]


@njit(cache=True, nogil=True)
def _dropout(x, mask, scale, out, same, lo, hi):
    scale32 = np.float32(scale)
    if same:
        for i in range(uint64(lo), uint64(hi)):
            x[i] = x[i] * scale32 if mask[i] != 0 else np.float32(0.0)
    else:
        for i in range(uint64(lo), uint64(hi)):
            out[i] = x[i] * scale32 if mask[i] != 0 else np.float32(0.0)


def _flat(
    op: str, name: str, array: np.ndarray, shape: tuple[int, ...] | None = None, dtype: type = np.float32
) -> np.ndarray:
    """The checked array as a 1-D view (no copy: it is C-contiguous)."""
    return check_array(op, name, array, shape, dtype).reshape(-1)


def _over_ranges(kernel, *args) -> None:
    """``kernel(*args, lo, hi)`` over the flat length of ``args[0]``, split by ``run_ranges``."""
    run_ranges(lambda lo, hi: kernel(*args, lo, hi), args[0].size, get_num_threads())


def relu_forward(x: np.ndarray, out: np.ndarray) -> None:
    """out = max(x, 0); ``out`` may be ``x``."""
    xf, of = _flat("relu_forward", "x", x), _flat("relu_forward", "out", out, x.shape)
    _over_ranges(_clamp, xf, of, _NO_CAP, same_memory(xf, of))


def relu_backward(out: np.ndarray, dout: np.ndarray, dx: np.ndarray) -> None:
    """dx = dout where the forward output was positive; ``dx`` may be ``dout``."""
    _masked("relu_backward", out, dout, dx, _NO_LIMIT)


def relu6_forward(x: np.ndarray, out: np.ndarray) -> None:
    """out = min(max(x, 0), 6); ``out`` may be ``x``."""
    xf, of = _flat("relu6_forward", "x", x), _flat("relu6_forward", "out", out, x.shape)
    _over_ranges(_clamp, xf, of, np.float32(6.0), same_memory(xf, of))


def relu6_backward(out: np.ndarray, dout: np.ndarray, dx: np.ndarray) -> None:
    """dx = dout where 0 < out < 6; ``dx`` may be ``dout``."""
    _masked("relu6_backward", out, dout, dx, np.float32(6.0))


def _masked(op: str, out: np.ndarray, dout: np.ndarray, dx: np.ndarray, limit: np.float32) -> None:
    o, d, g = _flat(op, "out", out), _flat(op, "dout", dout, out.shape), _flat(op, "dx", dx, out.shape)
    _over_ranges(_mask, o, d, g, limit, same_memory(d, g))


def _forward_checksum(op: str, x: np.ndarray, out: np.ndarray, cap: np.float32) -> tuple[int, int]:
    flat_x, flat_out = _flat(op, "x", x), _flat(op, "out", out, x.shape)
    words = flat_x.view(np.uint32)
    parts: list[tuple[int, int]] = []  # one per range; list.append is atomic, and the sums commute
    run_ranges(lambda lo, hi: parts.append(_clamp_sums(flat_x, words, flat_out, cap, lo, hi)), flat_x.size,
               get_num_threads())
    return sum(int(a) for a, _ in parts) % 2**64, sum(int(b) for _, b in parts) % 2**64


def relu_forward_checksum(x: np.ndarray, out: np.ndarray) -> tuple[int, int]:
    """``relu_forward`` (the same bits) and (Σ wᵢ, Σ (i+1)·wᵢ) mod 2⁶⁴ over ``x``'s 32-bit words wᵢ, in one
    pass over ``x``; ``out`` may be ``x``.

    The offload scheduler's check of a tensor that a ReLU rebuild reads back from the swap file: any
    change of one byte changes the first sum (by d·2⁸ᵏ, 0 < |d| < 2⁸, never 0 mod 2⁶⁴), the second also
    sees words that moved. Integer sums: the same value at any thread count."""
    return _forward_checksum("relu_forward_checksum", x, out, _NO_CAP)


def relu6_forward_checksum(x: np.ndarray, out: np.ndarray) -> tuple[int, int]:
    """``relu6_forward`` (the same bits) and ``relu_forward_checksum``'s sums of ``x``, in one pass;
    ``out`` may be ``x``."""
    return _forward_checksum("relu6_forward_checksum", x, out, np.float32(6.0))


def _slope(op: str, negative_slope: float) -> np.float32:
    if not negative_slope >= 0:  # the output is the backward's mask only for a slope >= 0 (NaN refused too)
        raise ValueError(f"{op}: negative_slope must be >= 0, got {negative_slope}")
    return np.float32(negative_slope)


def leaky_relu_forward(x: np.ndarray, out: np.ndarray, negative_slope: float) -> None:
    """out = x where x > 0, else negative_slope · x; ``out`` may be ``x``."""
    op = "leaky_relu_forward"
    xf, of = _flat(op, "x", x), _flat(op, "out", out, x.shape)
    _over_ranges(_leaky_relu_forward, xf, _slope(op, negative_slope), of, same_memory(xf, of))


def leaky_relu_backward(out: np.ndarray, dout: np.ndarray, dx: np.ndarray, negative_slope: float) -> None:
    """dx = dout where out > 0, else negative_slope · dout; ``dx`` may be ``dout``."""
    op = "leaky_relu_backward"
    o, d, g = _flat(op, "out", out), _flat(op, "dout", dout, out.shape), _flat(op, "dx", dx, out.shape)
    _over_ranges(_leaky_relu_backward, o, d, _slope(op, negative_slope), g, same_memory(d, g))


def add_forward(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """out = a + b (the residual add); ``out`` may be ``a`` or ``b``."""
    op = "add_forward"
    af, bf, of = _flat(op, "a", a), _flat(op, "b", b, a.shape), _flat(op, "out", out, a.shape)
    if same_memory(bf, of):
        af, bf = bf, af
    _over_ranges(_add, af, bf, of, same_memory(af, of))


def dropout_forward(x: np.ndarray, mask: np.ndarray, scale: float, out: np.ndarray) -> None:
    """out = x * mask * scale with a 0/1 uint8 mask drawn by the caller (so backward reuses it)."""
    _dropout_call("dropout_forward", "x", x, mask, scale, "out", out)


def dropout_backward(dout: np.ndarray, mask: np.ndarray, scale: float, dx: np.ndarray) -> None:
    """dx = dout * mask * scale: the same scaling, so the same kernel."""
    _dropout_call("dropout_backward", "dout", dout, mask, scale, "dx", dx)


def _dropout_call(op: str, x_name: str, x: np.ndarray, mask: np.ndarray, scale: float, out_name: str,
                  out: np.ndarray) -> None:
    xf, of = _flat(op, x_name, x), _flat(op, out_name, out, x.shape)
    _over_ranges(_dropout, xf, _flat(op, "mask", mask, x.shape, np.uint8), float(scale), of, same_memory(xf, of))

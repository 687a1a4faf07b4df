"""Batch-norm CPU kernels (per channel, NCHW), with PyTorch's semantics.

The threads split the channels (``threads.run_ranges``: each kernel runs over a range ``[lo, hi)`` of
channels): each channel's sums (mean, variance, the two backward sums) run in one thread, over n then
h*w, in float64. No partial sums cross threads, so the bits do not depend on the thread count, and the
float64 accumulators keep the statistics accurate over large batches. Arrays are viewed as
[N, C, H*W] so one compiled version serves every spatial size.

Serial kernels over a range of channels, not ``prange`` loops, for the first run: on a cold cache
the three ``parallel=True`` kernels compiled in 1.39, 1.05 and 0.61 s (Numba's parfor passes and
gufunc), a sixth of ResNet-18's warm-up; as serial kernels 0.31 s for the training forward (the same
loops; engine/warmup.py has the whole warm-up's figures). The same bits: each channel is computed
by the same code in one thread, as before. The training step was measured level before (a chunked
version tried for speed: kernels/cpu/threads.py, "Tried and dropped").

The sums are split into vector lanes (``_channel_sum`` & co. compiled with ``fastmath={"reassoc"}``,
that flag only and in those functions only). With one float64 accumulator each value was a
dependent add, and that latency chain was the kernel's time: MobileNetV2's 52 batch-norm layers
(batch 32, two threads) took 59 ms forward and 43 ms backward a training step, a third of the
engine's step and more than any conv direction. With lanes: 22 and 25 ms (sum over the layers of
the median of 7 calls each, old and new kernels timed side by side in one process on the AMD EPYC
machine); the 32×32 layers now run at memory bandwidth (144 ch @32×32 forward 5.0 → 1.9 ms:
19 MB in, 19 MB out). Tried first: eight float64 accumulators written out by hand (lane = index
mod 8), which keeps the order explicit without ``reassoc``; LLVM kept them scalar (``vaddsd``), so
it bought only the chain's latency: 61 → 45 ms forward, backward unchanged (55 → 61 ms, noise).
The lanes LLVM picks depend on the compiled code and the plane's length, never on the arrays'
addresses (x86 needs no alignment peeling) or the thread count: the same bits on every call, with
offload on or off (``test_batchnorm_bits_do_not_depend_on_the_arrays_alignment``).

``batchnorm_backward_from_output`` is In-Place ABN's backward (arXiv 1712.02616): it rebuilds
x̂ = (out − β) / γ from the *output*, so a layer keeps its output (which the ReLU after it and the
offload plan can share) instead of its input. Dividing by γ needs γ ≠ 0: every kernel here uses
γ with its magnitude raised to ``GAMMA_MIN`` (sign kept, 0 → +GAMMA_MIN), in forward and inference
alike, so the value the output was made with is the one backward divides by. With γ initialized to
1 this never triggers; the x̂ rebuilt for |γ| = 1e-5 and |β| = 1 is off by about ulp(1)/1e-5 = 1e-2,
harmless for a channel whose dx is scaled by γ. The input-based backward is only the NumPy
reference's (kernels/reference/batchnorm.py), what this one is tested against: no layer calls it.
"""

from __future__ import annotations

import math

import numpy as np
from numba import get_num_threads, njit

from kernels.cpu.checks import check_array, same_memory
from kernels.cpu.threads import run_ranges

GAMMA_MIN = 1e-5

@njit(cache=True, inline="always")
def _safe_gamma(g):
    if abs(g) >= GAMMA_MIN:
        return g
    return -GAMMA_MIN if g < 0 else GAMMA_MIN


@njit(cache=True, nogil=True, fastmath={"reassoc"})
def _channel_sum(x, c):
    """Σ over n and i of x[n, c, i], in float64.

    ``reassoc`` (this function only) lets LLVM split the sum into vector lanes: a single float64
    accumulator is one dependent add per value, ~4 cycles each, and that chain *was* this kernel's
    time. The lane split LLVM chooses depends on the compiled code and the plane's length only, not
    on the data's address (no alignment peeling on x86) or the thread count, so the bits are the same
    on every call, with offload on or off, at any thread count."""
    total = 0.0
    for n in range(x.shape[0]):
        row = x[n, c]
        for i in range(x.shape[2]):
            total += row[i]
    return total


@njit(cache=True, nogil=True, fastmath={"reassoc"})
def _channel_squares(x, c, mean):
    """Σ (x[n, c, i] − mean)², lanes as in ``_channel_sum``."""
    total = 0.0
    for n in range(x.shape[0]):
        row = x[n, c]
        for i in range(x.shape[2]):
            d = row[i] - mean
            total += d * d
    return total


@njit(cache=True, nogil=True, fastmath={"reassoc"})
def _channel_gradient_sums(y, dout, c, b, inv_g):
    """(Σ dout, Σ dout · x̂) over channel c with x̂ = (y − β)/γ, lanes as in ``_channel_sum``."""
    sum_dout = 0.0
    sum_dout_xhat = 0.0
    for n in range(y.shape[0]):
        g = dout[n, c]
        v = y[n, c]
        for i in range(y.shape[2]):
            d = np.float64(g[i])
            sum_dout += d
            sum_dout_xhat += d * ((v[i] - b) * inv_g)
    return sum_dout, sum_dout_xhat


@njit(cache=True, nogil=True)
def _forward_train(x, gamma, beta, running_mean, running_var, out, save_mean, save_invstd, momentum, eps, lo, hi):
    N, C, area = x.shape
    count = N * area
    for c in range(lo, hi):
        ch = np.int64(c)  # the sum helpers' one signature (tests/engine/test_warmup.py)
        mean = _channel_sum(x, ch) / count
        # second pass over centred values: no cancellation, unlike E[x^2] - E[x]^2
        squares = _channel_squares(x, ch, mean)
        var = squares / count  # biased: what the batch is normalized with
        invstd = 1.0 / math.sqrt(var + eps)
        scale = _safe_gamma(gamma[c]) * invstd
        shift = beta[c] - mean * scale
        for n in range(N):
            for i in range(area):
                out[n, c, i] = x[n, c, i] * scale + shift
        save_mean[c] = mean
        save_invstd[c] = invstd
        unbiased_var = squares / (count - 1)  # what the running estimate tracks
        running_mean[c] = (1.0 - momentum) * running_mean[c] + momentum * mean
        running_var[c] = (1.0 - momentum) * running_var[c] + momentum * unbiased_var


@njit(cache=True, nogil=True)
def _forward_infer(x, gamma, beta, running_mean, running_var, out, eps, lo, hi):
    N, C, area = x.shape
    for c in range(lo, hi):
        scale = _safe_gamma(gamma[c]) / math.sqrt(running_var[c] + eps)
        shift = beta[c] - running_mean[c] * scale
        for n in range(N):
            for i in range(area):
                out[n, c, i] = x[n, c, i] * scale + shift


@njit(cache=True, nogil=True)
def _backward_from_output(y, dout, gamma, beta, save_invstd, dx, dgamma, dbeta, lo, hi):
    N, C, area = y.shape
    count = N * area
    for c in range(lo, hi):
        ch = np.int64(c)  # one signature of _channel_gradient_sums
        g = np.float64(_safe_gamma(gamma[c]))
        inv_g = 1.0 / g
        b = np.float64(beta[c])
        invstd = np.float64(save_invstd[c])
        sum_dout, sum_dout_xhat = _channel_gradient_sums(y, dout, ch, b, inv_g)
        dbeta[c] = sum_dout
        dgamma[c] = sum_dout_xhat
        k = g * invstd
        mean_dout = sum_dout / count
        mean_dout_xhat = sum_dout_xhat / count
        for n in range(N):
            for i in range(area):
                xhat = (y[n, c, i] - b) * inv_g
                dx[n, c, i] = k * (dout[n, c, i] - mean_dout - xhat * mean_dout_xhat)


def _over_channels(kernel, x3: np.ndarray, *args) -> None:
    """``kernel(*args, lo, hi)`` over the threads' ranges of the channels of ``x3`` ([N, C, H·W])."""
    N, C, area = x3.shape
    run_ranges(lambda lo, hi: kernel(*args, lo, hi), C, get_num_threads(), N * area)


def _channels(op: str, x: np.ndarray) -> tuple[int, int, int]:
    check_array(op, "x", x)
    if x.ndim != 4:
        raise ValueError(f"{op}: x must be NCHW (4-D), got shape {x.shape}")
    N, C, H, W = x.shape
    return N, C, H * W


def batchnorm_forward_train(
    x: np.ndarray,
    gamma: np.ndarray,
    beta: np.ndarray,
    running_mean: np.ndarray,
    running_var: np.ndarray,
    out: np.ndarray,
    save_mean: np.ndarray,
    save_invstd: np.ndarray,
    momentum: float,
    eps: float,
) -> None:
    """Normalize with batch statistics; save mean and 1/std for backward; update the running stats."""
    op = "batchnorm_forward_train"
    N, C, area = _channels(op, x)
    if N * area < 2:
        raise ValueError(f"{op}: training needs more than one value per channel, got input shape {x.shape}")
    check_array(op, "out", out, x.shape)
    for name, array in [("gamma", gamma), ("beta", beta), ("running_mean", running_mean), ("running_var", running_var),
                        ("save_mean", save_mean), ("save_invstd", save_invstd)]:  # fmt: skip
        check_array(op, name, array, (C,))
    x3 = x.reshape(N, C, area)
    _over_channels(
        _forward_train, x3, x3, gamma, beta, running_mean, running_var, out.reshape(N, C, area),
        save_mean, save_invstd, float(momentum), float(eps),
    )  # fmt: skip


def batchnorm_forward_infer(
    x: np.ndarray,
    gamma: np.ndarray,
    beta: np.ndarray,
    running_mean: np.ndarray,
    running_var: np.ndarray,
    out: np.ndarray,
    eps: float,
) -> None:
    """out = (x - running_mean) / sqrt(running_var + eps) * gamma + beta."""
    op = "batchnorm_forward_infer"
    N, C, area = _channels(op, x)
    check_array(op, "out", out, x.shape)
    for name, array in [("gamma", gamma), ("beta", beta), ("running_mean", running_mean), ("running_var", running_var)]:
        check_array(op, name, array, (C,))
    x3 = x.reshape(N, C, area)
    _over_channels(_forward_infer, x3, x3, gamma, beta, running_mean, running_var, out.reshape(N, C, area), float(eps))


def batchnorm_backward_from_output(
    out: np.ndarray,
    dout: np.ndarray,
    gamma: np.ndarray,
    beta: np.ndarray,
    save_invstd: np.ndarray,
    dx: np.ndarray,
    dgamma: np.ndarray,
    dbeta: np.ndarray,
    scratch: np.ndarray | None = None,
) -> None:
    """Gradients of the training forward from its output: x̂ = (out − β) / γ (module docstring). ``scratch``
    is for the GPU's partial sums; the CPU needs none (``batchnorm_backward_from_output_workspace_size``: 0)."""
    op = "batchnorm_backward_from_output"
    N, C, area = _channels(op, out)
    check_array(op, "dout", dout, out.shape)
    check_array(op, "dx", dx, out.shape)
    for name, array in [("gamma", gamma), ("beta", beta), ("save_invstd", save_invstd), ("dgamma", dgamma),
                        ("dbeta", dbeta)]:  # fmt: skip
        check_array(op, name, array, (C,))
    y3 = out.reshape(N, C, area)
    _over_channels(
        _backward_from_output, y3, y3, dout.reshape(N, C, area), gamma, beta, save_invstd, dx.reshape(N, C, area),
        dgamma, dbeta,
    )  # fmt: skip


def batchnorm_forward_train_workspace_size(x_shape: tuple[int, ...]) -> int:
    """float32 elements of ``save_mean``: the C batch means (the CUDA kernels keep partial statistics after them)."""
    return int(x_shape[1])


def batchnorm_backward_from_output_workspace_size(x_shape: tuple[int, ...]) -> int:
    """float32 elements of backward's scratch: none on the CPU (the CUDA kernels keep partial sums in it)."""
    return 0


# ---- batch norm in chunks of images (engine/layers/chunked.py) ------------------------------------
#
# A layer that runs its batch a few images at a time (``ChunkedConvBN``) cannot see the whole batch at
# once, so its statistics are sums carried from one call to the next: each call continues the sums of
# the previous one, over its images in order. The carried value is what a single call over the whole
# batch would hold at that image boundary (each image's plane is summed into the running scalar; the
# lanes ``reassoc`` allows stay inside a plane), so any split of the batch into calls gives the same bits
# (``tests/kernels/test_batchnorm_chunks.py``). The statistics take one pass: sums of x − K and
# (x − K)² in float64, K a value of the channel (its first), so that the mean is known only after every
# chunk and no second pass over the values is needed (a chunked layer recomputes its chunks to pass over
# them again: a second pass would cost a second recomputation). With K inside the channel's range,
# float64 sums of float32 values lose nothing a float32 result can show: the error of the variance is
# about 1e-16 · (1 + (mean − K)² / var) relative.


@njit(cache=True, nogil=True, fastmath={"reassoc"})
def _shifted_sums(x, c, shift, s1, s2):
    """(s1 + Σ (x − shift), s2 + Σ (x − shift)²) over x[:, c, :], continuing the given sums."""
    for n in range(x.shape[0]):
        row = x[n, c]
        for i in range(x.shape[2]):
            d = row[i] - shift
            s1 += d
            s2 += d * d
    return s1, s2


@njit(cache=True, nogil=True)
def _chunk_statistics(x, sums, first, lo, hi):
    for c in range(lo, hi):
        if first:
            sums[c, 0] = x[0, c, 0]  # K: a value of the channel
            sums[c, 1] = 0.0
            sums[c, 2] = 0.0
        ch = np.int64(c)
        s1, s2 = _shifted_sums(x, ch, sums[c, 0], sums[c, 1], sums[c, 2])
        sums[c, 1] = s1
        sums[c, 2] = s2


@njit(cache=True, nogil=True)
def _chunk_finish(sums, count, gamma, beta, running_mean, running_var, scale_shift, save_invstd, momentum, eps):
    for c in range(sums.shape[0]):
        s1 = sums[c, 1]
        mean_shifted = s1 / count
        mean = sums[c, 0] + mean_shifted
        squares = max(sums[c, 2] - s1 * mean_shifted, 0.0)
        var = squares / count
        invstd = 1.0 / math.sqrt(var + eps)
        scale = _safe_gamma(gamma[c]) * invstd
        scale_shift[c, 0] = scale
        scale_shift[c, 1] = beta[c] - mean * scale
        save_invstd[c] = invstd
        running_mean[c] = (1.0 - momentum) * running_mean[c] + momentum * mean
        running_var[c] = (1.0 - momentum) * running_var[c] + momentum * (squares / (count - 1))


@njit(cache=True, nogil=True, inline="always")
def _activate(v, act):
    """act 0 none, 1 ReLU, 2 ReLU6."""
    if act == 1:
        return max(v, np.float32(0.0))
    if act == 2:
        return min(max(v, np.float32(0.0)), np.float32(6.0))
    return v


@njit(cache=True, nogil=True)
def _chunk_apply(z, scale_shift, act, y, out, lo, hi):
    """y = z·scale + shift (when y has images), out = act(that), y and out other arrays than z."""
    N, C, area = z.shape
    keep = y.shape[0] > 0
    for c in range(lo, hi):
        scale = scale_shift[c, 0]
        shift = scale_shift[c, 1]
        for n in range(N):
            for i in range(area):
                v = np.float32(z[n, c, i] * scale + shift)
                if keep:
                    y[n, c, i] = v
                out[n, c, i] = _activate(v, act)


@njit(cache=True, nogil=True)
def _chunk_apply_over(z, scale_shift, act, out, lo, hi):
    """``_chunk_apply`` written over z: z = z·scale + shift and out = act(that) when ``out`` has images, else
    z = act(z·scale + shift).

    Why a kernel of its own. Given the same array as two arguments, a kernel's vectorized loop is guarded by a
    run-time check that they do not overlap, which then fails, and the scalar loop runs (the element-wise
    kernels' docstring has the first case): one 8-image chunk of ResNet-18's stem (8×64×112×112), y over z and
    out apart, 2.14 ms against 1.76 with three arrays; z over z, no activation, 1.45 against 0.99. Here the
    written array is the read one, one argument, and the compiler needs no check: the same arithmetic, the
    same bits."""
    N, C, area = z.shape
    separate = out.shape[0] > 0
    for c in range(lo, hi):
        scale = scale_shift[c, 0]
        shift = scale_shift[c, 1]
        for n in range(N):
            for i in range(area):
                v = np.float32(z[n, c, i] * scale + shift)
                if separate:
                    z[n, c, i] = v
                    out[n, c, i] = _activate(v, act)
                else:
                    z[n, c, i] = _activate(v, act)


@njit(cache=True, nogil=True, inline="always")
def _masked(d, v, act):
    """The activation's backward on the fly: ``d`` where the forward output's mask passes (from the batch norm
    output ``v``: ReLU v > 0, ReLU6 0 < v < 6, as relu_backward and relu6_backward), else 0."""
    if act == 1:
        return d if v > 0 else np.float32(0.0)
    if act == 2:
        return d if (v > 0 and v < 6) else np.float32(0.0)
    return d


@njit(cache=True, nogil=True, fastmath={"reassoc"})
def _gradient_sums_from(y, dout, c, b, inv_g, s1, s2, act):
    """``_channel_gradient_sums`` of dy = the activation's backward of ``dout``, continuing the given sums."""
    for n in range(y.shape[0]):
        g = dout[n, c]
        v = y[n, c]
        for i in range(y.shape[2]):
            d = np.float64(_masked(g[i], v[i], act))
            s1 += d
            s2 += d * ((v[i] - b) * inv_g)
    return s1, s2


@njit(cache=True, nogil=True)
def _chunk_gradient_sums(y, dout, gamma, beta, sums, first, act, lo, hi):
    for c in range(lo, hi):
        if first:
            sums[c, 0] = 0.0
            sums[c, 1] = 0.0
        ch = np.int64(c)
        g = np.float64(_safe_gamma(gamma[c]))
        s1, s2 = _gradient_sums_from(y, dout, ch, np.float64(beta[c]), 1.0 / g, sums[c, 0], sums[c, 1], act)
        sums[c, 0] = s1
        sums[c, 1] = s2


@njit(cache=True, nogil=True, inline="always")
def _dx_of(v, d, act, b, inv_g, k, mean_dy, mean_dy_xhat):
    xhat = (v - b) * inv_g
    return k * (_masked(d, v, act) - mean_dy - xhat * mean_dy_xhat)


@njit(cache=True, nogil=True)
def _chunk_dx(y, dout, gamma, beta, save_invstd, sums, count, act, dx, lo, hi):
    N, C, area = y.shape
    for c in range(lo, hi):
        g = np.float64(_safe_gamma(gamma[c]))
        b = np.float64(beta[c])
        k = g * np.float64(save_invstd[c])
        for n in range(N):
            for i in range(area):
                dx[n, c, i] = _dx_of(y[n, c, i], dout[n, c, i], act, b, 1.0 / g, k, sums[c, 0] / count,
                                     sums[c, 1] / count)


@njit(cache=True, nogil=True)
def _chunk_dx_over(y, dout, gamma, beta, save_invstd, sums, count, act, over_y, lo, hi):
    """``_chunk_dx`` written over y (``over_y``) or over dout: as ``_chunk_apply_over``, the written array is a read
    one, the same argument, and the loop keeps its vectors (dx over y, one stem-sized chunk: 3.52 ms through a
    separate argument, 1.25 here; apart, 1.40)."""
    N, C, area = y.shape
    for c in range(lo, hi):
        g = np.float64(_safe_gamma(gamma[c]))
        b = np.float64(beta[c])
        k = g * np.float64(save_invstd[c])
        for n in range(N):
            if over_y:
                for i in range(area):
                    y[n, c, i] = _dx_of(y[n, c, i], dout[n, c, i], act, b, 1.0 / g, k, sums[c, 0] / count,
                                        sums[c, 1] / count)
            else:
                for i in range(area):
                    dout[n, c, i] = _dx_of(y[n, c, i], dout[n, c, i], act, b, 1.0 / g, k, sums[c, 0] / count,
                                           sums[c, 1] / count)


_ACTIVATIONS = {None: 0, "relu": 1, "relu6": 2}


def _sums_array(op: str, sums: np.ndarray, C: int, width: int) -> None:
    if not isinstance(sums, np.ndarray) or sums.dtype != np.float64 or sums.shape != (C, width) \
            or not sums.flags.c_contiguous:
        raise ValueError(f"{op}: sums must be a C-contiguous float64 array of shape ({C}, {width})")


def batchnorm_chunk_statistics(x: np.ndarray, sums: np.ndarray, first: bool) -> None:
    """Carry the batch statistics over the images of ``x``: ``sums[c] = (K, Σ (x − K), Σ (x − K)²)`` in
    float64, K the channel's first value (set, with the sums reset, when ``first``). Calls over the
    batch's images in order give the bits of one call over the whole batch."""
    op = "batchnorm_chunk_statistics"
    N, C, area = _channels(op, x)
    _sums_array(op, sums, C, 3)
    x3 = x.reshape(N, C, area)
    _over_channels(_chunk_statistics, x3, x3, sums, bool(first))


def batchnorm_chunk_finish(sums: np.ndarray, count: int, gamma: np.ndarray, beta: np.ndarray,
                           running_mean: np.ndarray, running_var: np.ndarray, scale_shift: np.ndarray,
                           save_invstd: np.ndarray, momentum: float, eps: float) -> None:
    """From the carried sums of ``count`` values per channel: ``scale_shift[c] = (γ/σ, β − μγ/σ)`` (float64),
    1/σ into ``save_invstd``, the running statistics moved (unbiased variance), as ``batchnorm_forward_train``."""
    op = "batchnorm_chunk_finish"
    C = gamma.shape[0]
    _sums_array(op, sums, C, 3)
    _sums_array(op, scale_shift, C, 2)
    if int(count) < 2:
        raise ValueError(f"{op}: training needs more than one value per channel, got {count}")
    for name, array in [("gamma", gamma), ("beta", beta), ("running_mean", running_mean), ("running_var", running_var),
                        ("save_invstd", save_invstd)]:  # fmt: skip
        check_array(op, name, array, (C,))
    _chunk_finish(sums, int(count), gamma, beta, running_mean, running_var, scale_shift, save_invstd,
                  float(momentum), float(eps))


def batchnorm_chunk_apply(z: np.ndarray, scale_shift: np.ndarray, activation: str | None, y: np.ndarray | None,
                          out: np.ndarray) -> None:
    """y = z·scale + shift per channel (float64 arithmetic, as ``batchnorm_forward_train``), written to ``y``
    unless None, and ``out`` = activation(y) (None, "relu" or "relu6"); ``y`` and ``out`` may be ``z``."""
    op = "batchnorm_chunk_apply"
    N, C, area = _channels(op, z)
    _sums_array(op, scale_shift, C, 2)
    check_array(op, "out", out, z.shape)
    if y is not None:
        check_array(op, "y", y, z.shape)
    z3 = z.reshape(N, C, area)
    act = _ACTIVATIONS[activation]
    none = np.empty((0, C, area), np.float32)
    y_over, out_over = y is not None and same_memory(y, z), same_memory(out, z)
    if out_over and y is not None and (not y_over or activation is not None):
        raise ValueError(f"{op}: out may be z only when y is None or z with no activation (y would be lost)")
    if y_over or out_over:  # written over z: the kernel that keeps its vectors (_chunk_apply_over)
        _over_channels(_chunk_apply_over, z3, z3, scale_shift, act, none if out_over else out.reshape(N, C, area))
    else:
        y3 = none if y is None else y.reshape(N, C, area)
        _over_channels(_chunk_apply, z3, z3, scale_shift, act, y3, out.reshape(N, C, area))


def batchnorm_chunk_gradient_sums(y: np.ndarray, dy: np.ndarray, gamma: np.ndarray, beta: np.ndarray,
                                  sums: np.ndarray, first: bool, activation: str | None = None) -> None:
    """Carry (Σ dy, Σ dy·x̂) over the images of ``y`` (the forward's output, x̂ = (y − β)/γ) into ``sums``
    (C × 2 float64; reset when ``first``): calls in image order give the bits of one call. With ``activation``
    ("relu", "relu6"), ``dy`` is the gradient of the activation's output and its mask (from y) is applied on the
    fly: the bits of relu_backward / relu6_backward first, without writing their result."""
    op = "batchnorm_chunk_gradient_sums"
    N, C, area = _channels(op, y)
    check_array(op, "dy", dy, y.shape)
    _sums_array(op, sums, C, 2)
    for name, array in [("gamma", gamma), ("beta", beta)]:
        check_array(op, name, array, (C,))
    y3 = y.reshape(N, C, area)
    _over_channels(_chunk_gradient_sums, y3, y3, dy.reshape(N, C, area), gamma, beta, sums, bool(first),
                   _ACTIVATIONS[activation])


def batchnorm_chunk_dx(y: np.ndarray, dy: np.ndarray, gamma: np.ndarray, beta: np.ndarray, save_invstd: np.ndarray,
                       sums: np.ndarray, count: int, dx: np.ndarray, activation: str | None = None) -> None:
    """dx of the images of ``y`` from the finished gradient sums over ``count`` values per channel, with
    ``batchnorm_backward_from_output``'s arithmetic; ``dx`` may be ``dy``; ``activation`` as in
    ``batchnorm_chunk_gradient_sums`` (one pass over y and dy instead of the activation's and then this one)."""
    op = "batchnorm_chunk_dx"
    N, C, area = _channels(op, y)
    check_array(op, "dy", dy, y.shape)
    check_array(op, "dx", dx, y.shape)
    _sums_array(op, sums, C, 2)
    for name, array in [("gamma", gamma), ("beta", beta), ("save_invstd", save_invstd)]:
        check_array(op, name, array, (C,))
    y3 = y.reshape(N, C, area)
    args = (y3, dy.reshape(N, C, area), gamma, beta, save_invstd, sums, int(count), _ACTIVATIONS[activation])
    if same_memory(dx, y) or same_memory(dx, dy):  # written over a read array: _chunk_dx_over says why
        _over_channels(_chunk_dx_over, y3, *args, same_memory(dx, y))
    else:
        _over_channels(_chunk_dx, y3, *args, dx.reshape(N, C, area))

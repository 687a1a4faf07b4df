"""Dense CPU kernels: out = x @ w.T + bias, with the matrix products done by BLAS sgemm.

The products are one sgemm each through ``conv_shifted.gemm`` (SciPy's BLAS, the one the convolutions call, with
leading dimensions and transpose flags: ``w.T`` and ``doutᵀ`` are read in place, nothing is copied). A
hand-written loop cannot beat sgemm on these shapes; the kernels around it only add the bias and sum the bias
gradient. BLAS gives the same bits on every call with the same thread count.

Not ``np.dot`` inside ``@njit`` (three such kernels until 2026-11-28): ``conv_shifted.gemm`` says why. Dense layers
are the one place the engine lets BLAS thread a GEMM itself (no ``blas_on_calling_thread`` here).

The bias kernels are serial over a range of rows or columns, split over the threads by
``threads.run_ranges`` (a classifier head's 32×10 runs on the calling thread), not ``prange`` loops:
as ``parallel=True`` kernels they compiled in 0.44 and 0.33 s of every model's first run
(engine/warmup.py). The same bits: a column's sum is one thread's, in row order.
"""

from __future__ import annotations

import numpy as np
from numba import get_num_threads, njit

from kernels.cpu.checks import check_array
from kernels.cpu.conv_shifted import gemm
from kernels.cpu.threads import run_ranges


@njit(cache=True, nogil=True)
def _add_bias(out, bias, lo, hi):
    for n in range(lo, hi):
        for o in range(out.shape[1]):
            out[n, o] += bias[o]


@njit(cache=True, nogil=True)
def _sum_over_batch(dout, dbias, lo, hi):
    """dbias[o] = sum over n of dout[n, o] for o in [lo, hi): a column is one thread's, a float64 sum in row order."""
    N = dout.shape[0]
    for o in range(lo, hi):
        total = 0.0
        for n in range(N):
            total += dout[n, o]
        dbias[o] = total


def dense_forward(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None, out: np.ndarray) -> None:
    """out[N,O] = x[N,I] @ w[O,I].T (+ bias[O])."""
    op = "dense_forward"
    check_array(op, "x", x)
    check_array(op, "w", w)
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"{op}: x {x.shape} and w {w.shape} must be [N, I] and [O, I]")
    N, O = x.shape[0], w.shape[0]
    check_array(op, "out", out, (N, O))
    gemm(x, w, out, trans_b=True)  # [N,I] @ [O,I]ᵀ
    if bias is not None:
        check_array(op, "bias", bias, (O,))
        run_ranges(lambda lo, hi: _add_bias(out, bias, lo, hi), N, get_num_threads(), O)


def dense_backward(
    x: np.ndarray,
    w: np.ndarray,
    dout: np.ndarray,
    dx: np.ndarray | None,
    dw: np.ndarray,
    dbias: np.ndarray | None,
) -> None:
    """dx = dout @ w (skipped when None, e.g. for the first layer), dw = dout.T @ x, dbias = sum of dout."""
    op = "dense_backward"
    check_array(op, "x", x)
    check_array(op, "w", w)
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"{op}: x {x.shape} and w {w.shape} must be [N, I] and [O, I]")
    (N, I), O = x.shape, w.shape[0]
    check_array(op, "dout", dout, (N, O))
    check_array(op, "dw", dw, (O, I))
    if dx is not None:
        gemm(dout, w, check_array(op, "dx", dx, (N, I)))  # [N,O] @ [O,I]
    gemm(dout, x, dw, trans_a=True)  # dw[O,I] = doutᵀ[O,N] @ x[N,I]
    if dbias is not None:
        check_array(op, "dbias", dbias, (O,))
        run_ranges(lambda lo, hi: _sum_over_batch(dout, dbias, lo, hi), O, get_num_threads(), N)

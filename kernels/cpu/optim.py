"""Optimizer CPU kernels over flat (1-D) parameter arrays, in float32 as PyTorch computes them.

The engine keeps all parameters, gradients and optimizer state in single contiguous blocks, so
one pass, split over the threads (``threads.run_ranges``), updates the whole network. Each element's
update depends on that element only: the result is the same for any thread count. Hyper-parameters
are rounded to float32 once, so the arithmetic is float32 throughout, like torch.optim on float32
tensors.

Serial kernels over a range ``[lo, hi)`` with unsigned indices (as a ``prange`` gufunc's), not
``prange`` loops: a ``parallel=True`` kernel compiles several times longer on a cold cache (SGD's
0.55 s of the first run; engine/warmup.py has the figures).
"""

from __future__ import annotations

import math

import numpy as np
from numba import get_num_threads, njit, uint64

from kernels.cpu.checks import check_array
from kernels.cpu.threads import run_ranges


@njit(cache=True, nogil=True)
def _sgd(param, grad, momentum_buf, lr, momentum, weight_decay, nesterov, lo, hi):
    lr32, momentum32, decay32 = np.float32(lr), np.float32(momentum), np.float32(weight_decay)
    use_momentum = momentum != 0.0
    for i in range(uint64(lo), uint64(hi)):
        g = grad[i] + decay32 * param[i]
        if use_momentum:
            buf = momentum32 * momentum_buf[i] + g  # dampening 0; buf starts at 0, so step 1 gives buf = g
            momentum_buf[i] = buf
            g = g + momentum32 * buf if nesterov else buf
        param[i] -= lr32 * g


@njit(cache=True, nogil=True)
def _adam(param, grad, m, v, lr, beta1, beta2, eps, weight_decay, step, lo, hi):
    beta1_32, beta2_32, decay32, eps32 = np.float32(beta1), np.float32(beta2), np.float32(weight_decay), np.float32(eps)
    one_minus_beta1 = np.float32(1.0 - beta1)
    one_minus_beta2 = np.float32(1.0 - beta2)
    step_size = np.float32(lr / (1.0 - beta1**step))
    bias_correction2_sqrt = np.float32(math.sqrt(1.0 - beta2**step))
    for i in range(uint64(lo), uint64(hi)):
        g = grad[i] + decay32 * param[i]
        m_i = beta1_32 * m[i] + one_minus_beta1 * g
        v_i = beta2_32 * v[i] + one_minus_beta2 * g * g
        m[i] = m_i
        v[i] = v_i
        denom = np.sqrt(v_i) / bias_correction2_sqrt + eps32
        param[i] -= step_size * (m_i / denom)


def _over_threads(kernel, items: int, *args) -> None:
    """``kernel(*args, lo, hi)`` over the threads' ranges of ``[0, items)``."""
    run_ranges(lambda lo, hi: kernel(*args, lo, hi), items, get_num_threads())


def _check_flat(op: str, names_arrays: list[tuple[str, np.ndarray]]) -> None:
    size = names_arrays[0][1].size
    for name, array in names_arrays:
        check_array(op, name, array, (size,))


def sgd_update(
    param: np.ndarray,
    grad: np.ndarray,
    momentum_buf: np.ndarray,
    lr: float,
    momentum: float,
    weight_decay: float,
    nesterov: bool,
) -> None:
    """torch.optim.SGD's step with dampening 0, on flat arrays; updates param and momentum_buf."""
    _check_flat("sgd_update", [("param", param), ("grad", grad), ("momentum_buf", momentum_buf)])
    if nesterov and momentum == 0:
        raise ValueError("sgd_update: nesterov needs a momentum > 0 (as in PyTorch)")
    _over_threads(_sgd, param.size, param, grad, momentum_buf, float(lr), float(momentum), float(weight_decay),
                  bool(nesterov))


def adam_update(
    param: np.ndarray,
    grad: np.ndarray,
    m: np.ndarray,
    v: np.ndarray,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
) -> None:
    """torch.optim.Adam's step (L2 weight decay, bias correction) on flat arrays; ``step`` counts from 1."""
    _check_flat("adam_update", [("param", param), ("grad", grad), ("m", m), ("v", v)])
    if step < 1:
        raise ValueError(f"adam_update: step counts from 1 (the first update), got {step}")
    _over_threads(_adam, param.size, param, grad, m, v, float(lr), float(beta1), float(beta2), float(eps),
                  float(weight_decay), int(step))

"""Optimizer CPU kernels over flat (1-D) parameter arrays, in float32 as PyTorch computes them.

The engine keeps all parameters, gradients and optimizer state in single contiguous blocks, so
one ``prange`` pass updates the whole network. Each element's update depends on that element only:
the result is the same for any thread count. Hyper-parameters are rounded to float32 once, so the
arithmetic is float32 throughout, like torch.optim on float32 tensors.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from kernels.cpu.checks import check_array


@njit(cache=True, parallel=True, nogil=True)
def _sgd(param, grad, momentum_buf, lr, momentum, weight_decay, nesterov):
    lr32, momentum32, decay32 = np.float32(lr), np.float32(momentum), np.float32(weight_decay)
    use_momentum = momentum != 0.0
    for i in prange(param.size):
        g = grad[i] + decay32 * param[i]
        if use_momentum:
            buf = momentum32 * momentum_buf[i] + g  # dampening 0; buf starts at 0, so step 1 gives buf = g
            momentum_buf[i] = buf
            g = g + momentum32 * buf if nesterov else buf
        param[i] -= lr32 * g


@njit(cache=True, parallel=True, nogil=True)
def _adam(param, grad, m, v, lr, beta1, beta2, eps, weight_decay, step):
    beta1_32, beta2_32, decay32, eps32 = np.float32(beta1), np.float32(beta2), np.float32(weight_decay), np.float32(eps)
    one_minus_beta1 = np.float32(1.0 - beta1)
    one_minus_beta2 = np.float32(1.0 - beta2)
    step_size = np.float32(lr / (1.0 - beta1**step))
    bias_correction2_sqrt = np.float32(math.sqrt(1.0 - beta2**step))
    for i in prange(param.size):
        g = grad[i] + decay32 * param[i]
        m_i = beta1_32 * m[i] + one_minus_beta1 * g
        v_i = beta2_32 * v[i] + one_minus_beta2 * g * g
        m[i] = m_i
        v[i] = v_i
        denom = np.sqrt(v_i) / bias_correction2_sqrt + eps32
        param[i] -= step_size * (m_i / denom)


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
    _sgd(param, grad, momentum_buf, float(lr), float(momentum), float(weight_decay), bool(nesterov))


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
    _adam(param, grad, m, v, float(lr), float(beta1), float(beta2), float(eps), float(weight_decay), int(step))

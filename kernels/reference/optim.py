"""Optimizer updates in plain NumPy over flat (1-D) parameter arrays, with PyTorch's semantics.

Both take the step's hyper-parameters as numbers and update ``param`` and their state in place.
"""

from __future__ import annotations

import numpy as np


def sgd_update(
    param: np.ndarray,
    grad: np.ndarray,
    momentum_buf: np.ndarray,
    lr: float,
    momentum: float,
    weight_decay: float,
    nesterov: bool,
) -> None:
    """torch.optim.SGD with dampening 0.

    g = grad + weight_decay * param; buf = momentum * buf + g (buf starts at zero, so the first step
    sets buf = g, as PyTorch does); the step uses g + momentum * buf with nesterov, else buf.
    """
    g = grad + weight_decay * param
    if momentum != 0:
        momentum_buf[...] = momentum * momentum_buf + g
        g = g + momentum * momentum_buf if nesterov else momentum_buf
    param -= lr * g


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
    """torch.optim.Adam (L2 weight decay added to the gradient, not AdamW); ``step`` counts from 1.

    m and v are running averages of g and g*g; dividing by (1 - beta**step) removes their bias
    towards the zero they start from.
    """
    g = grad + weight_decay * param
    m[...] = beta1 * m + (1 - beta1) * g
    v[...] = beta2 * v + (1 - beta2) * g * g
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    denom = np.sqrt(v) / np.sqrt(bias_correction2) + eps
    param -= (lr / bias_correction1) * m / denom

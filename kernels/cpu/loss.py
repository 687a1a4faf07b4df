"""Softmax cross-entropy CPU kernels, fused and numerically stable, averaged over the batch.

The forward computes each row's maximum, the sum of exp(logit - max) in float64, the probabilities
and the row's loss logsumexp - logit[label] in one sweep. Rows run in order in one thread: the
batch is small (N x classes), and a fixed order keeps the loss's bits the same on every run.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from kernels.cpu.checks import check_array


@njit(cache=True, nogil=True)
def _forward(logits, labels, probs, loss):
    N, C = logits.shape
    total_loss = 0.0
    for n in range(N):
        row_max = np.float64(logits[n, 0])
        for c in range(1, C):
            row_max = max(row_max, np.float64(logits[n, c]))
        sum_exp = 0.0
        for c in range(C):
            sum_exp += math.exp(logits[n, c] - row_max)  # float64: every exponent <= 0, so no overflow
        for c in range(C):
            probs[n, c] = math.exp(logits[n, c] - row_max) / sum_exp
        total_loss += math.log(sum_exp) - (logits[n, labels[n]] - row_max)
    loss[0] = total_loss / N


@njit(cache=True, nogil=True)
def _backward(probs, labels, dlogits):
    N, C = probs.shape
    inv_n = np.float32(1.0 / N)
    for n in range(N):
        for c in range(C):
            dlogits[n, c] = probs[n, c] * inv_n
        dlogits[n, labels[n]] = (probs[n, labels[n]] - np.float32(1.0)) * inv_n


def _check_labels(op: str, labels: np.ndarray, N: int, C: int) -> None:
    check_array(op, "labels", labels, (N,), np.int64)
    if N and (labels.min() < 0 or labels.max() >= C):
        raise ValueError(f"{op}: labels must lie in [0, {C}), got values from {labels.min()} to {labels.max()}")


def softmax_xent_forward(logits: np.ndarray, labels: np.ndarray, probs: np.ndarray, loss: np.ndarray) -> None:
    """probs[N,C] = softmax(logits); loss[0] = mean over rows of -log probs[label] (computed stably)."""
    op = "softmax_xent_forward"
    check_array(op, "logits", logits)
    if logits.ndim != 2 or logits.shape[0] == 0:
        raise ValueError(f"{op}: logits must be [N, classes] with N >= 1, got shape {logits.shape}")
    N, C = logits.shape
    _check_labels(op, labels, N, C)
    check_array(op, "probs", probs, (N, C))
    check_array(op, "loss", loss, (1,))
    _forward(logits, labels, probs, loss)


def softmax_xent_backward(probs: np.ndarray, labels: np.ndarray, dlogits: np.ndarray) -> None:
    """dlogits = (probs - onehot(labels)) / N."""
    op = "softmax_xent_backward"
    check_array(op, "probs", probs)
    if probs.ndim != 2 or probs.shape[0] == 0:
        raise ValueError(f"{op}: probs must be [N, classes] with N >= 1, got shape {probs.shape}")
    N, C = probs.shape
    _check_labels(op, labels, N, C)
    check_array(op, "dlogits", dlogits, (N, C))
    _backward(probs, labels, dlogits)

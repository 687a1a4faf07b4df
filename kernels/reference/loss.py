"""Softmax cross-entropy in plain NumPy, fused and numerically stable, averaged over the batch.

Stability: subtracting each row's maximum before exp() keeps exp() <= 1, and the loss is taken as
logsumexp(logits) - logit[label] instead of -log(probs[label]), which stays finite when the
probability of the right class underflows to zero.
"""

from __future__ import annotations

import numpy as np


def softmax_xent_forward(logits: np.ndarray, labels: np.ndarray, probs: np.ndarray, loss: np.ndarray) -> None:
    """probs[N,C] = softmax(logits); loss[0] = mean over rows of -log softmax(logits)[label]."""
    N = logits.shape[0]
    z = logits.astype(np.float64)
    shifted = z - z.max(axis=1, keepdims=True)
    exp = np.exp(shifted)
    total = exp.sum(axis=1, keepdims=True)
    probs[...] = exp / total
    log_probs_of_label = shifted[np.arange(N), labels] - np.log(total[:, 0])
    loss[0] = -log_probs_of_label.mean()


def softmax_xent_backward(probs: np.ndarray, labels: np.ndarray, dlogits: np.ndarray) -> None:
    """dlogits = (probs - onehot(labels)) / N: the gradient of the batch-mean loss."""
    N = probs.shape[0]
    dlogits[...] = probs
    dlogits[np.arange(N), labels] -= 1
    dlogits /= N

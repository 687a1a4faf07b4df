"""The CUDA softmax cross-entropy against the NumPy reference, simulated."""

from __future__ import annotations

import numpy as np
import pytest

from kernels.cuda import loss
from kernels.reference import loss as ref
from tests.kernels.cuda.conftest import assert_close

pytestmark = pytest.mark.cudasim


@pytest.mark.parametrize("N, C", [(5, 4), (1, 3)])
def test_softmax_xent_matches_reference(N, C):
    rng = np.random.default_rng(N)
    logits = (rng.standard_normal((N, C)) * 3).astype(np.float32)
    logits[0, 0] = 80.0  # large logits: the max-shift keeps exp() finite
    labels = rng.integers(0, C, N).astype(np.int64)
    probs, value = np.full((N, C), np.nan, np.float32), np.full(1, np.nan, np.float32)
    loss.softmax_xent_forward(logits, labels, probs, value)
    expected_probs, expected_value = np.empty_like(probs), np.empty(1, np.float32)
    ref.softmax_xent_forward(logits, labels, expected_probs, expected_value)
    assert_close(probs, expected_probs)
    assert_close(value, expected_value)

    dlogits, expected_dlogits = np.full_like(probs, np.nan), np.empty_like(probs)
    loss.softmax_xent_backward(probs, labels, dlogits)
    ref.softmax_xent_backward(expected_probs, labels, expected_dlogits)
    assert_close(dlogits, expected_dlogits)


def test_label_out_of_range_gives_nan_loss():
    logits = np.zeros((2, 3), np.float32)
    probs, value = np.empty((2, 3), np.float32), np.zeros(1, np.float32)
    loss.softmax_xent_forward(logits, np.array([0, 3], np.int64), probs, value)
    assert np.isnan(value[0])

import numpy as np
import pytest

from kernels.reference import loss as xent


@pytest.mark.parametrize("N,C", [(1, 3), (5, 7)])
def test_softmax_xent_gradient_matches_finite_differences(N, C, rng, numerical_gradient):
    logits = rng.standard_normal((N, C)) * 3
    labels = rng.integers(0, C, N)
    probs, value = np.empty((N, C)), np.empty(1)

    def loss():
        xent.softmax_xent_forward(logits, labels, probs, value)
        return float(value[0])

    loss()
    expected = -np.mean(np.log(np.exp(logits) / np.exp(logits).sum(1, keepdims=True))[np.arange(N), labels])
    np.testing.assert_allclose(value[0], expected)
    np.testing.assert_allclose(probs.sum(axis=1), 1)
    dlogits = np.empty_like(logits)
    xent.softmax_xent_backward(probs, labels, dlogits)
    np.testing.assert_allclose(dlogits, numerical_gradient(loss, logits), rtol=1e-6, atol=1e-8)


def test_softmax_xent_is_stable_for_huge_logits():
    logits = np.array([[1000.0, 0.0, -1000.0]], dtype=np.float32)
    probs, value = np.empty_like(logits), np.empty(1, dtype=np.float32)
    xent.softmax_xent_forward(logits, np.array([2]), probs, value)
    assert np.isfinite(probs).all() and value[0] == pytest.approx(2000.0)

import numpy as np
import pytest

from kernels.cpu import loss as xent
from kernels.reference import loss as reference

torch = pytest.importorskip("torch")
F = torch.nn.functional


@pytest.mark.parametrize("N,C", [(1, 2), (7, 10), (32, 100)])
def test_softmax_xent_matches_reference_and_torch(N, C, rng):
    logits = (rng.standard_normal((N, C)) * 4).astype(np.float32)
    labels = rng.integers(0, C, N).astype(np.int64)
    probs, value = np.empty_like(logits), np.empty(1, np.float32)
    xent.softmax_xent_forward(logits, labels, probs, value)
    expected_probs, expected_value = np.empty_like(logits), np.empty(1, np.float32)
    reference.softmax_xent_forward(logits, labels, expected_probs, expected_value)
    np.testing.assert_allclose(probs, expected_probs, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(value, expected_value, rtol=1e-6)
    dlogits, expected_dlogits = np.empty_like(logits), np.empty_like(logits)
    xent.softmax_xent_backward(probs, labels, dlogits)
    reference.softmax_xent_backward(expected_probs, labels, expected_dlogits)
    np.testing.assert_allclose(dlogits, expected_dlogits, rtol=1e-6, atol=1e-8)

    t_logits = torch.tensor(logits, requires_grad=True)
    t_loss = F.cross_entropy(t_logits, torch.tensor(labels))
    t_loss.backward()
    np.testing.assert_allclose(value[0], t_loss.item(), rtol=1e-5)
    np.testing.assert_allclose(dlogits, t_logits.grad.numpy(), rtol=1e-5, atol=1e-7)


def test_softmax_xent_is_stable_for_huge_logits():
    logits = np.array([[1e4, 0.0, -1e4], [-1e4, -1e4, -1e4]], dtype=np.float32)
    labels = np.array([2, 0])
    probs, value = np.empty_like(logits), np.empty(1, np.float32)
    xent.softmax_xent_forward(logits, labels, probs, value)
    assert np.isfinite(probs).all()
    np.testing.assert_allclose(value[0], (2e4 + np.log(3)) / 2, rtol=1e-6)


def test_softmax_xent_names_bad_labels():
    logits = np.zeros((2, 3), np.float32)
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 3\)"):
        xent.softmax_xent_forward(logits, np.array([0, 3]), np.empty_like(logits), np.empty(1, np.float32))
    with pytest.raises(TypeError, match="labels must be int64"):
        xent.softmax_xent_backward(logits, np.array([0, 1], np.int32), np.empty_like(logits))

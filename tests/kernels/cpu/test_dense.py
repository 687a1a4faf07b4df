import numpy as np
import pytest

from kernels.cpu import dense
from kernels.reference import dense as reference

torch = pytest.importorskip("torch")
F = torch.nn.functional

SHAPES = [(1, 5, 3), (7, 13, 10), (32, 64, 9)]


def inputs(rng, N, I, O):
    x = rng.standard_normal((N, I)).astype(np.float32)
    w = rng.standard_normal((O, I)).astype(np.float32)
    b = rng.standard_normal(O).astype(np.float32)
    dout = rng.standard_normal((N, O)).astype(np.float32)
    return x, w, b, dout


@pytest.mark.parametrize("N,I,O", SHAPES)
@pytest.mark.parametrize("with_bias", [True, False])
def test_dense_matches_reference(N, I, O, with_bias, rng):
    x, w, b, dout = inputs(rng, N, I, O)
    b = b if with_bias else None
    out, expected = np.empty((N, O), np.float32), np.empty((N, O), np.float32)
    dense.dense_forward(x, w, b, out)
    reference.dense_forward(x, w, b, expected)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    grads = [np.empty_like(x), np.empty_like(w), None if b is None else np.empty_like(b)]
    expected_grads = [np.empty_like(x), np.empty_like(w), None if b is None else np.empty_like(b)]
    dense.dense_backward(x, w, dout, *grads)
    reference.dense_backward(x, w, dout, *expected_grads)
    for got, want in zip(grads, expected_grads):
        if want is not None:
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("N,I,O", SHAPES)
def test_dense_matches_torch(N, I, O, rng):
    x, w, b, dout = inputs(rng, N, I, O)
    tx, tw, tb = (torch.tensor(a, requires_grad=True) for a in (x, w, b))
    expected = F.linear(tx, tw, tb)
    expected.backward(torch.tensor(dout))
    out = np.empty((N, O), np.float32)
    dense.dense_forward(x, w, b, out)
    np.testing.assert_allclose(out, expected.detach().numpy(), rtol=1e-5, atol=1e-4)
    dx, dw, db = np.empty_like(x), np.empty_like(w), np.empty_like(b)
    dense.dense_backward(x, w, dout, dx, dw, db)
    np.testing.assert_allclose(dx, tx.grad.numpy(), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(dw, tw.grad.numpy(), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(db, tb.grad.numpy(), rtol=1e-5, atol=1e-4)


def test_dense_backward_without_dx(rng):
    x, w, b, dout = inputs(rng, 3, 4, 2)
    dw, expected = np.empty_like(w), np.empty_like(w)
    dense.dense_backward(x, w, dout, None, dw, None)
    reference.dense_backward(x, w, dout, None, expected, None)
    np.testing.assert_allclose(dw, expected, rtol=1e-5, atol=1e-5)


def test_dense_gradients_are_deterministic(rng):
    x, w, b, dout = inputs(rng, 64, 300, 70)
    first = [np.empty_like(x), np.empty_like(w), np.empty_like(b)]
    second = [np.empty_like(x), np.empty_like(w), np.empty_like(b)]
    dense.dense_backward(x, w, dout, *first)
    dense.dense_backward(x, w, dout, *second)
    for a, b2 in zip(first, second):
        assert a.tobytes() == b2.tobytes()


def test_dense_names_a_shape_mismatch():
    x, w = np.zeros((2, 3), np.float32), np.zeros((4, 5), np.float32)
    with pytest.raises(ValueError, match=r"dense_forward: x \(2, 3\) and w \(4, 5\)"):
        dense.dense_forward(x, w, None, np.zeros((2, 4), np.float32))
    with pytest.raises(ValueError, match="dense_forward: out has shape"):
        dense.dense_forward(x, np.zeros((4, 3), np.float32), None, np.zeros((4, 2), np.float32))

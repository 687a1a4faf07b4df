import numpy as np
import pytest

from kernels.reference import dense


@pytest.mark.parametrize("N,I,O", [(1, 3, 2), (4, 5, 3)])
def test_dense_gradients_match_finite_differences(N, I, O, rng, numerical_gradient):
    x, w, b = rng.standard_normal((N, I)), rng.standard_normal((O, I)), rng.standard_normal(O)
    dout = rng.standard_normal((N, O))
    out = np.empty((N, O))

    def loss():
        dense.dense_forward(x, w, b, out)
        return float((out * dout).sum())

    dx, dw, db = np.empty_like(x), np.empty_like(w), np.empty_like(b)
    dense.dense_backward(x, w, dout, dx, dw, db)
    np.testing.assert_allclose(dx, numerical_gradient(loss, x), rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(dw, numerical_gradient(loss, w), rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(db, numerical_gradient(loss, b), rtol=1e-6, atol=1e-8)


def test_dense_without_bias_and_without_dx(rng):
    x, w = rng.standard_normal((3, 4)), rng.standard_normal((2, 4))
    out = np.empty((3, 2))
    dense.dense_forward(x, w, None, out)
    np.testing.assert_allclose(out, x @ w.T)
    dw = np.empty_like(w)
    dense.dense_backward(x, w, np.ones((3, 2)), None, dw, None)
    np.testing.assert_allclose(dw, np.ones((2, 3)) @ x)

import numpy as np
import pytest

from kernels.reference import batchnorm


@pytest.mark.parametrize("shape", [(2, 3, 2, 3), (1, 2, 3, 1)])
def test_batchnorm_gradients_match_finite_differences(shape, rng, numerical_gradient):
    C = shape[1]
    x = rng.standard_normal(shape)
    gamma, beta = rng.standard_normal(C), rng.standard_normal(C)
    dout = rng.standard_normal(shape)
    out = np.empty(shape)
    mean, invstd = np.empty(C), np.empty(C)

    def loss():
        running_mean, running_var = np.zeros(C), np.ones(C)  # updated in place; fresh each call
        batchnorm.batchnorm_forward_train(x, gamma, beta, running_mean, running_var, out, mean, invstd, 0.1, 1e-5)
        return float((out * dout).sum())

    loss()
    dx, dgamma, dbeta = np.empty(shape), np.empty(C), np.empty(C)
    batchnorm.batchnorm_backward(x, dout, gamma, mean, invstd, dx, dgamma, dbeta)
    np.testing.assert_allclose(dx, numerical_gradient(loss, x), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(dgamma, numerical_gradient(loss, gamma), rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(dbeta, numerical_gradient(loss, beta), rtol=1e-6, atol=1e-8)


def test_running_statistics_use_the_unbiased_variance(rng):
    x = rng.standard_normal((4, 2, 3, 3))
    C, count = 2, 4 * 3 * 3
    running_mean, running_var = np.full(C, 0.5), np.full(C, 2.0)
    out, mean, invstd = np.empty_like(x), np.empty(C), np.empty(C)
    batchnorm.batchnorm_forward_train(
        x, np.ones(C), np.zeros(C), running_mean, running_var, out, mean, invstd, 0.1, 1e-5
    )
    batch_mean = x.mean(axis=(0, 2, 3))
    batch_var = x.var(axis=(0, 2, 3))
    np.testing.assert_allclose(mean, batch_mean)
    np.testing.assert_allclose(invstd, 1 / np.sqrt(batch_var + 1e-5))
    np.testing.assert_allclose(running_mean, 0.9 * 0.5 + 0.1 * batch_mean)
    np.testing.assert_allclose(running_var, 0.9 * 2.0 + 0.1 * batch_var * count / (count - 1))


def test_inference_uses_running_statistics(rng):
    x = rng.standard_normal((2, 3, 2, 2))
    gamma, beta = rng.standard_normal(3), rng.standard_normal(3)
    running_mean, running_var = rng.standard_normal(3), rng.uniform(0.5, 2, 3)
    out = np.empty_like(x)
    batchnorm.batchnorm_forward_infer(x, gamma, beta, running_mean, running_var, out, 1e-5)
    c = (slice(None), None, None)
    expected = (x - running_mean[c]) / np.sqrt(running_var[c] + 1e-5) * gamma[c] + beta[c]
    np.testing.assert_allclose(out, expected)

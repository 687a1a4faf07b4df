import numpy as np
import pytest

from kernels.reference import pool


@pytest.mark.parametrize(
    "shape,kernel,stride,pad", [((1, 2, 5, 5), 3, 2, 1), ((2, 1, 4, 6), 2, 2, 0), ((1, 1, 5, 4), 3, 1, 1)]
)
def test_maxpool_gradient_matches_finite_differences(shape, kernel, stride, pad, rng, numerical_gradient):
    x = rng.permutation(np.arange(np.prod(shape), dtype=np.float64)).reshape(shape) * 0.1  # no ties
    OH, OW = (pool.pool_output_size(s, kernel, stride, pad) for s in shape[2:])
    out = np.empty(shape[:2] + (OH, OW))
    argmax = np.empty(out.shape, dtype=np.int32)
    dout = rng.standard_normal(out.shape)

    def loss():
        pool.maxpool2d_forward(x, out, argmax, kernel, stride, pad)
        return float((out * dout).sum())

    loss()
    np.testing.assert_array_equal(
        out,
        np.take_along_axis(x.reshape(shape[0], shape[1], -1), argmax.reshape(shape[0], shape[1], -1), axis=2).reshape(
            out.shape
        ),
    )
    dx = np.empty_like(x)
    pool.maxpool2d_backward(dout, argmax, dx)
    np.testing.assert_allclose(dx, numerical_gradient(loss, x), rtol=1e-6, atol=1e-8)


def test_maxpool_takes_the_first_of_equal_maxima():
    x = np.ones((1, 1, 2, 2))
    out, argmax = np.empty((1, 1, 1, 1)), np.empty((1, 1, 1, 1), dtype=np.int32)
    pool.maxpool2d_forward(x, out, argmax, 2, 2, 0)
    assert argmax[0, 0, 0, 0] == 0


@pytest.mark.parametrize("shape,kernel,stride,pad", [((1, 2, 5, 5), 3, 2, 1), ((2, 1, 4, 6), 2, 2, 0)])
def test_avgpool_gradient_matches_finite_differences(shape, kernel, stride, pad, rng, numerical_gradient):
    x = rng.standard_normal(shape)
    OH, OW = (pool.pool_output_size(s, kernel, stride, pad) for s in shape[2:])
    out = np.empty(shape[:2] + (OH, OW))
    dout = rng.standard_normal(out.shape)

    def loss():
        pool.avgpool2d_forward(x, out, kernel, stride, pad)
        return float((out * dout).sum())

    dx = np.empty_like(x)
    pool.avgpool2d_backward(dout, dx, kernel, stride, pad)
    np.testing.assert_allclose(dx, numerical_gradient(loss, x), rtol=1e-6, atol=1e-8)


def test_avgpool_counts_padding_as_zeros():
    x = np.ones((1, 1, 2, 2))
    out = np.empty((1, 1, 2, 2))
    pool.avgpool2d_forward(x, out, 3, 1, 1)
    np.testing.assert_allclose(out, np.full((1, 1, 2, 2), 4 / 9))


def test_global_avgpool_gradient_matches_finite_differences(rng, numerical_gradient):
    x = rng.standard_normal((2, 3, 3, 2))
    out = np.empty((2, 3))
    dout = rng.standard_normal(out.shape)

    def loss():
        pool.global_avgpool_forward(x, out)
        return float((out * dout).sum())

    loss()
    np.testing.assert_allclose(out, x.mean(axis=(2, 3)))
    dx = np.empty_like(x)
    pool.global_avgpool_backward(dout, dx)
    np.testing.assert_allclose(dx, numerical_gradient(loss, x), rtol=1e-6, atol=1e-8)

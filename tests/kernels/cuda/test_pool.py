"""The CUDA pooling kernels against the NumPy reference, simulated."""

from __future__ import annotations

import numpy as np
import pytest

from kernels.cuda import pool
from kernels.reference import pool as ref
from tests.kernels.cuda.conftest import assert_close

pytestmark = pytest.mark.cudasim

# (input shape, kernel, stride, pad): overlapping windows with padding, non-overlapping, odd sizes.
CASES = [((1, 2, 5, 5), 3, 2, 1), ((2, 2, 4, 6), 2, 2, 0), ((1, 1, 5, 4), 3, 1, 1)]


def _out_shape(shape, kernel, stride, pad):
    N, C, H, W = shape
    return (N, C, ref.pool_output_size(H, kernel, stride, pad), ref.pool_output_size(W, kernel, stride, pad))


@pytest.mark.parametrize("shape, kernel, stride, pad", CASES)
def test_maxpool_matches_reference(shape, kernel, stride, pad):
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape).astype(np.float32)
    x[0, 0, 0, :2] = 5.0  # a tie: the first maximum in row-major order wins, as in PyTorch
    out_shape = _out_shape(shape, kernel, stride, pad)
    dout = rng.standard_normal(out_shape).astype(np.float32)
    out, argmax = np.full(out_shape, np.nan, np.float32), np.full(out_shape, -7, np.int32)
    pool.maxpool2d_forward(x, out, argmax, kernel, stride, pad)
    expected, expected_argmax = np.empty_like(out), np.empty_like(argmax)
    ref.maxpool2d_forward(x, expected, expected_argmax, kernel, stride, pad)
    np.testing.assert_array_equal(out, expected)
    np.testing.assert_array_equal(argmax, expected_argmax)
    dx, expected_dx = np.full_like(x, np.nan), np.empty_like(x)  # NaN: the kernel must zero dx itself
    pool.maxpool2d_backward(dout, argmax, dx)
    ref.maxpool2d_backward(dout, expected_argmax, expected_dx)
    assert_close(dx, expected_dx)

    out8, argmax8, dx8 = np.full_like(out, np.nan), np.full(out_shape, 255, np.uint8), np.full_like(x, np.nan)
    pool.maxpool2d_forward(x, out8, argmax8, kernel, stride, pad)  # the place in the window, as the reference
    expected8 = np.empty_like(argmax8)
    ref.maxpool2d_forward(x, np.empty_like(out), expected8, kernel, stride, pad)
    np.testing.assert_array_equal(argmax8, expected8)
    np.testing.assert_array_equal(out8, expected)
    pool.maxpool2d_backward(dout, argmax8, dx8, kernel, stride, pad)
    np.testing.assert_array_equal(dx8, dx)


@pytest.mark.parametrize("shape, kernel, stride, pad", CASES)
def test_avgpool_matches_reference(shape, kernel, stride, pad):
    rng = np.random.default_rng(1)
    x = rng.standard_normal(shape).astype(np.float32)
    out_shape = _out_shape(shape, kernel, stride, pad)
    dout = rng.standard_normal(out_shape).astype(np.float32)
    out, expected = np.full(out_shape, np.nan, np.float32), np.empty(out_shape, np.float32)
    pool.avgpool2d_forward(x, out, kernel, stride, pad)
    ref.avgpool2d_forward(x, expected, kernel, stride, pad)
    assert_close(out, expected)
    dx, expected_dx = np.full_like(x, np.nan), np.empty_like(x)
    pool.avgpool2d_backward(dout, dx, kernel, stride, pad)
    ref.avgpool2d_backward(dout, expected_dx, kernel, stride, pad)
    assert_close(dx, expected_dx)


def test_global_avgpool_matches_reference():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 3, 4, 5)).astype(np.float32)
    dout = rng.standard_normal((2, 3)).astype(np.float32)
    out, expected = np.full((2, 3), np.nan, np.float32), np.empty((2, 3), np.float32)
    pool.global_avgpool_forward(x, out)
    ref.global_avgpool_forward(x, expected)
    assert_close(out, expected)
    dx, expected_dx = np.full_like(x, np.nan), np.empty_like(x)
    pool.global_avgpool_backward(dout, dx)
    ref.global_avgpool_backward(dout, expected_dx)
    assert_close(dx, expected_dx)


def test_wrong_output_shape_is_a_clear_error():
    x = np.zeros((1, 1, 5, 5), np.float32)
    with pytest.raises(ValueError, match="expected"):
        pool.avgpool2d_forward(x, np.zeros((1, 1, 2, 2), np.float32), 3, 2, 1)

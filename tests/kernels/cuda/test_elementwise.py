"""The CUDA element-wise kernels against the NumPy reference, simulated (exact: no rounding choices)."""

from __future__ import annotations

import numpy as np
import pytest

from kernels.cuda import elementwise
from kernels.reference import elementwise as ref

pytestmark = pytest.mark.cudasim

SHAPES = [(7, 3), (2, 3, 5, 5)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", ["relu", "relu6"])
def test_activation_matches_reference(name, shape):
    rng = np.random.default_rng(0)
    x = rng.uniform(-4, 10, size=shape).astype(np.float32)
    x.reshape(-1)[:2] = [0.0, 6.0]  # the kinks: gradient 0 there, as in PyTorch
    dout = rng.standard_normal(shape).astype(np.float32)
    out, expected = np.full_like(x, np.nan), np.empty_like(x)
    getattr(elementwise, f"{name}_forward")(x, out)
    getattr(ref, f"{name}_forward")(x, expected)
    np.testing.assert_array_equal(out, expected)
    dx, expected_dx = np.full_like(x, np.nan), np.empty_like(x)
    getattr(elementwise, f"{name}_backward")(out, dout, dx)
    getattr(ref, f"{name}_backward")(expected, dout, expected_dx)
    np.testing.assert_array_equal(dx, expected_dx)


def test_leaky_relu_matches_reference():
    rng = np.random.default_rng(3)
    x = rng.uniform(-4, 4, size=(2, 3, 5, 5)).astype(np.float32)
    x.reshape(-1)[0] = 0.0
    dout = rng.standard_normal(x.shape).astype(np.float32)
    out, expected = np.full_like(x, np.nan), np.empty_like(x)
    elementwise.leaky_relu_forward(x, out, 0.1)
    ref.leaky_relu_forward(x, expected, 0.1)
    np.testing.assert_array_equal(out, expected)
    dx, expected_dx = np.full_like(x, np.nan), np.empty_like(x)
    elementwise.leaky_relu_backward(out, dout, dx, 0.1)
    ref.leaky_relu_backward(expected, dout, expected_dx, 0.1)
    np.testing.assert_array_equal(dx, expected_dx)


def test_relu_in_place_and_backward_into_dout():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 5)).astype(np.float32)
    expected = np.maximum(x, 0)
    elementwise.relu_forward(x, x)
    np.testing.assert_array_equal(x, expected)
    dout = rng.standard_normal((4, 5)).astype(np.float32)
    expected_dx = np.where(x > 0, dout, 0).astype(np.float32)
    elementwise.relu_backward(x, dout, dout)
    np.testing.assert_array_equal(dout, expected_dx)


def test_add_and_dropout_match_reference():
    rng = np.random.default_rng(2)
    a = rng.standard_normal((2, 3, 4, 4)).astype(np.float32)
    b = rng.standard_normal((2, 3, 4, 4)).astype(np.float32)
    out, expected = np.full_like(a, np.nan), np.empty_like(a)
    elementwise.add_forward(a, b, out)
    ref.add_forward(a, b, expected)
    np.testing.assert_array_equal(out, expected)

    mask = (rng.uniform(size=a.shape) > 0.3).astype(np.uint8)
    scale = 1 / 0.7
    for name in ("dropout_forward", "dropout_backward"):
        out, expected = np.full_like(a, np.nan), np.empty_like(a)
        getattr(elementwise, name)(a, mask, scale, out)
        getattr(ref, name)(a, mask, np.float32(scale), expected)
        np.testing.assert_allclose(out, expected, rtol=1e-6)


def test_shape_mismatch_is_a_clear_error():
    with pytest.raises(ValueError, match="must all be equal"):
        elementwise.add_forward(np.zeros(3, np.float32), np.zeros(4, np.float32), np.zeros(3, np.float32))

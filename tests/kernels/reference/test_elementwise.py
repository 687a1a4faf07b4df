import numpy as np
import pytest

from kernels.reference import elementwise


def away_from(x, points, margin=1e-3):
    """Move values off the kinks so finite differences see one side only."""
    for p in points:
        near = np.abs(x - p) < margin
        x[near] = p + 2 * margin
    return x


@pytest.mark.parametrize("name,kinks", [("relu", (0.0,)), ("relu6", (0.0, 6.0))])
def test_activation_gradient_matches_finite_differences(name, kinks, rng, numerical_gradient):
    forward = getattr(elementwise, f"{name}_forward")
    backward = getattr(elementwise, f"{name}_backward")
    x = away_from(rng.uniform(-3, 9, size=(2, 3, 4)), kinks)
    dout = rng.standard_normal(x.shape)
    out = np.empty_like(x)

    def loss():
        forward(x, out)
        return float((out * dout).sum())

    loss()
    dx = np.empty_like(x)
    backward(out, dout, dx)
    np.testing.assert_allclose(dx, numerical_gradient(loss, x), rtol=1e-6, atol=1e-8)


def test_relu6_clips_both_sides():
    x = np.array([-1.0, 0.5, 5.5, 7.0])
    out = np.empty_like(x)
    elementwise.relu6_forward(x, out)
    np.testing.assert_array_equal(out, [0.0, 0.5, 5.5, 6.0])


def test_dropout_gradient_matches_finite_differences(rng, numerical_gradient):
    x = rng.standard_normal((3, 5))
    mask = (rng.random(x.shape) > 0.5).astype(np.uint8)
    dout = rng.standard_normal(x.shape)
    out = np.empty_like(x)

    def loss():
        elementwise.dropout_forward(x, mask, 2.0, out)
        return float((out * dout).sum())

    dx = np.empty_like(x)
    elementwise.dropout_backward(dout, mask, 2.0, dx)
    np.testing.assert_allclose(dx, numerical_gradient(loss, x), rtol=1e-6, atol=1e-8)
    loss()
    np.testing.assert_array_equal(out[mask == 0], 0)


def test_add():
    a, b, out = np.arange(4.0), np.ones(4), np.empty(4)
    elementwise.add_forward(a, b, out)
    np.testing.assert_array_equal(out, [1.0, 2.0, 3.0, 4.0])

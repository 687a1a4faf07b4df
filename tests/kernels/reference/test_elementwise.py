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


def test_leaky_relu_gradient_matches_finite_differences_and_torch(rng, numerical_gradient):
    import torch

    x = away_from(rng.uniform(-3, 3, size=(2, 3, 4)), (0.0,)).astype(np.float32)
    dout = rng.standard_normal(x.shape).astype(np.float32)
    out, dx = np.empty_like(x), np.empty_like(x)
    elementwise.leaky_relu_forward(x, out, 0.1)
    elementwise.leaky_relu_backward(out, dout, dx, 0.1)
    xt = torch.from_numpy(x).requires_grad_()
    expected = torch.nn.functional.leaky_relu(xt, 0.1)
    expected.backward(torch.from_numpy(dout))
    np.testing.assert_array_equal(out, expected.detach().numpy())
    np.testing.assert_array_equal(dx, xt.grad.numpy())
    x64, dout64 = x.astype(np.float64), dout.astype(np.float64)
    out64 = np.empty_like(x64)

    def loss():
        elementwise.leaky_relu_forward(x64, out64, 0.1)
        return float((out64 * dout64).sum())

    loss()
    np.testing.assert_allclose(dx, numerical_gradient(loss, x64), rtol=1e-5, atol=1e-6)


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

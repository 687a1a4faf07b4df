"""The NumPy reference conv: gradients by central finite differences in float64, values against torch."""

import numpy as np
import pytest

from kernels.reference import conv as ref

# (N, C, H, W, K, kernel, stride, pad, groups)
SHAPES = [
    (2, 3, 5, 4, 4, 3, 1, 1, 1),
    (1, 4, 5, 5, 2, 3, 2, 0, 2),
    (2, 3, 4, 5, 3, 3, 2, 1, 3),
    (1, 2, 3, 3, 3, 1, 1, 0, 1),
]


def _forward(x, w, b, stride, pad, groups):
    oh, ow = ref.check_conv2d_shapes(x.shape, w.shape, stride, pad, groups)
    out = np.empty((x.shape[0], w.shape[0], oh, ow))
    ref.conv2d_forward(x, w, b, out, stride, pad, groups)
    return out


def _numeric_gradient(f, a, eps=1e-6):
    grad = np.empty_like(a)
    for i in np.ndindex(a.shape):
        keep = a[i]
        a[i] = keep + eps
        up = f()
        a[i] = keep - eps
        down = f()
        a[i] = keep
        grad[i] = (up - down) / (2 * eps)
    return grad


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_reference_gradients_match_finite_differences(shape):
    n, c, h, wd, k, r, stride, pad, groups = shape
    rng = np.random.default_rng(1)
    x = rng.standard_normal((n, c, h, wd))
    w = rng.standard_normal((k, c // groups, r, r))
    b = rng.standard_normal(k)
    probe = rng.standard_normal(_forward(x, w, b, stride, pad, groups).shape)

    def loss():
        return float((_forward(x, w, b, stride, pad, groups) * probe).sum())

    dx, dw, db = np.empty_like(x), np.empty_like(w), np.empty_like(b)
    ref.conv2d_backward_data(probe, w, dx, stride, pad, groups)
    ref.conv2d_backward_weight(x, probe, dw, db, stride, pad, groups)
    np.testing.assert_allclose(dx, _numeric_gradient(loss, x), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(dw, _numeric_gradient(loss, w), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(db, _numeric_gradient(loss, b), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_reference_forward_matches_torch(shape):
    torch = pytest.importorskip("torch")
    n, c, h, wd, k, r, stride, pad, groups = shape
    rng = np.random.default_rng(2)
    x = rng.standard_normal((n, c, h, wd))
    w = rng.standard_normal((k, c // groups, r, r))
    b = rng.standard_normal(k)
    expected = torch.nn.functional.conv2d(
        torch.from_numpy(x), torch.from_numpy(w), torch.from_numpy(b), stride=stride, padding=pad, groups=groups
    )
    np.testing.assert_allclose(_forward(x, w, b, stride, pad, groups), expected.numpy(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    "x_shape, w_shape, groups, message",
    [
        ((1, 3, 4, 4), (2, 3, 3, 3), 2, "divide by groups"),
        ((1, 4, 4, 4), (2, 4, 3, 3), 2, "input channels per group"),
        ((1, 3, 2, 2), (2, 3, 5, 5), 1, "does not fit"),
        ((3, 4, 4), (2, 3, 3, 3), 1, "N×C×H×W"),
    ],
)
def test_bad_shapes_name_the_problem(x_shape, w_shape, groups, message):
    with pytest.raises(ValueError, match=message):
        ref.check_conv2d_shapes(x_shape, w_shape, 1, 0, groups)

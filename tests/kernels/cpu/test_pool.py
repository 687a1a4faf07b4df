import numpy as np
import pytest

from kernels.cpu import pool
from kernels.reference import pool as reference

torch = pytest.importorskip("torch")
F = torch.nn.functional

# (input shape, kernel, stride, pad): odd sizes, batch 1, stride 1 and 2, pad 0 and 1
CASES = [
    ((1, 3, 7, 7), 3, 2, 1),
    ((2, 4, 8, 6), 2, 2, 0),
    ((1, 2, 5, 9), 3, 1, 1),
    ((3, 1, 6, 6), 3, 2, 0),
]


def output_shape(shape, kernel, stride, pad):
    N, C, H, W = shape
    return (N, C, pool.pool_output_size(H, kernel, stride, pad), pool.pool_output_size(W, kernel, stride, pad))


@pytest.mark.parametrize("shape,kernel,stride,pad", CASES)
def test_maxpool_matches_reference_and_torch(shape, kernel, stride, pad, rng):
    x = rng.standard_normal(shape).astype(np.float32)
    out_shape = output_shape(shape, kernel, stride, pad)
    dout = rng.standard_normal(out_shape).astype(np.float32)
    out, argmax = np.empty(out_shape, np.float32), np.empty(out_shape, np.int32)
    pool.maxpool2d_forward(x, out, argmax, kernel, stride, pad)
    expected, expected_argmax = np.empty_like(out), np.empty_like(argmax)
    reference.maxpool2d_forward(x, expected, expected_argmax, kernel, stride, pad)
    np.testing.assert_array_equal(out, expected)
    np.testing.assert_array_equal(argmax, expected_argmax)
    dx, expected_dx = np.full_like(x, np.nan), np.empty_like(x)  # NaN: the kernel must zero dx itself
    pool.maxpool2d_backward(dout, argmax, dx)
    reference.maxpool2d_backward(dout, expected_argmax, expected_dx)
    np.testing.assert_allclose(dx, expected_dx, rtol=1e-6, atol=1e-6)

    tx = torch.tensor(x, requires_grad=True)
    t_out, t_indices = F.max_pool2d(tx, kernel, stride, pad, return_indices=True)
    t_out.backward(torch.tensor(dout))
    np.testing.assert_array_equal(out, t_out.detach().numpy())
    np.testing.assert_array_equal(argmax, t_indices.numpy())
    np.testing.assert_allclose(dx, tx.grad.numpy(), rtol=1e-6, atol=1e-6)

    # uint8 argmax (the place in the window): the same output and the same dx bits, cpu and reference
    for module in (pool, reference):
        out8, argmax8, dx8 = np.empty_like(out), np.full(out_shape, 255, np.uint8), np.full_like(x, np.nan)
        module.maxpool2d_forward(x, out8, argmax8, kernel, stride, pad)
        assert argmax8.max() < kernel * kernel
        module.maxpool2d_backward(dout, argmax8, dx8, kernel, stride, pad)
        np.testing.assert_array_equal(out8, out)
        np.testing.assert_array_equal(dx8, dx if module is pool else expected_dx)


@pytest.mark.parametrize("shape,kernel,stride,pad", CASES)
def test_avgpool_matches_reference_and_torch(shape, kernel, stride, pad, rng):
    x = rng.standard_normal(shape).astype(np.float32)
    out_shape = output_shape(shape, kernel, stride, pad)
    dout = rng.standard_normal(out_shape).astype(np.float32)
    out, expected = np.empty(out_shape, np.float32), np.empty(out_shape, np.float32)
    pool.avgpool2d_forward(x, out, kernel, stride, pad)
    reference.avgpool2d_forward(x, expected, kernel, stride, pad)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
    dx, expected_dx = np.full_like(x, np.nan), np.empty_like(x)
    pool.avgpool2d_backward(dout, dx, kernel, stride, pad)
    reference.avgpool2d_backward(dout, expected_dx, kernel, stride, pad)
    np.testing.assert_allclose(dx, expected_dx, rtol=1e-5, atol=1e-6)

    tx = torch.tensor(x, requires_grad=True)
    t_out = F.avg_pool2d(tx, kernel, stride, pad)  # count_include_pad=True by default
    t_out.backward(torch.tensor(dout))
    np.testing.assert_allclose(out, t_out.detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dx, tx.grad.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", [(1, 3, 1, 1), (2, 5, 7, 3), (4, 8, 4, 4)])
def test_global_avgpool_matches_reference_and_torch(shape, rng):
    x = rng.standard_normal(shape).astype(np.float32)
    dout = rng.standard_normal(shape[:2]).astype(np.float32)
    out, expected = np.empty(shape[:2], np.float32), np.empty(shape[:2], np.float32)
    pool.global_avgpool_forward(x, out)
    reference.global_avgpool_forward(x, expected)
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-6)
    dx, expected_dx = np.empty_like(x), np.empty_like(x)
    pool.global_avgpool_backward(dout, dx)
    reference.global_avgpool_backward(dout, expected_dx)
    np.testing.assert_allclose(dx, expected_dx, rtol=1e-6, atol=1e-7)

    tx = torch.tensor(x, requires_grad=True)
    t_out = F.adaptive_avg_pool2d(tx, 1).flatten(1)
    t_out.backward(torch.tensor(dout))
    np.testing.assert_allclose(out, t_out.detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dx, tx.grad.numpy(), rtol=1e-5, atol=1e-7)


def test_pool_names_bad_windows():
    x = np.zeros((1, 1, 4, 4), np.float32)
    with pytest.raises(ValueError, match="pad 2 must be at most half the kernel 3"):
        pool.avgpool2d_forward(x, np.zeros((1, 1, 4, 4), np.float32), 3, 1, 2)
    with pytest.raises(ValueError, match=r"output has shape \(1, 1, 4, 4\), expected \(1, 1, 2, 2\)"):
        pool.maxpool2d_forward(x, np.zeros((1, 1, 4, 4), np.float32), np.zeros((1, 1, 4, 4), np.int32), 2, 2, 0)


def test_maxpool_propagates_nan_as_torch():
    x = np.arange(16, dtype=np.float32).reshape(1, 1, 4, 4)
    x[0, 0, 0, 1] = np.nan
    out, argmax = np.empty((1, 1, 2, 2), np.float32), np.empty((1, 1, 2, 2), np.int32)
    pool.maxpool2d_forward(x, out, argmax, 2, 2, 0)
    t_out, t_indices = F.max_pool2d(torch.tensor(x), 2, 2, 0, return_indices=True)
    np.testing.assert_array_equal(out, t_out.numpy())  # NaN where torch has NaN
    np.testing.assert_array_equal(argmax, t_indices.numpy())


def test_uint8_argmax_needs_the_window_geometry(rng):
    x = rng.standard_normal((1, 1, 4, 4)).astype(np.float32)
    out, argmax = np.empty((1, 1, 2, 2), np.float32), np.empty((1, 1, 2, 2), np.uint8)
    pool.maxpool2d_forward(x, out, argmax, 2, 2, 0)
    with pytest.raises(ValueError, match="needs kernel, stride and pad"):
        pool.maxpool2d_backward(np.ones_like(out), argmax, np.empty_like(x))
    with pytest.raises(ValueError, match="argmax must be int32 or uint8"):
        pool.maxpool2d_forward(x, out, argmax.astype(np.int16), 2, 2, 0)


@pytest.mark.parametrize("stride,pad", [(2, 1), (1, 1), (2, 0)])
def test_whole_3x3_windows_pick_the_loops_winner_with_ties_and_nans(stride, pad, rng):
    """The unrolled 3×3 windows (``pool._maxpool_forward``): ties (the first in row-major order wins, as in torch),
    NaNs (a NaN wins; a later NaN over an earlier one), -inf windows; against the reference, and torch without NaNs."""
    x = rng.integers(-2, 3, (2, 3, 11, 10)).astype(np.float32)  # many ties
    x[0, 0, 2, :] = -np.inf
    x[0, 0, 1:4, 0:4] = -np.inf  # whole windows of -inf
    out_shape = output_shape(x.shape, 3, stride, pad)
    tied_out, tied_argmax = np.empty(out_shape, np.float32), np.empty(out_shape, np.int32)
    pool.maxpool2d_forward(x, tied_out, tied_argmax, 3, stride, pad)
    t_out, t_indices = F.max_pool2d(torch.tensor(x), 3, stride, pad, return_indices=True)
    np.testing.assert_array_equal(tied_out, t_out.numpy())
    np.testing.assert_array_equal(tied_argmax, t_indices.numpy())
    x[1, 2, 4, 4] = x[1, 2, 5, 5] = x[0, 1, 6, 3] = np.nan  # two NaNs in some windows
    for dtype in (np.int32, np.uint8):
        out, argmax = np.empty(out_shape, np.float32), np.empty(out_shape, dtype)
        want, want_argmax = np.empty_like(out), np.empty_like(argmax)
        pool.maxpool2d_forward(x, out, argmax, 3, stride, pad)
        reference.maxpool2d_forward(x, want, want_argmax, 3, stride, pad)
        np.testing.assert_array_equal(out, want)  # NaN where the reference has NaN
        np.testing.assert_array_equal(argmax, want_argmax)
    t_out, t_indices = F.max_pool2d(torch.tensor(x), 3, stride, pad, return_indices=True)
    out, argmax = np.empty(out_shape, np.float32), np.empty(out_shape, np.int32)
    pool.maxpool2d_forward(x, out, argmax, 3, stride, pad)
    np.testing.assert_array_equal(out, t_out.numpy())
    np.testing.assert_array_equal(argmax, t_indices.numpy())  # with two NaNs in a window: the later one, as torch
    assert np.isnan(out).any()


@pytest.mark.parametrize("kernel,stride,pad", [(3, 2, 1), (3, 1, 1), (3, 2, 0), (3, 3, 1), (2, 2, 1), (5, 2, 2)])
@pytest.mark.parametrize("size", [(7, 7), (12, 9), (3, 4)])
def test_max_pool_inner_runs_and_edges_match_the_reference_both_ways(kernel, stride, pad, size, rng):
    """The 3×3 inner run (a tree of pairs) and the window scan at the edges, on planes of odd and even sizes,
    with ties and scattered NaNs; backward's offset table for the uint8 argmax: the reference's bits."""
    if (size[0] + 2 * pad - kernel) < 0 or (size[1] + 2 * pad - kernel) < 0:
        pytest.skip("the window does not fit")
    x = rng.integers(-1, 2, (2, 3, *size)).astype(np.float32)
    x[rng.random(x.shape) < 0.08] = np.nan
    out_shape = output_shape(x.shape, kernel, stride, pad)
    dout = rng.standard_normal(out_shape).astype(np.float32)
    for dtype in (np.int32, np.uint8):
        out, argmax = np.empty(out_shape, np.float32), np.empty(out_shape, dtype)
        want, want_argmax = np.empty_like(out), np.empty_like(argmax)
        pool.maxpool2d_forward(x, out, argmax, kernel, stride, pad)
        reference.maxpool2d_forward(x, want, want_argmax, kernel, stride, pad)
        np.testing.assert_array_equal(out, want)
        np.testing.assert_array_equal(argmax, want_argmax)
        dx, want_dx = np.full(x.shape, 7.0, np.float32), np.empty(x.shape, np.float32)
        pool.maxpool2d_backward(dout, argmax, dx, kernel, stride, pad)
        reference.maxpool2d_backward(dout, want_argmax, want_dx, kernel, stride, pad)
        assert np.array_equal(dx.view(np.int32), want_dx.view(np.int32))

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
    pool.maxpool2d_backward(dout, argmax, dx, kernel, stride, pad)
    ref.maxpool2d_backward(dout, expected_argmax, expected_dx)
    np.testing.assert_array_equal(dx, expected_dx)  # the same additions in the same order: the same bits

    out8, argmax8, dx8 = np.full_like(out, np.nan), np.full(out_shape, 255, np.uint8), np.full_like(x, np.nan)
    pool.maxpool2d_forward(x, out8, argmax8, kernel, stride, pad)  # the place in the window, as the reference
    expected8 = np.empty_like(argmax8)
    ref.maxpool2d_forward(x, np.empty_like(out), expected8, kernel, stride, pad)
    np.testing.assert_array_equal(argmax8, expected8)
    np.testing.assert_array_equal(out8, expected)
    pool.maxpool2d_backward(dout, argmax8, dx8, kernel, stride, pad)
    np.testing.assert_array_equal(dx8, dx)


def _serial_scatter(dout, argmax, H, W, kernel, stride, pad):
    """The kernel the gather replaced, one (n, c) plane at a time: dx = 0, then dx[winner] += dout in
    ascending output order (float32 additions, as on the GPU)."""
    N, C, OH, OW = dout.shape
    dx = np.zeros((N, C, H, W), np.float32)
    for n in range(N):
        for c in range(C):
            for oh in range(OH):
                for ow in range(OW):
                    a = int(argmax[n, c, oh, ow])
                    if argmax.dtype == np.uint8:
                        h, w = oh * stride - pad + a // kernel, ow * stride - pad + a % kernel
                    else:
                        h, w = divmod(a, W)
                    dx[n, c, h, w] = np.float32(dx[n, c, h, w] + dout[n, c, oh, ow])
    return dx


# ResNet's stem pool (3×3 s2 pad 1: a pixel in up to 4 windows), stride 1 (up to 9), and 4×4 s2 (up to 4)
@pytest.mark.parametrize("shape, kernel, stride, pad", [((2, 2, 7, 8), 3, 2, 1), ((1, 2, 5, 5), 3, 1, 1),
                                                        ((1, 1, 8, 6), 4, 2, 1)])
def test_maxpool_backward_gather_has_the_scatters_bits(shape, kernel, stride, pad):
    """Overlapping windows whose winners collide: plateaus of ties (the first maximum of each window wins,
    so neighbouring windows pick the same pixel) and a random winner per window (any place inside the
    window, padding excluded), with gradients of very different sizes (1e8, 1, −1e8), whose float32 sum
    depends on the order. The gather must give the scatter's bits, for both argmax encodings."""
    rng = np.random.default_rng(3)
    N, C, H, W = shape
    out_shape = _out_shape(shape, kernel, stride, pad)
    OH, OW = out_shape[2], out_shape[3]
    x = rng.standard_normal(shape).astype(np.float32)
    x[:, :, ::3, ::2] = 4.0  # ties: equal maxima spread over the plane
    dout = rng.choice(np.float32([1e8, 1.0, -1e8, 0.5, -3.0]), out_shape).astype(np.float32)
    forward8 = np.empty(out_shape, np.uint8)
    ref.maxpool2d_forward(x, np.empty(out_shape, np.float32), forward8, kernel, stride, pad)
    # random winners: for each window a place whose pixel lies inside the input
    random8 = np.empty(out_shape, np.uint8)
    for oh in range(OH):
        for ow in range(OW):
            places = [r * kernel + s for r in range(kernel) for s in range(kernel)
                      if 0 <= oh * stride - pad + r < H and 0 <= ow * stride - pad + s < W]
            random8[:, :, oh, ow] = rng.choice(places, (N, C))
    oh = np.arange(OH)[:, None]
    ow = np.arange(OW)[None, :]
    collided = 0
    for local in (forward8, random8):
        flat = ((oh * stride - pad + local // kernel) * W + (ow * stride - pad + local % kernel)).astype(np.int32)
        collided += int(sum(np.bincount(p.ravel()).max() > 1 for p in flat.reshape(N * C, -1)))
        expected = _serial_scatter(dout, local, H, W, kernel, stride, pad)
        assert np.array_equal(expected, _serial_scatter(dout, flat, H, W, kernel, stride, pad))
        reference = np.empty(shape, np.float32)
        ref.maxpool2d_backward(dout, flat, reference)
        np.testing.assert_array_equal(reference, expected)
        for argmax in (local, flat):
            dx = np.full(shape, np.nan, np.float32)
            pool.maxpool2d_backward(dout, argmax, dx, kernel, stride, pad)
            np.testing.assert_array_equal(dx, expected)
    assert collided >= N * C  # most planes had a pixel that several windows picked (the case a scatter races on)


def test_maxpool_backward_needs_the_geometry():
    dout, dx = np.zeros((1, 1, 2, 2), np.float32), np.zeros((1, 1, 4, 4), np.float32)
    with pytest.raises(ValueError, match="kernel, stride and pad"):
        pool.maxpool2d_backward(dout, np.zeros((1, 1, 2, 2), np.int32), dx)


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

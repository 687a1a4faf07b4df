"""The CUDA batch norm against the NumPy reference, simulated: one block per channel, and a channel split over
several blocks (partial statistics combined in a fixed order), with a tiny split so the simulator runs it."""

from __future__ import annotations

import numpy as np
import pytest

from kernels.cuda import batchnorm
from kernels.reference import batchnorm as ref
from tests.kernels.cuda.conftest import assert_close

pytestmark = pytest.mark.cudasim


def _inputs(shape, seed=0):
    rng = np.random.default_rng(seed)
    C = shape[1]
    x = (rng.standard_normal(shape) * 2 + 3).astype(np.float32)  # an offset mean: the two-pass variance matters
    gamma = rng.uniform(0.5, 1.5, C).astype(np.float32)
    beta = rng.standard_normal(C).astype(np.float32)
    running_mean = rng.standard_normal(C).astype(np.float32)
    running_var = rng.uniform(0.5, 2, C).astype(np.float32)
    dout = rng.standard_normal(shape).astype(np.float32)
    return x, gamma, beta, running_mean, running_var, dout


def _train(module, x, gamma, beta, running_mean, running_var, fill=np.nan):
    C = x.shape[1]
    rm, rv = running_mean.copy(), running_var.copy()
    out = np.full_like(x, fill)
    save_mean = np.full(module.batchnorm_forward_train_workspace_size(x.shape), fill, np.float32)
    save_invstd = np.full(C, fill, np.float32)
    module.batchnorm_forward_train(x, gamma, beta, rm, rv, out, save_mean, save_invstd, 0.1, 1e-5)
    return out, save_mean[:C], save_invstd, rm, rv


def _backward(module, out, dout, gamma, beta, save_invstd, fill=np.nan):
    C = out.shape[1]
    got = [np.full_like(out, fill), np.full(C, fill, np.float32), np.full(C, fill, np.float32)]
    scratch_size = module.batchnorm_backward_from_output_workspace_size(out.shape)
    scratch = np.full(scratch_size, fill, np.float32) if scratch_size else None
    module.batchnorm_backward_from_output(out, dout, gamma, beta, save_invstd, *got, scratch)
    return got


@pytest.fixture(params=[batchnorm.Split(4, 2), batchnorm.Split(2, 2), batchnorm.Split(8, 1)],
                ids=["4x2", "2x2", "8x1"])
def tiny_split(request):
    """Chunks of 8, 4 and 8 values: 18 values a channel split 3 ways (the last chunk 2), 25 values 4 or 7
    ways (more partials than the 2 threads that fold them); P = 2 < threads steps whole images."""
    previous = batchnorm.use_split(request.param)
    yield request.param
    batchnorm.use_split(previous)


# 2·3·3 = 18 elements per channel (a non-power-of-two tree), and 1·5·5 = 25 (batch 1).
@pytest.mark.parametrize("shape", [(2, 3, 3, 3), (1, 2, 5, 5)])
def test_batchnorm_train_matches_reference(shape):
    x, gamma, beta, running_mean, running_var, _ = _inputs(shape)
    got = _train(batchnorm, x, gamma, beta, running_mean, running_var)
    expected = _train(ref, x, gamma, beta, running_mean, running_var)
    for actual, wanted in zip(got, expected):
        assert_close(actual, wanted)


def test_batchnorm_infer_matches_reference():
    x, gamma, beta, running_mean, running_var, _ = _inputs((2, 3, 2, 3), seed=1)
    out, expected = np.full_like(x, np.nan), np.empty_like(x)
    batchnorm.batchnorm_forward_infer(x, gamma, beta, running_mean, running_var, out, 1e-5)
    ref.batchnorm_forward_infer(x, gamma, beta, running_mean, running_var, expected, 1e-5)
    assert_close(out, expected)


def test_batchnorm_statistics_are_deterministic():
    x, gamma, beta, running_mean, running_var, _ = _inputs((2, 2, 3, 3), seed=2)
    first = _train(batchnorm, x, gamma, beta, running_mean, running_var)
    second = _train(batchnorm, x, gamma, beta, running_mean, running_var)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)


# the two tree sizes of the forward test, with a third channel for the γ below the floor
@pytest.mark.parametrize("shape", [(2, 3, 3, 3), (1, 3, 5, 5)])
def test_batchnorm_backward_from_output_matches_reference(shape):
    """In-Place ABN's backward (x̂ rebuilt from the output) against the reference, with one γ below the floor."""
    x, gamma, beta, running_mean, running_var, dout = _inputs(shape, seed=2)
    gamma[1] = 0.0  # raised to 1e-5 by every kernel, so the output can be divided back
    out, _, save_invstd, _, _ = _train(ref, x, gamma, beta, running_mean, running_var)
    C = x.shape[1]
    got = [np.full_like(x, np.nan), np.full(C, np.nan, np.float32), np.full(C, np.nan, np.float32)]
    batchnorm.batchnorm_backward_from_output(out, dout, gamma, beta, save_invstd, *got)
    expected = [np.empty_like(x), np.empty(C, np.float32), np.empty(C, np.float32)]
    ref.batchnorm_backward_from_output(out, dout, gamma, beta, save_invstd, *expected)
    for actual, wanted in zip(got, expected):
        assert_close(actual[:, [0, 2]] if actual.ndim == 4 else actual[[0, 2]],
                     wanted[:, [0, 2]] if wanted.ndim == 4 else wanted[[0, 2]])
    assert np.all(np.isfinite(got[0])) and np.all(np.isfinite(got[1]))


SPLIT_SHAPES = [(2, 3, 3, 3), (1, 3, 5, 5), (5, 3, 1, 2)]


@pytest.mark.parametrize("shape", SPLIT_SHAPES)
def test_split_batchnorm_matches_reference(shape, tiny_split):
    """A channel over several blocks: partial (mean, M2) per block, Chan's combination in every block,
    the normalized chunks; backward's partial sums. Against the reference, with one γ below the floor."""
    blocks, _ = batchnorm.blocks_per_channel(shape[0] * shape[2] * shape[3])
    assert blocks > 1
    x, gamma, beta, running_mean, running_var, dout = _inputs(shape, seed=4)
    gamma[1] = 0.0
    from kernels.cuda import LAUNCHES, reset_launches

    reset_launches()
    got = _train(batchnorm, x, gamma, beta, running_mean, running_var)
    assert dict(LAUNCHES) == {"batchnorm_partial_stats_kernel": 1, "batchnorm_normalize_kernel": 1}
    expected = _train(ref, x, gamma, beta, running_mean, running_var)
    for actual, wanted in zip(got, expected):
        assert_close(actual, wanted)
    out, save_invstd = expected[0], expected[2]
    reset_launches()
    grads = _backward(batchnorm, out, dout, gamma, beta, save_invstd)
    assert dict(LAUNCHES) == {"batchnorm_backward_partials_kernel": 1, "batchnorm_backward_apply_kernel": 1}
    wanted = _backward(ref, out, dout, gamma, beta, save_invstd)
    for actual, want in zip(grads, wanted):
        assert_close(actual[:, [0, 2]] if actual.ndim == 4 else actual[[0, 2]],
                     want[:, [0, 2]] if want.ndim == 4 else want[[0, 2]])
    assert all(np.all(np.isfinite(g)) for g in grads)


def test_split_batchnorm_is_deterministic_and_reads_only_its_inputs(tiny_split):
    """Same inputs, same bits, whatever the outputs and scratch held before (NaN or zeros): the partials
    are written before they are read, every block combines them in the same order."""
    x, gamma, beta, running_mean, running_var, dout = _inputs((2, 3, 3, 3), seed=5)
    first = _train(batchnorm, x, gamma, beta, running_mean, running_var, fill=np.nan)
    second = _train(batchnorm, x, gamma, beta, running_mean, running_var, fill=0.0)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)
    out, save_invstd = first[0], first[2]
    grads = _backward(batchnorm, out, dout, gamma, beta, save_invstd, fill=np.nan)
    again = _backward(batchnorm, out, dout, gamma, beta, save_invstd, fill=0.0)
    for a, b in zip(grads, again):
        np.testing.assert_array_equal(a, b)


def test_split_statistics_keep_their_digits_on_an_offset_channel():
    """Chan's combination of per-block (mean, M2), not E[x²] − E[x]²: mean 1000, spread 1, split 5 ways,
    keeps the variance that float32 E[x²] − E[x]² loses (checked below to miss by far more)."""
    previous = batchnorm.use_split(batchnorm.Split(4, 2))
    try:
        rng = np.random.default_rng(6)
        x = (1000 + rng.standard_normal((2, 1, 4, 5))).astype(np.float32)
        ones, zeros = np.ones(1, np.float32), np.zeros(1, np.float32)
        _, mean, invstd, _, _ = _train(batchnorm, x, ones, zeros, zeros, ones)
        x64 = x.astype(np.float64)
        want = 1 / np.sqrt(x64.var() + 1e-5)
        np.testing.assert_allclose(mean, x64.mean(), rtol=1e-6)
        np.testing.assert_allclose(invstd, want, rtol=1e-4)
        x32 = x.ravel()
        naive = np.float32(np.float32((x32 * x32).sum(dtype=np.float32) / x32.size) - np.float32(x32.mean()) ** 2)
        assert abs(1 / np.sqrt(float(naive) + 1e-5) - want) > 1e-3 * want
    finally:
        batchnorm.use_split(previous)


def test_split_workspaces_are_checked(tiny_split):
    x, gamma, beta, running_mean, running_var, dout = _inputs((2, 3, 3, 3))
    C = 3
    with pytest.raises(ValueError, match="batchnorm_forward_train_workspace_size"):
        batchnorm.batchnorm_forward_train(x, gamma, beta, running_mean, running_var, np.empty_like(x),
                                          np.empty(C, np.float32), np.empty(C, np.float32), 0.1, 1e-5)
    with pytest.raises(ValueError, match="batchnorm_backward_from_output_workspace_size"):
        batchnorm.batchnorm_backward_from_output(x, dout, gamma, beta, np.ones(C, np.float32), np.empty_like(x),
                                                 np.empty(C, np.float32), np.empty(C, np.float32))


def test_the_split_follows_the_shape():
    """Production split: a channel of up to 4,096 values is one block (one launch each way, no partials);
    CIFAR ResNet-18's 64 channels at 32×32, batch 32, split 8 ways; past 256 chunks the chunk grows."""
    assert batchnorm.blocks_per_channel(4096) == (1, 4096)
    assert batchnorm.batchnorm_backward_from_output_workspace_size((32, 256, 8, 8)) == 0
    assert batchnorm.batchnorm_forward_train_workspace_size((32, 256, 8, 8)) == 256
    assert batchnorm.blocks_per_channel(32 * 32 * 32) == (8, 4096)
    assert batchnorm.batchnorm_forward_train_workspace_size((32, 64, 32, 32)) == 64 + 2 * 64 * 8
    assert batchnorm.batchnorm_backward_from_output_workspace_size((32, 64, 32, 32)) == 2 * 64 * 8
    assert batchnorm.blocks_per_channel(256 * 4096 + 1) == (256, 4097)

"""The CUDA batch norm (one block per channel, tree reductions) against the NumPy reference, simulated."""

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


def _train(module, x, gamma, beta, running_mean, running_var):
    C = x.shape[1]
    rm, rv = running_mean.copy(), running_var.copy()
    out = np.full_like(x, np.nan)
    save_mean, save_invstd = np.full(C, np.nan, np.float32), np.full(C, np.nan, np.float32)
    module.batchnorm_forward_train(x, gamma, beta, rm, rv, out, save_mean, save_invstd, 0.1, 1e-5)
    return out, save_mean, save_invstd, rm, rv


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

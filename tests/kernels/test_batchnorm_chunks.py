"""The batch-norm chunk kernels (kernels/cpu/batchnorm.py) against the NumPy reference, and calls over a
batch's images in any split giving the bits of one call."""

import numpy as np
import pytest

from kernels.cpu import TABLE as CPU
from kernels.reference import TABLE as REF

SPLITS = [(0, 13), (0, 1, 13), (0, 5, 8, 13), tuple(range(14))]


def data(seed=0, shape=(13, 5, 7, 9)):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * 3 + 50).astype(np.float32)  # a mean far from 0: the shift matters
    return x, rng


def run_statistics(table, x, split):
    sums = np.zeros((x.shape[1], 3))
    for a, b in zip(split, split[1:]):
        table["batchnorm_chunk_statistics"](x[a:b], sums, a == 0)
    return sums


def test_statistics_carry_across_any_split_and_match_the_reference():
    x, _ = data()
    one = run_statistics(CPU, x, SPLITS[0])
    for split in SPLITS[1:]:
        assert np.array_equal(run_statistics(CPU, x, split), one), split
    np.testing.assert_allclose(one, run_statistics(REF, x, SPLITS[2]), rtol=1e-12, atol=1e-9)
    assert np.array_equal(one[:, 0], x[0, :, 0, 0])  # K: the channel's first value


def finish(table, sums, count, C, gamma, beta):
    rm, rv = np.full(C, 0.5, np.float32), np.full(C, 2.0, np.float32)
    scale_shift, invstd = np.empty((C, 2)), np.empty(C, np.float32)
    table["batchnorm_chunk_finish"](sums, count, gamma, beta, rm, rv, scale_shift, invstd, 0.1, 1e-5)
    return scale_shift, invstd, rm, rv


@pytest.mark.parametrize("activation", [None, "relu", "relu6"])
def test_forward_matches_the_one_call_kernel_and_the_reference(activation):
    x, rng = data(1)
    N, C = x.shape[:2]
    gamma = rng.standard_normal(C).astype(np.float32)
    gamma[0] = 0.0  # raised to GAMMA_MIN like every batch-norm kernel
    beta = rng.standard_normal(C).astype(np.float32)
    sums = run_statistics(CPU, x, SPLITS[2])
    count = N * x.shape[2] * x.shape[3]
    ss, invstd, rm, rv = finish(CPU, sums, count, C, gamma, beta)
    ref = finish(REF, sums.copy(), count, C, gamma, beta)
    for mine, theirs in zip((ss, invstd, rm, rv), ref):
        np.testing.assert_allclose(mine, theirs, rtol=1e-6)
    # the one-call training forward (two passes, centred squares): the same statistics to float32
    out, mean, inv = np.empty_like(x), np.empty(C, np.float32), np.empty(C, np.float32)
    rm2, rv2 = np.full(C, 0.5, np.float32), np.full(C, 2.0, np.float32)
    CPU["batchnorm_forward_train"](x, gamma, beta, rm2, rv2, out, mean, inv, 0.1, 1e-5)
    np.testing.assert_allclose(invstd, inv, rtol=1e-6)
    np.testing.assert_allclose(rm, rm2, rtol=1e-6)
    np.testing.assert_allclose(rv, rv2, rtol=1e-6)
    y, act = np.empty_like(x), np.empty_like(x)
    for a, b in zip(SPLITS[2], SPLITS[2][1:]):
        CPU["batchnorm_chunk_apply"](x[a:b], ss, activation, y[a:b], act[a:b])
    np.testing.assert_allclose(y, out, rtol=1e-5, atol=1e-5)
    y_ref, act_ref = np.empty_like(x), np.empty_like(x)
    REF["batchnorm_chunk_apply"](x, ss, activation, y_ref, act_ref)
    assert np.array_equal(y, y_ref) and np.array_equal(act, act_ref)
    in_place = x.copy()
    CPU["batchnorm_chunk_apply"](in_place, ss, activation, None, in_place)
    assert np.array_equal(in_place, act)


def test_backward_sums_carry_and_dx_matches_the_one_call_backward():
    y, rng = data(2)
    N, C = y.shape[:2]
    dy = rng.standard_normal(y.shape).astype(np.float32)
    gamma = (rng.standard_normal(C) + 2).astype(np.float32)
    beta = rng.standard_normal(C).astype(np.float32)
    invstd = rng.uniform(0.5, 2, C).astype(np.float32)

    def sums_of(table, split):
        sums = np.full((C, 2), 7.0)  # reset by the first call
        for a, b in zip(split, split[1:]):
            table["batchnorm_chunk_gradient_sums"](y[a:b], dy[a:b], gamma, beta, sums, a == 0)
        return sums

    one = sums_of(CPU, SPLITS[0])
    for split in SPLITS[1:]:
        assert np.array_equal(sums_of(CPU, split), one), split
    np.testing.assert_allclose(one, sums_of(REF, SPLITS[0]), rtol=1e-10, atol=1e-9)
    count = N * y.shape[2] * y.shape[3]
    dx = np.empty_like(y)
    for a, b in zip(SPLITS[2], SPLITS[2][1:]):
        CPU["batchnorm_chunk_dx"](y[a:b], dy[a:b], gamma, beta, invstd, one, count, dx[a:b])
    # the one-call backward (the separate BatchNorm2d layer's): the same arithmetic, the same bits
    dx_one, dgamma, dbeta = np.empty_like(y), np.empty(C, np.float32), np.empty(C, np.float32)
    CPU["batchnorm_backward_from_output"](y, dy, gamma, beta, invstd, dx_one, dgamma, dbeta)
    assert np.array_equal(dx, dx_one)
    assert np.array_equal(dbeta, one[:, 0].astype(np.float32)) and np.array_equal(dgamma, one[:, 1].astype(np.float32))
    dx_ref = np.empty_like(y)
    REF["batchnorm_chunk_dx"](y, dy, gamma, beta, invstd, one, count, dx_ref)
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-5, atol=1e-6)
    in_place = dy.copy()
    CPU["batchnorm_chunk_dx"](y, in_place, gamma, beta, invstd, one, count, in_place)
    assert np.array_equal(in_place, dx)


def test_bad_sums_are_named():
    x, _ = data()
    with pytest.raises(ValueError, match="sums must be a C-contiguous float64 array of shape"):
        CPU["batchnorm_chunk_statistics"](x, np.zeros((5, 2)), True)


@pytest.mark.parametrize("activation", ["relu", "relu6"])
def test_the_activation_mask_on_the_fly_gives_the_bits_of_its_backward_first(activation):
    """With ``activation`` the kernels take the gradient of the activation's output: the same bits as
    relu_backward / relu6_backward written out first, then the kernel without it."""
    rng = np.random.default_rng(3)
    y = (rng.standard_normal((5, 4, 6, 6)) * 4).astype(np.float32)  # both sides of 0 and of 6
    y[0, 0, 0, :3] = [0.0, 6.0, -0.0]  # the kinks themselves
    g = rng.standard_normal(y.shape).astype(np.float32)
    C = y.shape[1]
    gamma, beta = (rng.standard_normal(C) + 2).astype(np.float32), rng.standard_normal(C).astype(np.float32)
    invstd = rng.uniform(0.5, 2, C).astype(np.float32)
    dy = np.empty_like(g)
    CPU[f"{activation}_backward"](y, g, dy)
    plain, fused = np.zeros((C, 2)), np.zeros((C, 2))
    CPU["batchnorm_chunk_gradient_sums"](y, dy, gamma, beta, plain, True)
    CPU["batchnorm_chunk_gradient_sums"](y, g, gamma, beta, fused, True, activation)
    assert np.array_equal(plain, fused)
    ref = np.zeros((C, 2))
    REF["batchnorm_chunk_gradient_sums"](y, g, gamma, beta, ref, True, activation)
    np.testing.assert_allclose(fused, ref, rtol=1e-10, atol=1e-9)
    dx_plain, dx_fused = np.empty_like(y), np.empty_like(y)
    CPU["batchnorm_chunk_dx"](y, dy, gamma, beta, invstd, plain, 180, dx_plain)
    CPU["batchnorm_chunk_dx"](y, g, gamma, beta, invstd, plain, 180, dx_fused, activation)
    assert np.array_equal(dx_plain, dx_fused)
    in_place = g.copy()
    CPU["batchnorm_chunk_dx"](y, in_place, gamma, beta, invstd, plain, 180, in_place, activation)
    assert np.array_equal(in_place, dx_fused)


@pytest.mark.parametrize("activation", [None, "relu", "relu6"])
def test_written_over_an_input_the_bits_of_separate_arrays(activation):
    """``batchnorm_chunk_apply`` with y = z or out = z, and ``batchnorm_chunk_dx`` with dx = y or dx = dy, run
    kernels of their own (``_chunk_apply_over``, ``_chunk_dx_over``: the vectorized loop without an overlap
    check): the bits of the same calls on separate arrays. out = z with y kept elsewhere would lose y: refused."""
    z, rng = data(3)
    C = z.shape[1]
    scale_shift = np.stack([rng.random(C) + 0.5, rng.standard_normal(C) * 5], 1)
    y, out = np.empty_like(z), np.empty_like(z)
    CPU["batchnorm_chunk_apply"](z, scale_shift, activation, y, out)
    over = z.copy()  # y over z, out apart
    out_apart = np.empty_like(z)
    CPU["batchnorm_chunk_apply"](over, scale_shift, activation, over, out_apart)
    assert np.array_equal(over, y) and np.array_equal(out_apart, out)
    over = z.copy()  # out over z, no y
    CPU["batchnorm_chunk_apply"](over, scale_shift, activation, None, over)
    assert np.array_equal(over, out)
    if activation is not None:
        with pytest.raises(ValueError, match="out may be z only when y is None or z with no activation"):
            CPU["batchnorm_chunk_apply"](over, scale_shift, activation, y, over)
    dy = rng.standard_normal(z.shape).astype(np.float32)
    gamma, beta = (rng.random(C) + 0.5).astype(np.float32), rng.standard_normal(C).astype(np.float32)
    invstd, sums = (rng.random(C) + 0.1).astype(np.float32), rng.standard_normal((C, 2))
    count = z.shape[0] * z.shape[2] * z.shape[3]
    dx = np.empty_like(z)
    CPU["batchnorm_chunk_dx"](y, dy, gamma, beta, invstd, sums, count, dx, activation)
    over_y, over_dy = y.copy(), dy.copy()
    CPU["batchnorm_chunk_dx"](over_y, dy, gamma, beta, invstd, sums, count, over_y, activation)
    CPU["batchnorm_chunk_dx"](y, over_dy, gamma, beta, invstd, sums, count, over_dy, activation)
    assert np.array_equal(over_y, dx) and np.array_equal(over_dy, dx)

import numpy as np
import pytest

from kernels.cpu import batchnorm
from kernels.reference import batchnorm as reference

torch = pytest.importorskip("torch")
F = torch.nn.functional

SHAPES = [(1, 3, 5, 5), (4, 2, 3, 7), (8, 5, 1, 1), (2, 16, 8, 8), (3, 4, 17, 19)]  # 17·19: vector body + tail


def inputs(rng, shape):
    C = shape[1]
    x = (rng.standard_normal(shape) * 2 + 1).astype(np.float32)
    gamma = rng.uniform(0.5, 1.5, C).astype(np.float32)
    beta = rng.standard_normal(C).astype(np.float32)
    running_mean = rng.standard_normal(C).astype(np.float32)
    running_var = rng.uniform(0.5, 2, C).astype(np.float32)
    dout = rng.standard_normal(shape).astype(np.float32)
    return x, gamma, beta, running_mean, running_var, dout


def train_step(module, x, gamma, beta, running_mean, running_var, dout):
    """Forward, then the backward a layer runs: from the output (In-Place ABN)."""
    C = x.shape[1]
    out, mean, invstd = np.empty_like(x), np.empty(C, np.float32), np.empty(C, np.float32)
    module.batchnorm_forward_train(x, gamma, beta, running_mean, running_var, out, mean, invstd, 0.1, 1e-5)
    dx, dgamma, dbeta = np.empty_like(x), np.empty(C, np.float32), np.empty(C, np.float32)
    module.batchnorm_backward_from_output(out, dout, gamma, beta, invstd, dx, dgamma, dbeta)
    return out, mean, invstd, dx, dgamma, dbeta


def backward_from_input(x, dout, gamma, mean, invstd):
    """The reference's input-based backward (the textbook one; no backend keeps a copy)."""
    C = x.shape[1]
    grads = np.empty_like(x), np.empty(C, np.float32), np.empty(C, np.float32)
    reference.batchnorm_backward(x, dout, gamma, mean, invstd, *grads)
    return grads


@pytest.mark.parametrize("shape", SHAPES)
def test_batchnorm_training_matches_reference(shape, rng):
    x, gamma, beta, running_mean, running_var, dout = inputs(rng, shape)
    expected_running = running_mean.copy(), running_var.copy()
    got = train_step(batchnorm, x, gamma, beta, running_mean, running_var, dout)
    expected = train_step(reference, x, gamma, beta, *expected_running, dout)
    for a, b in zip(got, expected):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-5)
    np.testing.assert_allclose(running_mean, expected_running[0], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(running_var, expected_running[1], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("shape", SHAPES)
def test_batchnorm_matches_torch(shape, rng):
    x, gamma, beta, running_mean, running_var, dout = inputs(rng, shape)
    t_running_mean, t_running_var = torch.tensor(running_mean), torch.tensor(running_var)
    tx, tg, tb = (torch.tensor(a, requires_grad=True) for a in (x, gamma, beta))
    t_out = F.batch_norm(tx, t_running_mean, t_running_var, tg, tb, training=True, momentum=0.1, eps=1e-5)
    t_out.backward(torch.tensor(dout))
    out, _, _, dx, dgamma, dbeta = train_step(batchnorm, x, gamma, beta, running_mean, running_var, dout)
    np.testing.assert_allclose(out, t_out.detach().numpy(), rtol=1e-5, atol=2e-5)
    np.testing.assert_allclose(dx, tx.grad.numpy(), rtol=1e-4, atol=2e-5)
    np.testing.assert_allclose(dgamma, tg.grad.numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(dbeta, tb.grad.numpy(), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(running_mean, t_running_mean.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(running_var, t_running_var.numpy(), rtol=1e-5, atol=1e-6)

    infer_out = np.empty_like(x)
    batchnorm.batchnorm_forward_infer(x, gamma, beta, running_mean, running_var, infer_out, 1e-5)
    t_infer = F.batch_norm(torch.tensor(x), t_running_mean, t_running_var, tg.detach(), tb.detach(), training=False)
    np.testing.assert_allclose(infer_out, t_infer.numpy(), rtol=1e-5, atol=2e-5)
    expected_infer = np.empty_like(x)
    reference.batchnorm_forward_infer(x, gamma, beta, running_mean, running_var, expected_infer, 1e-5)
    np.testing.assert_allclose(infer_out, expected_infer, rtol=1e-5, atol=2e-5)


def test_batchnorm_is_deterministic_for_any_thread_count(rng):
    """Each channel's sums run in one thread in a fixed order: same bits on every call, 1 thread or all."""
    import numba

    x, gamma, beta, running_mean, running_var, dout = inputs(rng, (16, 8, 9, 9))
    first = train_step(batchnorm, x, gamma, beta, running_mean.copy(), running_var.copy(), dout)
    second = train_step(batchnorm, x, gamma, beta, running_mean.copy(), running_var.copy(), dout)
    threads = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        single = train_step(batchnorm, x, gamma, beta, running_mean.copy(), running_var.copy(), dout)
    finally:
        numba.set_num_threads(threads)
    for a, b, c in zip(first, second, single):
        assert a.tobytes() == b.tobytes() == c.tobytes()


def misaligned(a: np.ndarray, floats: int) -> np.ndarray:
    """A copy of ``a`` starting ``floats`` float32s past a 64-byte boundary."""
    buffer = np.empty(a.size + 32, np.float32)  # up to 15 floats to the boundary, then up to 15 past it
    start = (-(buffer.ctypes.data // 4)) % 16 + floats
    view = buffer[start : start + a.size].reshape(a.shape)
    view[...] = a
    assert view.ctypes.data % 64 == 4 * floats
    return view


@pytest.mark.parametrize("floats", [1, 3, 8])
def test_batchnorm_bits_do_not_depend_on_the_arrays_alignment(floats, rng):
    """The channel sums are split into vector lanes (``reassoc``); the split must depend on the plane's
    length only, never on where the arrays start (offload moves them): same bits at any offset."""
    x, gamma, beta, running_mean, running_var, dout = inputs(rng, (8, 4, 13, 11))
    aligned = train_step(batchnorm, misaligned(x, 0), gamma, beta, running_mean.copy(), running_var.copy(),
                         misaligned(dout, 0))  # fmt: skip
    shifted = train_step(batchnorm, misaligned(x, floats), gamma, beta, running_mean.copy(), running_var.copy(),
                         misaligned(dout, floats))  # fmt: skip
    for a, b in zip(aligned, shifted):
        assert a.tobytes() == b.tobytes()


def test_batchnorm_statistics_are_accurate_on_large_offset_channels(rng):
    """Mean 1000, spread 1 over 32·1024 values a channel: the float64 two-pass statistics keep the
    variance (E[x²] − E[x]² in float32 would lose it) and agree with NumPy's float64 figures."""
    x = (1000 + rng.standard_normal((32, 3, 32, 32))).astype(np.float32)
    C = x.shape[1]
    out, mean, invstd = np.empty_like(x), np.empty(C, np.float32), np.empty(C, np.float32)
    ones, zeros = np.ones(C, np.float32), np.zeros(C, np.float32)
    batchnorm.batchnorm_forward_train(x, ones, zeros, zeros.copy(), ones.copy(), out, mean, invstd, 0.1, 1e-5)
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(mean, x64.mean(axis=(0, 2, 3)), rtol=1e-7)
    np.testing.assert_allclose(invstd, 1 / np.sqrt(x64.var(axis=(0, 2, 3)) + 1e-5), rtol=1e-6)


def test_batchnorm_refuses_one_value_per_channel():
    x = np.zeros((1, 2, 1, 1), np.float32)
    c = np.zeros(2, np.float32)
    with pytest.raises(ValueError, match="more than one value per channel"):
        batchnorm.batchnorm_forward_train(x, c, c, c, c, np.empty_like(x), c.copy(), c.copy(), 0.1, 1e-5)


@pytest.mark.parametrize("module", [batchnorm, reference], ids=["cpu", "reference"])
@pytest.mark.parametrize("shape", SHAPES)
def test_backward_from_output_matches_backward_from_input(module, shape, rng):
    """In-Place ABN: x̂ rebuilt as (out − β)/γ gives the gradients of the input-based backward (float32 noise)."""
    x, gamma, beta, running_mean, running_var, dout = inputs(rng, shape)
    _, mean, invstd, *got = train_step(module, x, gamma, beta, running_mean, running_var, dout)
    for a, b in zip(got, backward_from_input(x, dout, gamma, mean, invstd)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=5e-5)


def test_gamma_below_the_floor_is_raised_to_it_everywhere(rng):
    """γ = 0 (or |γ| < 1e-5) is used as ±1e-5 in forward, inference and backward: x̂ stays rebuildable."""
    x, gamma, beta, running_mean, running_var, dout = inputs(rng, (4, 3, 5, 5))
    gamma[0], gamma[1] = 0.0, -3e-6
    floored = gamma.copy()
    floored[0], floored[1] = 1e-5, -1e-5
    first = train_step(batchnorm, x, gamma, beta, running_mean.copy(), running_var.copy(), dout)
    second = train_step(batchnorm, x, floored, beta, running_mean.copy(), running_var.copy(), dout)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)
    mean, invstd, got = first[1], first[2], first[3:]
    assert all(np.all(np.isfinite(g)) for g in got)
    from_input = backward_from_input(x, dout, gamma, mean, invstd)
    np.testing.assert_allclose(got[1][2], from_input[1][2], rtol=1e-4)  # a normal channel: the same dγ
    infer = [np.empty_like(x), np.empty_like(x)]
    for g, o in zip((gamma, floored), infer):
        batchnorm.batchnorm_forward_infer(x, g, beta, running_mean, running_var, o, 1e-5)
    np.testing.assert_array_equal(*infer)

import numpy as np
import pytest

from kernels.cpu import optim
from kernels.reference import optim as reference

torch = pytest.importorskip("torch")

SIZES = [1, 1001]


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("momentum,weight_decay,nesterov", [(0.0, 0.0, False), (0.9, 5e-4, False), (0.9, 1e-2, True)])
def test_sgd_matches_reference_and_torch(size, momentum, weight_decay, nesterov, rng):
    param = rng.standard_normal(size).astype(np.float32)
    grads = rng.standard_normal((3, size)).astype(np.float32)
    expected_param = param.copy()
    t_param = torch.tensor(param.copy(), requires_grad=True)
    opt = torch.optim.SGD([t_param], lr=0.1, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov)
    buf, expected_buf = np.zeros_like(param), np.zeros_like(param)
    for g in grads:
        optim.sgd_update(param, g, buf, 0.1, momentum, weight_decay, nesterov)
        reference.sgd_update(expected_param, g, expected_buf, 0.1, momentum, weight_decay, nesterov)
        t_param.grad = torch.tensor(g)
        opt.step()
    np.testing.assert_allclose(param, expected_param, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(param, t_param.detach().numpy(), rtol=1e-6, atol=1e-6)
    if momentum:
        np.testing.assert_allclose(buf, opt.state[t_param]["momentum_buffer"].numpy(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("weight_decay", [0.0, 1e-2])
def test_adam_matches_reference_and_torch(size, weight_decay, rng):
    param = rng.standard_normal(size).astype(np.float32)
    grads = rng.standard_normal((4, size)).astype(np.float32)
    expected_param = param.copy()
    t_param = torch.tensor(param.copy(), requires_grad=True)
    opt = torch.optim.Adam([t_param], lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=weight_decay)
    m, v = np.zeros_like(param), np.zeros_like(param)
    expected_m, expected_v = np.zeros_like(param), np.zeros_like(param)
    for step, g in enumerate(grads, start=1):
        optim.adam_update(param, g, m, v, 1e-2, 0.9, 0.999, 1e-8, weight_decay, step)
        reference.adam_update(expected_param, g, expected_m, expected_v, 1e-2, 0.9, 0.999, 1e-8, weight_decay, step)
        t_param.grad = torch.tensor(g)
        opt.step()
    np.testing.assert_allclose(param, expected_param, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(param, t_param.detach().numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(m, opt.state[t_param]["exp_avg"].numpy(), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(v, opt.state[t_param]["exp_avg_sq"].numpy(), rtol=1e-5, atol=1e-8)


def test_optimizers_name_bad_arguments():
    a = np.zeros(3, np.float32)
    with pytest.raises(ValueError, match="grad has shape"):
        optim.sgd_update(a, np.zeros(4, np.float32), a.copy(), 0.1, 0.9, 0.0, False)
    with pytest.raises(ValueError, match="step counts from 1"):
        optim.adam_update(a, a.copy(), a.copy(), a.copy(), 0.1, 0.9, 0.999, 1e-8, 0.0, 0)

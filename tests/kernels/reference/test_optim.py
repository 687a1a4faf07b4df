import numpy as np
import pytest

from kernels.reference import optim

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("momentum,weight_decay,nesterov", [(0.0, 0.0, False), (0.9, 5e-4, False), (0.9, 1e-2, True)])
def test_sgd_matches_torch_over_steps(momentum, weight_decay, nesterov, rng):
    param = rng.standard_normal(7)
    grads = rng.standard_normal((3, 7))
    torch_param = torch.tensor(param.copy(), requires_grad=True)
    opt = torch.optim.SGD([torch_param], lr=0.1, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov)
    buf = np.zeros_like(param)
    for g in grads:
        optim.sgd_update(param, g, buf, 0.1, momentum, weight_decay, nesterov)
        torch_param.grad = torch.tensor(g)
        opt.step()
    np.testing.assert_allclose(param, torch_param.detach().numpy(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("weight_decay", [0.0, 1e-2])
def test_adam_matches_torch_over_steps(weight_decay, rng):
    param = rng.standard_normal(7)
    grads = rng.standard_normal((4, 7))
    torch_param = torch.tensor(param.copy(), requires_grad=True)
    opt = torch.optim.Adam([torch_param], lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=weight_decay)
    m, v = np.zeros_like(param), np.zeros_like(param)
    for step, g in enumerate(grads, start=1):
        optim.adam_update(param, g, m, v, 1e-2, 0.9, 0.99, 1e-8, weight_decay, step)
        torch_param.grad = torch.tensor(g)
        opt.step()
    np.testing.assert_allclose(param, torch_param.detach().numpy(), rtol=1e-12, atol=1e-12)

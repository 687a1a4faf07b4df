"""Optimizers and schedules against torch.optim, on plain flat arrays (no network needed)."""

import numpy as np
import pytest
import torch

from engine.backend import Backend, get_backend
from engine.memory import ArrayType, ContiguousBlock
from engine.optim import SGD, Adam
from engine.schedule import make_schedule

SIZE = 1000
STEPS = 5


def backend_named(name):
    if name == "reference":  # the NumPy kernel table: the ground truth the fast kernels are tested against
        return Backend("reference", np, "kernels.reference")
    return get_backend(name)


def blocks(backend, rng):
    params = ContiguousBlock(backend, ArrayType.PARAMETERS, [("a.weight", (10, 50)), ("a.bias", (500,))])
    grads = ContiguousBlock(backend, ArrayType.GRADIENTS, [("a.weight", (10, 50)), ("a.bias", (500,))])
    params.flat[...] = rng.standard_normal(SIZE, dtype=np.float32)
    return params, grads


def run_both(backend_name, make_ours, make_torch, steps=STEPS):
    """The same gradients, step after step, through ours and through torch.optim."""
    rng = np.random.default_rng(0)
    params, grads = blocks(backend_named(backend_name), rng)
    theirs = torch.nn.Parameter(torch.from_numpy(params.flat.copy()))
    ours = make_ours(params, grads)
    torch_opt, scheduler = make_torch([theirs])
    for _ in range(steps):
        g = rng.standard_normal(SIZE, dtype=np.float32)
        grads.flat[...] = g
        theirs.grad = torch.from_numpy(g.copy())
        ours.step()
        torch_opt.step()
        if scheduler is not None:
            scheduler.step()
    return params.flat, theirs.detach().numpy()


@pytest.mark.parametrize("backend_name", ["reference", "cpu"])
@pytest.mark.parametrize(
    "momentum,nesterov,weight_decay", [(0.0, False, 0.0), (0.9, False, 0.0), (0.9, True, 5e-4), (0.5, False, 1e-2)]
)
def test_sgd_matches_torch(backend_name, momentum, nesterov, weight_decay):
    ours, theirs = run_both(
        backend_name,
        lambda p, g: SGD(p, g, p.backend, 0.1, momentum, weight_decay, nesterov),
        lambda ps: (torch.optim.SGD(ps, lr=0.1, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov), None),
    )
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend_name", ["reference", "cpu"])
@pytest.mark.parametrize("weight_decay", [0.0, 1e-2])
def test_adam_matches_torch(backend_name, weight_decay):
    ours, theirs = run_both(
        backend_name,
        lambda p, g: Adam(p, g, p.backend, 1e-2, weight_decay=weight_decay),
        lambda ps: (torch.optim.Adam(ps, lr=1e-2, weight_decay=weight_decay), None),
    )
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)


def test_plain_sgd_keeps_no_state_and_momentum_keeps_one_block():
    backend = get_backend("cpu")
    params, grads = blocks(backend, np.random.default_rng(0))
    assert SGD(params, grads, backend, 0.1).state is None
    state = SGD(params, grads, backend, 0.1, momentum=0.9).state
    assert state.array_type is ArrayType.UPDATER_STATE and state.names == ["momentum_buffer"]
    adam = Adam(params, grads, backend)
    assert adam.state.names == ["exp_avg", "exp_avg_sq"] and adam.state.flat.size == 2 * SIZE


@pytest.mark.parametrize(
    "spec,make_torch_scheduler",
    [
        ("step:3:0.5", lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)),
        ("cosine", lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)),
        ("constant", lambda opt: None),
    ],
)
def test_schedules_match_torch(spec, make_torch_scheduler):
    schedule = make_schedule(spec, 0.1, total_steps=10)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    scheduler = make_torch_scheduler(opt)
    for step in range(10):
        assert schedule(step) == pytest.approx(opt.param_groups[0]["lr"], rel=1e-12, abs=1e-15)
        opt.step()
        if scheduler is not None:
            scheduler.step()


def test_sgd_with_a_schedule_matches_torch_with_its_scheduler():
    schedule = make_schedule("step:2:0.1", 0.1, total_steps=STEPS)
    ours, theirs = run_both(
        "cpu",
        lambda p, g: SGD(p, g, p.backend, schedule, momentum=0.9),
        lambda ps: (
            opt := torch.optim.SGD(ps, lr=0.1, momentum=0.9),
            torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.1),
        ),
    )
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)


def test_bare_step_schedule_decays_after_each_third():
    schedule = make_schedule("step", 1.0, total_steps=9)
    assert [schedule(s) for s in (0, 2, 3, 6)] == pytest.approx([1.0, 1.0, 0.1, 0.01])


@pytest.mark.parametrize("spec", ["linear", "step:0", "step:x", "cosine:3", "step:1:2:3"])
def test_bad_schedules_are_named(spec):
    with pytest.raises(ValueError, match="schedule|step"):
        make_schedule(spec, 0.1, 10)


def test_optimizer_state_round_trips():
    backend = get_backend("cpu")
    params, grads = blocks(backend, np.random.default_rng(0))
    grads.flat[...] = 1.0
    adam = Adam(params, grads, backend)
    adam.step()
    adam.step()
    saved = adam.state_dict()
    other = Adam(params, grads, backend)
    other.load_state_dict(saved, adam.steps_taken)
    np.testing.assert_array_equal(other.state.flat, adam.state.flat)
    assert other.steps_taken == 2
    with pytest.raises(ValueError, match="expects state"):
        SGD(params, grads, backend, momentum=0.9).load_state_dict(saved, 2)

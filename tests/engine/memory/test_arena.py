"""PlannedArena: training tensors at statically planned offsets; what it reserves is the plan, not the sum."""

from __future__ import annotations

import numpy as np
import pytest

from engine.backend import get_backend
from engine.graph import Graph
from engine.layers import Add, BatchNorm2d, Conv2d, Dense, Flatten, MaxPool2d, ReLU
from engine.memory import ArrayType, OutdatedWorkspaceError, WorkspaceError
from engine.memory.arena import PlanMismatchError
from engine.network import PLANNED_TYPES, Network

TYPES = [t.name for t in PLANNED_TYPES]


@pytest.fixture(scope="module")
def backend():
    return get_backend("cpu")


def residual_graph() -> Graph:
    return Graph(
        [
            ("c1", Conv2d(3, 4, 3, 1, 1, bias=False), ["input"]),
            ("bn", BatchNorm2d(4), ["c1"]),
            ("r1", ReLU(), ["bn"]),
            ("c2", Conv2d(4, 4, 3, 1, 1), ["r1"]),
            ("add", Add(), ["c2", "r1"]),
            ("r2", ReLU(), ["add"]),
            ("pool", MaxPool2d(2), ["r2"]),
            ("flat", Flatten(), ["pool"]),
            ("fc", Dense(16, 5), ["flat"]),
        ],
        input_shape=(3, 4, 4),
    )


def batch(n=3):
    rng = np.random.default_rng(0)
    return rng.standard_normal((n, 3, 4, 4)).astype(np.float32), rng.integers(0, 5, n).astype(np.int64)


def step(net, x, y):
    net.forward(x, training=True)
    net.loss(y)
    net.backward()


def test_reserved_bytes_after_three_steps_are_the_plan_not_the_sum(backend):
    net = Network(residual_graph(), backend)
    x, y = batch()
    for _ in range(3):
        step(net, x, y)
    plan = net.arena_plan(3)
    reserved = net.mgr.reserved_bytes_by_type()
    assert sum(reserved.get(t, 0) for t in TYPES) == plan.planned_peak + net.gradients.nbytes  # GRADIENTS: a block
    assert plan.lower_bound <= plan.planned_peak < plan.total_bytes
    assert 0 < net.arena.measured_peak <= plan.lower_bound  # live at once, measured: never more than planned
    in_use = net.mgr.in_use_bytes_by_type()
    assert in_use["ACTIVATION_GRAD"] > 0 and in_use["ACTIVATIONS"] > 0
    net.close()


def test_same_offsets_every_iteration_and_stale_tensors_rejected(backend):
    net = Network(residual_graph(), backend)
    x, y = batch()
    made = []
    create = net.arena.create
    net.arena.create = lambda *a: made.append(create(*a)) or made[-1]
    step(net, x, y)
    first = [(t.offset, t.shape) for t in made]
    old = made[0]
    made.clear()
    step(net, x, y)
    assert [(t.offset, t.shape) for t in made] == first
    assert sorted(first) == sorted((t.offset, t.shape) for t in net.arena.plan.tensors)
    with pytest.raises(WorkspaceError):
        old.check()  # a tensor of the last iteration
    net.close()


def test_a_tensor_used_after_its_planned_lifespan_is_rejected(backend):
    net = Network(residual_graph(), backend)
    x, y = batch()
    net.forward(x, training=True)
    transient = next(t for t in net.arena.plan.tensors if t.name == "add:out")  # only r2's forward reads it
    assert transient.last == net.graph.by_name["r2"].index
    tensors = {}
    create = net.arena.create
    net.end_iteration()

    def recording(array_type, shape, dtype, owner):
        tensor = create(array_type, shape, dtype, owner)
        tensors[(owner, array_type, net.arena._made[owner, array_type] - 1)] = tensor
        return tensor

    net.arena.create = recording
    net.forward(x, training=True)
    with pytest.raises(OutdatedWorkspaceError):
        tensors[(transient.owner, transient.array_type, transient.sequence)].check("test", "add:out")
    net.loss(y)
    net.backward()
    net.close()


def test_a_layer_that_allocates_other_than_the_plan_is_an_error(backend):
    net = Network(residual_graph(), backend)
    x, y = batch()
    step(net, x, y)
    net.arena._plans.clear()
    net.arena._plan_for = lambda batch_size, types: Network.arena_plan(net, batch_size + 1, types)
    with pytest.raises(PlanMismatchError, match="expected"):
        step(net, x, y)
    net.close()


def test_offload_provider_takes_over_in_either_order_and_gives_back(backend):
    class Plain:
        def create(self, array_type, shape, dtype, owner):
            from engine.memory import Tensor

            return Tensor(np.empty(shape, dtype), array_type)

    net = Network(residual_graph(), backend)
    x, y = batch()
    other = Plain()
    saved = {ArrayType.ACTIVATIONS, ArrayType.FF_CACHE}
    net.mgr.set_provider(saved, other)
    step(net, x, y)
    assert net.arena.plan.tensors and {t.array_type for t in net.arena.plan.tensors} == set(PLANNED_TYPES) - saved - {
        ArrayType.GRADIENTS}  # planned only when each layer's gradients live in its backward moment
    net.mgr.set_provider(saved, None)  # detaching gives the types back to the arena
    assert all(net.mgr.provider_for(t) is net.arena for t in PLANNED_TYPES)
    step(net, x, y)
    assert {t.array_type for t in net.arena.plan.tensors} == set(PLANNED_TYPES) - {ArrayType.GRADIENTS}
    # the other order: a provider set first, the arena made the default afterwards, does not displace it
    net.mgr.set_default_provider(PLANNED_TYPES, None)
    net.mgr.set_provider(saved, other)
    net.mgr.set_default_provider(PLANNED_TYPES, net.arena)
    assert net.mgr.provider_for(ArrayType.ACTIVATIONS) is other
    assert net.mgr.provider_for(ArrayType.ACTIVATION_GRAD) is net.arena
    step(net, x, y)
    net.close()


def test_workspace_mode_none_has_no_arena(backend):
    net = Network(residual_graph(), backend, workspace_mode="none")
    x, y = batch()
    step(net, x, y)
    assert net.arena is None and net.mgr.provider_for(ArrayType.ACTIVATIONS) is None
    net.close()


def _base_address(tensor) -> int:
    return tensor.array.__array_interface__["data"][0]


def test_evaluation_runs_in_the_training_arenas_bytes(backend):
    """Between steps the training arena's block is idle: the inference arena borrows it (no block of its
    own, no bytes reserved twice); in a network that has not trained yet it allocates its own, and gives it
    up for the lender's once there is one. Predictions do not depend on where the bytes are."""
    net = Network(residual_graph(), backend)
    fresh = Network(residual_graph(), backend)  # same seed, never trained: its own inference block
    x, y = batch(2)
    assert np.array_equal(net.predict(x), fresh.predict(x))
    assert net.inference_arena.block_allocations == 1 and not net.inference_arena.borrowed
    step(net, x, y)
    fresh.forward(x, training=True)
    fresh.loss(y)
    fresh.backward()
    lender = net.arena
    logits = net.forward(x, training=False)
    inference = net.inference_arena
    assert inference.borrowed and inference.owned_bytes == 0 and inference.block_allocations == 1
    start = _base_address_of_block(lender)
    assert start <= _base_address(logits) < start + lender.capacity  # inside the training arena's block
    assert net.inference_mgr.reserved_bytes_by_type().get("ACTIVATIONS", 0) == 0  # the bytes are the lender's
    net.end_iteration()
    assert np.array_equal(net.predict(x), fresh.predict(x))
    # A training step after evaluation finds its block as it was planned: same weights as the twin.
    step(net, x, y)
    step(fresh, x, y)
    assert np.array_equal(net.parameters.flat, fresh.parameters.flat)
    # An inference output from before the training step is rejected, not read as the step's bytes.
    with pytest.raises(WorkspaceError):
        backend.kernels.relu_forward(logits, logits)


def _base_address_of_block(arena) -> int:
    return arena._block.__array_interface__["data"][0]


def test_an_arena_borrows_only_an_idle_block_large_enough(backend):
    net = Network(residual_graph(), backend)
    x, y = batch(2)
    step(net, x, y)
    inference = net.inference_arena
    net.arena._in_iteration = True  # the lender in an iteration: its bytes are not lent
    try:
        net.inference_arena.start_iteration(2, (ArrayType.ACTIVATIONS,))
        assert not inference.borrowed and inference.owned_bytes == inference.capacity > 0
        inference.end_iteration()
    finally:
        net.arena._in_iteration = False
    allocations = inference.block_allocations
    net.predict(np.concatenate([x] * 40))  # 80 images: more than the training block (2 images) holds
    assert not inference.borrowed and inference.block_allocations == allocations + 1
    net.predict(x)
    assert inference.borrowed

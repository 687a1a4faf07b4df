"""Network: fan-out gradients, hooks, tensor owners, iteration scopes, weights in and out, steady state."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from engine.backend import Backend, get_backend
from engine.graph import Graph
from engine.layers import Add, BatchNorm2d, Conv2d, Dense, Dropout, Flatten, MaxPool2d, ReLU
from engine.memory import ArrayType, Tensor, WorkspaceError
from engine.network import Network
from engine.program import Op
from models import build_model


@pytest.fixture(scope="module")
def backend():
    return get_backend("cpu")


def residual_graph(dropout: float | None = None) -> Graph:
    nodes = [
        ("c1", Conv2d(3, 4, 3, 1, 1, bias=False), ["input"]),
        ("bn", BatchNorm2d(4), ["c1"]),
        ("r1", ReLU(), ["bn"]),
        ("c2", Conv2d(4, 4, 3, 1, 1), ["r1"]),
        ("add", Add(), ["c2", "r1"]),
        ("pool", MaxPool2d(2), ["add"]),
        ("flat", Flatten(), ["pool"]),
    ]
    if dropout is not None:
        nodes.append(("drop", Dropout(dropout), ["flat"]))
    nodes.append(("fc", Dense(16, 5), ["drop" if dropout is not None else "flat"]))
    return Graph(nodes, input_shape=(3, 4, 4))


class ResidualTwin(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 4, 3, 1, 1, bias=False)
        self.bn = nn.BatchNorm2d(4)
        self.c2 = nn.Conv2d(4, 4, 3, 1, 1)
        self.fc = nn.Linear(16, 5)

    def forward(self, x):
        r1 = torch.relu(self.bn(self.c1(x)))
        return self.fc(torch.flatten(nn.functional.max_pool2d(self.c2(r1) + r1, 2), 1))


def batch(seed=0, n=3, shape=(3, 4, 4), classes=5):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, *shape)).astype(np.float32), rng.integers(0, classes, n).astype(np.int64)


def train_step(net, x, y, lr=0.1):
    net.forward(x, training=True)
    loss = net.loss(y)
    net.backward()
    net.parameters.flat[...] -= lr * net.gradients.flat
    return loss


def test_fan_out_gradients_are_summed_like_pytorch(backend):
    net = Network(residual_graph(), backend, seed=3)
    twin = ResidualTwin()
    twin.load_state_dict({k: torch.from_numpy(v) for k, v in net.state_dict().items()})
    x, y = batch()
    logits = backend.to_host(net.forward(x, training=True).array).copy()
    loss = net.loss(y)
    net.backward()
    twin_logits = twin(torch.from_numpy(x))
    twin_loss = nn.functional.cross_entropy(twin_logits, torch.from_numpy(y))
    twin_loss.backward()
    np.testing.assert_allclose(logits, twin_logits.detach().numpy(), rtol=1e-5, atol=1e-6)
    assert loss == pytest.approx(twin_loss.item(), rel=1e-5)
    for name, p in twin.named_parameters():  # c1/bn gradients pass through the fan-out at r1
        np.testing.assert_allclose(net.gradients.views[name], p.grad.numpy(), rtol=1e-4, atol=1e-6, err_msg=name)
    net.close()


class Recorder:
    def __init__(self):
        self.calls = []

    def on_iteration_start(self, net):
        self.calls.append(("start",))

    def before_forward(self, step, node):
        self.calls.append(("before_forward", step, node.name))

    def after_forward(self, step, node):
        self.calls.append(("after_forward", step, node.name))

    def before_backward(self, step, node):
        self.calls.append(("before_backward", step, node.name))

    def after_backward(self, step, node):
        self.calls.append(("after_backward", step, node.name))

    def on_iteration_end(self, net):
        self.calls.append(("end", net.mgr.in_iteration))


class OnlyEnd:
    """A hook may define any subset of the methods."""

    ends = 0

    def on_iteration_end(self, net):
        OnlyEnd.ends += 1


def test_hooks_fire_in_step_order_in_training_only(backend):
    net = Network(residual_graph(), backend)
    recorder = Recorder()
    net.hooks += [recorder, OnlyEnd()]
    x, y = batch()
    train_step(net, x, y)
    names = [n.name for n in net.graph.nodes]
    L = len(names)
    expected = [("start",)]
    for i, name in enumerate(names):
        expected += [("before_forward", i, name), ("after_forward", i, name)]
    for i, name in reversed(list(enumerate(names))):
        expected += [("before_backward", 2 * L - 1 - i, name), ("after_backward", 2 * L - 1 - i, name)]
    expected.append(("end", True))  # the iteration scope is still open for on_iteration_end
    assert recorder.calls == expected
    assert OnlyEnd.ends == 1
    net.predict(x)
    assert len(recorder.calls) == len(expected)  # inference fires no hooks
    net.close()


class RecordingProvider:
    """Takes over ACTIVATIONS and FF_CACHE, as the offload scheduler does, and records who asked."""

    def __init__(self, backend):
        self.backend = backend
        self.created = []

    def create(self, array_type, shape, dtype, owner):
        self.created.append((owner, array_type, tuple(shape), np.dtype(dtype)))
        return Tensor(self.backend.xp.empty(shape, dtype=dtype), array_type)


def test_outputs_and_saved_tensors_are_created_under_their_node_index(backend):
    net = Network(residual_graph(), backend)
    provider = RecordingProvider(backend)
    net.mgr.set_provider({ArrayType.ACTIVATIONS, ArrayType.FF_CACHE}, provider)
    x, y = batch(n=2)
    train_step(net, x, y)
    planned = [
        (t.owner, t.array_type, t.shape, np.dtype(t.dtype))
        for t in net.program(2).buffers
        if t.array_type in (ArrayType.ACTIVATIONS, ArrayType.FF_CACHE)
    ]
    assert provider.created == planned  # same tensors, same owners, same order as the step program
    assert ("pool:argmax", 5) in [(t.name, t.owner) for t in net.program(2).buffers]
    net.close()


class StepClock:
    """Hook that knows the current step; the loss head runs at the last forward step."""

    step = -1

    def before_forward(self, step, node):
        self.step = step

    def before_backward(self, step, node):
        self.step = step


class RecordingKernels:
    """The kernel table, recording for every call which tensors it touched and at which step."""

    def __init__(self, kernels, clock):
        self._kernels, self._clock, self.uses = kernels, clock, []

    def __getattr__(self, op):
        function = getattr(self._kernels, op)

        def call(*args):
            self.uses += [(a, self._clock.step) for a in args if isinstance(a, Tensor)]  # kept alive: ids stay unique
            return function(*args)

        return call


class RecordingBackend:
    def __init__(self, backend, clock):
        self.kernels = RecordingKernels(backend.kernels, clock)
        self.to_host, self.to_device, self.is_device = backend.to_host, backend.to_device, backend.is_device


def test_every_kernel_use_of_a_saved_tensor_lies_inside_its_planned_lifespan(backend):
    """What offload relies on: no kernel reads an ACTIVATIONS or FF_CACHE tensor outside its program span."""
    net = Network(residual_graph(), backend)
    clock = StepClock()
    net.hooks.append(clock)
    provider = RecordingProvider(backend)
    made = []
    provider.create = lambda t, shape, dtype, owner: made.append(Tensor(backend.xp.empty(shape, dtype), t)) or made[-1]
    net.mgr.set_provider({ArrayType.ACTIVATIONS, ArrayType.FF_CACHE}, provider)
    recording = RecordingBackend(backend, clock)
    for node in net.graph.nodes:
        node.layer.backend = recording
    net.backend = net.loss_head.backend = recording
    grads = []
    arena_create = net.arena.create  # the planned arena still provides ACTIVATION_GRAD
    net.arena.create = lambda *args: grads.append(arena_create(*args)) or grads[-1]
    x, y = batch(n=2)
    net.forward(x, training=True)
    net.loss(y)
    clock.step = len(net.graph.nodes)  # the loss head's backward opens the backward: step L
    net.backward()
    planned = [t for t in net.program(2).buffers if t.array_type in (ArrayType.ACTIVATIONS, ArrayType.FF_CACHE)]
    name_of = {id(tensor): spec for tensor, spec in zip(made, planned, strict=True)}
    used: dict[str, list[int]] = {}
    for tensor, step in recording.kernels.uses:
        if id(tensor) in name_of:
            used.setdefault(name_of[id(tensor)].name, []).append(step)
    assert len(used) >= len(planned) - 2  # all but flatten's input and output are seen by the table
    for spec in planned:
        steps = used.get(spec.name, [])
        assert all(spec.first <= s <= spec.last for s in steps), (spec.name, (spec.first, spec.last), steps)
        if spec.array_type is ArrayType.FF_CACHE:  # made in forward, read in backward: exactly its span
            assert (min(steps), max(steps)) == (spec.first, spec.last), spec.name
    # ACTIVATION_GRAD and working memory: every one the step really makes, used exactly within its planned span
    grad_plan = net.arena.plan.tensors
    assert {t.array_type for t in grad_plan} == {ArrayType.ACTIVATION_GRAD, ArrayType.FF_WORKING_MEM,
                                                 ArrayType.BP_WORKING_MEM}
    spec_of = {id(tensor): spec for tensor, spec in zip(grads, grad_plan, strict=True)}
    grad_uses: dict[str, list[int]] = {}
    for tensor, step in recording.kernels.uses:
        if id(tensor) in spec_of:
            grad_uses.setdefault(spec_of[id(tensor)].name, []).append(step)
    for spec in grad_plan:
        steps = grad_uses.get(spec.name, [])
        assert steps and all(spec.first <= s <= spec.last for s in steps), (spec.name, spec.first, spec.last, steps)
        if "flat" not in spec.name:  # Flatten reads and writes gradients outside the kernel table
            assert (min(steps), max(steps)) == (spec.first, spec.last), spec.name  # kept no longer than needed
    net.close()


def test_iteration_scope_spans_forward_to_backward(backend):
    net = Network(residual_graph(), backend)
    x, y = batch()
    logits = net.forward(x, training=True)
    assert net.mgr.in_iteration and logits.is_valid
    net.loss(y)
    net.backward()
    assert not net.mgr.in_iteration
    with pytest.raises(WorkspaceError, match="no longer open"):
        logits.check()  # the logits lived in the closed iteration
    net.close()


def test_a_new_forward_closes_a_scope_left_open_and_errors_close_it(backend):
    net = Network(residual_graph(), backend)
    x, y = batch()
    net.forward(x, training=True)
    train_step(net, x, y)  # forward without backward before: fine
    with pytest.raises(ValueError, match=r"Conv2d 'c1' expects input of shape \(N, 3, H, W\).*\(3, 2, 4, 4\)"):
        net.forward(np.zeros((3, 2, 4, 4), np.float32), training=True)
    assert not net.mgr.in_iteration
    net.close()


def test_backward_and_loss_need_their_predecessors(backend):
    net = Network(residual_graph(), backend)
    x, y = batch()
    with pytest.raises(RuntimeError, match="forward"):
        net.loss(y)
    with pytest.raises(RuntimeError, match="forward"):
        net.backward()
    net.forward(x, training=True)
    with pytest.raises(RuntimeError, match="loss"):
        net.backward()
    net.forward(x, training=False)
    net.loss(y)
    with pytest.raises(RuntimeError, match="training=True"):
        net.backward()
    net.close()


def test_input_must_be_float32_batches(backend):
    net = Network(residual_graph(), backend)
    with pytest.raises(ValueError, match=r"expects input of shape \(N, 3, 4, 4\) float32, got \(3, 3, 4, 4\) float64"):
        net.forward(np.zeros((3, 3, 4, 4)), training=True)
    net.close()


def test_wrong_input_shape_in_a_model_names_the_layer_and_both_shapes(backend):
    net = build_model("cnn", backend=backend)
    with pytest.raises(ValueError, match=r"Conv2d 'conv1' expects input of shape \(N, 3, H, W\).*got \(2, 1, 32, 32\)"):
        net.predict(np.zeros((2, 1, 32, 32), np.float32))
    net.close()


def test_same_seed_same_bits_and_different_seeds_differ(backend):
    x, y = batch()
    runs = []
    for seed in (5, 5, 6):
        net = Network(residual_graph(dropout=0.3), backend, seed=seed)
        for _ in range(2):
            train_step(net, x, y)
        runs.append((net.parameters.flat.copy(), net.buffers.flat.copy()))
        net.close()
    assert np.array_equal(runs[0][0], runs[1][0]) and np.array_equal(runs[0][1], runs[1][1])
    assert not np.array_equal(runs[0][0], runs[2][0])


def test_steady_state_makes_no_block_allocations_and_no_spills(backend):
    net = Network(residual_graph(), backend)
    x, y = batch()
    for _ in range(2):
        train_step(net, x, y)
    allocations, spilled = net.mgr.block_allocations(), net.mgr.spilled_bytes()  # both cumulative
    for _ in range(3):
        train_step(net, x, y)
        assert net.mgr.block_allocations() == allocations
        assert net.mgr.spilled_bytes() == spilled
    out = np.empty((3, 5), np.float32)
    net.predict(x, out=out)
    inference_allocations, spilled = net.inference_mgr.block_allocations(), net.inference_mgr.spilled_bytes()
    for _ in range(3):
        assert net.predict(x, out=out) is out
        assert net.inference_mgr.block_allocations() == inference_allocations
        assert net.inference_mgr.spilled_bytes() == spilled
    net.close()


def test_without_workspaces_the_same_bits(backend):
    x, y = batch()
    results = []
    for mode in ("enabled", "none"):
        net = Network(residual_graph(), backend, seed=4, workspace_mode=mode)
        train_step(net, x, y)
        results.append((net.parameters.flat.copy(), net.predict(x)))
        net.close()
    assert np.array_equal(results[0][0], results[1][0]) and np.array_equal(results[0][1], results[1][1])


class PretendDevice(Backend):
    """NumPy arrays, but treated like a GPU backend's: host batches must be copied in."""

    @property
    def is_device(self):
        return True


def test_host_batches_are_copied_into_the_input_workspace_on_a_device_backend():
    net = Network(residual_graph(), PretendDevice("cpu", np, "kernels.cpu"), seed=1)
    x, y = batch()
    net.forward(x, training=True)
    kept = net.node("c1").layer.saved["x"]
    assert isinstance(kept, Tensor) and kept.array_type is ArrayType.INPUT and np.array_equal(kept.array, x)
    net.loss(y)
    net.backward()
    net.close()


def test_predict_is_inference_and_detached(backend):
    net = Network(residual_graph(dropout=0.5), backend)
    x, _ = batch()
    first = net.predict(x)
    assert isinstance(first, np.ndarray) and first.shape == (3, 5)
    assert np.array_equal(net.predict(x), first)  # dropout off, running statistics untouched
    assert net.node("bn").layer.num_batches_tracked == 0
    net.close()


def test_state_dict_round_trip(backend):
    net = Network(residual_graph(), backend, seed=1)
    x, y = batch()
    train_step(net, x, y)
    state = net.state_dict()
    assert list(state) == [
        "c1.weight",
        "bn.weight",
        "bn.bias",
        "bn.running_mean",
        "bn.running_var",
        "bn.num_batches_tracked",
        "c2.weight",
        "c2.bias",
        "fc.weight",
        "fc.bias",
    ]
    assert state["bn.num_batches_tracked"].dtype == np.int64 and int(state["bn.num_batches_tracked"]) == 1
    assert all(v.dtype == np.float32 for k, v in state.items() if not k.endswith("num_batches_tracked"))
    other = Network(residual_graph(), backend, seed=2)
    assert other.load_state_dict(state) == ([], [])
    assert np.array_equal(other.predict(x), net.predict(x))
    assert other.node("bn").layer.num_batches_tracked == 1
    without_counter = {k: v for k, v in state.items() if k != "bn.num_batches_tracked"}
    assert other.load_state_dict(without_counter).missing_keys == []  # the counter is optional
    net.close()
    other.close()


def test_load_state_dict_lists_every_problem_and_changes_nothing(backend):
    net = Network(residual_graph(), backend)
    before = net.parameters.flat.copy()
    state = net.state_dict()
    del state["c1.weight"], state["fc.bias"]
    state["c2.weight"] = np.zeros((4, 4, 1, 1), np.float32)
    state["extra.weight"] = np.zeros(3, np.float32)
    with pytest.raises(ValueError) as error:
        net.load_state_dict(state)
    message = str(error.value)
    for expected in ("missing keys (2): c1.weight, fc.bias", "unexpected keys (1): extra.weight"):
        assert expected in message
    assert "c2.weight: expected (4, 4, 3, 3), got (4, 4, 1, 1)" in message
    assert np.array_equal(net.parameters.flat, before)
    del state["c2.weight"]
    result = net.load_state_dict(state, strict=False)
    assert result.missing_keys == ["c1.weight", "c2.weight", "fc.bias"] and result.unexpected_keys == ["extra.weight"]
    net.close()


def test_memory_report(backend):
    net = build_model("cnn", backend=backend)
    report = net.memory_report(batch_size=8)
    assert [r.name for r in report.rows] == [n.name for n in net.graph.nodes]
    assert sum(r.parameter_bytes for r in report.rows) == report.parameter_bytes == net.parameters.flat.nbytes
    conv2 = next(r for r in report.rows if r.name == "conv2")
    assert conv2.saved_bytes == 8 * 16 * 16 * 16 * 4  # its input, kept for the weight gradient
    bn1 = next(r for r in report.rows if r.name == "bn1")
    assert bn1.saved_bytes == 8 * 16 * 32 * 32 * 4 + 16 * 4  # output (In-Place ABN) + 1/std
    kernels = backend.kernels
    geometry = ((8, 16, 16, 16), (32, 16, 3, 3), 1, 1, 1)
    backward = max(kernels.conv2d_backward_data_workspace_size(*geometry),  # one scratch, used in turn
                   kernels.conv2d_backward_weight_workspace_size(*geometry))
    assert conv2.working_bytes == 4 * max(kernels.conv2d_forward_workspace_size(*geometry), backward)
    long_lived = report.parameter_bytes + report.gradient_bytes + report.buffer_bytes
    assert report.planned_peak_bytes == long_lived + report.iteration_peak_bytes
    assert sum(report.by_type_at_peak.values()) == report.iteration_peak_bytes
    assert report.as_dict()["rows"][0]["name"] == "conv1"
    x = np.random.default_rng(0).standard_normal((8, *net.graph.input_shape), dtype=np.float32)
    net.forward(backend.to_device(x), training=True)
    net.loss(np.zeros(8, np.int64))
    net.backward()  # a conv's two backward kernels share one scratch: the larger size, not the sum
    # one step's scratch at a time: the largest backward scratch (the 3-channel stem's weight gradient on
    # im2col since v11; before it conv2's), each a conv's one buffer for both backward kernels
    largest = max(r.working_bytes for r in report.rows if r.kind == "Conv2d")
    assert net.mgr.in_use_bytes_by_type()["BP_WORKING_MEM"] == largest == max(
        s.scratch_bytes for s in net.program(8).steps if s.op is Op.BACKWARD)
    net.close()


@pytest.mark.parametrize("model", ["resnet18", "mobilenetv2"])
def test_inference_places_outputs_by_lifespan_and_matches_unmanaged(model):
    """Inference outputs go to a planned arena (a few alive at once), bit for bit what unmanaged memory gives;
    MobileNetV2's Dropout passes its input on in inference, so that tensor must live through its consumer."""
    cpu = get_backend("cpu")
    planned = build_model(model, num_classes=10, backend=cpu, image_size=8)
    plain = build_model(model, num_classes=10, backend=cpu, image_size=8, workspace_mode="none")
    x = np.random.default_rng(0).standard_normal((4, 3, 8, 8)).astype(np.float32)
    for _ in range(2):  # the second batch reuses the arena
        np.testing.assert_array_equal(planned.predict(x), plain.predict(x))
    plan = planned.inference_plan(4)
    everything = sum(t.nbytes for t in plan.tensors)
    assert plan.planned_peak < everything / 4
    reserved = planned.inference_mgr.reserved_bytes_by_type()
    assert reserved["ACTIVATIONS"] + reserved["FF_WORKING_MEM"] == plan.planned_peak  # working memory planned too
    working = {t.owner for t in plan.tensors if t.array_type is ArrayType.FF_WORKING_MEM}
    kinds = {type(planned.graph.nodes[i].layer).__name__ for i in working}
    assert "Conv2d" in kinds and "BatchNorm2d" not in kinds  # inference batch norm takes no batch mean


def test_the_inference_plan_keeps_a_passed_on_tensor_alive_for_its_readers():
    net = build_model("mobilenetv2", num_classes=10, backend=get_backend("cpu"), image_size=8)
    specs = {t.owner: t for t in net.inference_plan(2).tensors}
    dropout = next(n for n in net.graph.nodes if n.layer.inference_passes_input)
    assert dropout.index not in specs
    source = dropout.inputs[0]
    assert specs[source].last >= max(dropout.consumers)
    assert specs[net.graph.output.index].last == len(net.graph.nodes)  # the logits outlive the last step

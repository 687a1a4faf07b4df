"""The step program: what it says of a residual graph, and that every model's real step does exactly that."""

from __future__ import annotations

import numpy as np
import pytest

from engine.backend import get_backend
from engine.graph import Graph
from engine.layers import Add, BatchNorm2d, Conv2d, Dense, Dropout, Flatten, LeakyReLU, MaxPool2d, ReLU
from engine.memory import ArrayType, Tensor
from engine.network import PLANNED_TYPES, Network, ProgramMismatchError
from engine.offload import OffloadScheduler
from engine.optim import SGD
from engine.program import Op
from models import MODEL_NAMES, build_model

# Small enough to run a real step of every model in a second or two (2 cores).
OPTIONS = {"resnet18": {"image_size": 8}, "mobilenetv2": {"image_size": 8}, "cnn": {"image_size": 8, "width": 2},
           "mlp": {"input_shape": (3, 4, 4), "hidden": 8}}


@pytest.fixture(scope="module")
def backend():
    return get_backend("cpu")


def residual_graph(dropout: bool = False) -> Graph:
    """c1 -> bn -> r1 -> c2 -> add(c2, r1) -> pool -> flat [-> drop] -> fc: a skip connection around c2."""
    nodes = [
        ("c1", Conv2d(3, 4, 3, 1, 1, bias=False), ["input"]),
        ("bn", BatchNorm2d(4), ["c1"]),
        ("r1", ReLU(), ["bn"]),
        ("c2", Conv2d(4, 4, 3, 1, 1), ["r1"]),
        ("add", Add(), ["c2", "r1"]),
        ("pool", MaxPool2d(2), ["add"]),
        ("flat", Flatten(), ["pool"]),
    ]
    if dropout:
        nodes.append(("drop", Dropout(0.5), ["flat"]))
    nodes.append(("fc", Dense(16, 5), ["drop" if dropout else "flat"]))
    return Graph(nodes, input_shape=(3, 4, 4))


def test_lifespans_of_a_residual_graph(backend):
    # L = 8 nodes: forward of node i is moment i, backward of node i is moment 15 - i.
    program = Network(residual_graph(), backend).program(2)
    assert {b.name: (b.first, b.last) for b in program.buffers} == {
        "input": (0, 15),  # c1 keeps its input until its backward
        "c1:out": (0, 1),  # bn keeps its output, not its input (In-Place ABN)
        "bn:out": (1, 14),
        "bn:save_invstd": (1, 14),
        "r1:out": (2, 13),  # read by c2 (kept to moment 12) and add; r1's own backward reads it at 13
        "c2:out": (3, 4),
        "add:out": (4, 5),
        "pool:out": (5, 6),
        "pool:argmax": (5, 10),
        "flat:out": (6, 8),  # fc keeps its input until its backward (moment 8)
        "fc:out": (7, 8),  # the logits: held for the caller until the loss backward
        "loss:probs": (7, 8),
        "loss:value": (7, 8),
        "fc:grad": (8, 8),  # made by the loss head
        "flat:grad@fc": (8, 9),
        "pool:grad@flat": (9, 10),
        "add:grad@pool": (10, 14),  # Add hands it to both inputs: c2's backward reads it, r1's contribution
        "r1:grad@c2": (12, 12),  # from c2 is added into it (12), r1 writes its gradient over it (13), bn reads it
        "c1:grad@bn": (14, 15),  # the network input needs no gradient: c1 makes none
    }
    by_name = {b.name: b for b in program.buffers}
    argmax = by_name["pool:argmax"]
    assert (argmax.owner, argmax.array_type, argmax.shape, argmax.dtype) == (5, ArrayType.FF_CACHE, (2, 4, 2, 2),
                                                                             np.uint8)  # the place in the window
    assert argmax.nbytes == 2 * 4 * 2 * 2
    steps = {(s.op, s.node): s for s in program.steps}
    add, relu = steps[(Op.BACKWARD, 4)], steps[(Op.BACKWARD, 2)]
    grad = by_name["add:grad@pool"].id
    assert add.results == (grad, grad) and add.aliases == (grad,) and not add.creates
    assert relu.reuse_dout and relu.writes == (grad,) and relu.results == (grad,)
    summed = steps[(Op.GRAD_SUM, 3)]
    assert summed.time == 12 and summed.inputs == (grad, by_name["r1:grad@c2"].id) and summed.closes
    assert summed.writes == summed.results == summed.aliases == (grad,) and not summed.creates  # over the earlier
    assert not steps[(Op.BACKWARD, 3)].closes  # the sum runs in c2's moment and scope
    bn = steps[(Op.BACKWARD, 1)]
    assert [program.buffers[i].name for i in bn.reads] == ["add:grad@pool", "bn:out", "bn:save_invstd"]


def test_a_sum_whose_earlier_gradient_is_another_inputs_makes_a_new_buffer(backend):
    # add(r, r): Add hands its dout to both inputs, which are one node: the second contribution is the first's
    # buffer itself, so the sum cannot go over it; a new buffer, and the step's result is right
    graph = Graph([("c", Conv2d(3, 2, 3, 1, 1), ["input"]), ("r", ReLU(), ["c"]), ("add", Add(), ["r", "r"]),
                   ("flat", Flatten(), ["add"]), ("fc", Dense(32, 3), ["flat"])], input_shape=(3, 4, 4))
    net = Network(graph, backend)
    program = net.program(2)
    summed = [s for s in program.steps if s.op is Op.GRAD_SUM]
    assert len(summed) == 1 and [program.buffers[i].name for i in summed[0].creates] == ["r:grad_sum@add"]
    x = np.random.default_rng(1).standard_normal((2, 3, 4, 4)).astype(np.float32)
    net.forward(x, training=True)
    net.loss(np.array([0, 2]))
    net.backward()
    import torch
    c, fc = graph.nodes[0].layer, graph.nodes[4].layer
    xt = torch.tensor(x)
    w = torch.tensor(np.array(c.params["weight"]), requires_grad=True)
    r = torch.relu(torch.nn.functional.conv2d(xt, w, torch.tensor(np.array(c.params["bias"])), padding=1))
    logits = (r + r).flatten(1) @ torch.tensor(np.array(fc.params["weight"])).T + torch.tensor(
        np.array(fc.params["bias"]))
    torch.nn.functional.cross_entropy(logits, torch.tensor([0, 2])).backward()
    np.testing.assert_allclose(np.array(c.grads["weight"]), w.grad.numpy(), rtol=1e-5, atol=1e-6)
    net.close()


def test_inference_program_is_forwards_only_and_dropout_hands_its_input_on(backend):
    net = Network(residual_graph(dropout=True), backend)
    program = net.program(2, training=False)
    assert [s.op for s in program.steps] == [Op.FORWARD] * 9
    assert {b.array_type for b in program.buffers} == {ArrayType.INPUT, ArrayType.ACTIVATIONS}
    drop = program.steps[7]
    assert not drop.creates and drop.aliases == drop.inputs == drop.results
    training = net.program(2)
    assert training.steps[7].creates and len(training.steps) > len(program.steps)
    x = np.random.default_rng(0).standard_normal((2, 3, 4, 4)).astype(np.float32)
    assert net.predict(x).shape == (2, 5)
    net.close()


def test_a_layer_that_breaks_its_aliasing_declaration_is_caught(backend):
    class CopyingAdd(Add):  # declares PASS_THROUGH, but hands back copies
        def backward(self, dout, need_input_grads, reuse_dout=False):
            return [self.input_grad(dout.shape) if need else None for need in need_input_grads]

    graph = residual_graph()
    graph.nodes[4].layer.__class__ = CopyingAdd
    net = Network(graph, backend, workspace_mode="none")
    rng = np.random.default_rng(0)
    net.forward(rng.standard_normal((2, 3, 4, 4)).astype(np.float32), training=True)
    net.loss(np.array([0, 1]))
    with pytest.raises(ProgramMismatchError, match="hand on add:grad@pool itself"):
        net.backward()
    net.close()


def test_the_program_table_names_every_step(backend):
    program = Network(residual_graph(), backend).program(2)
    table = program.table()
    assert "r1:grad@c2 ACTIVATION_GRAD 2×4×4×4" in table and "over add:grad@pool" in table
    assert "→ add:grad@pool" in table and "(held) fc:out" in table
    assert f"{len(program.steps)} steps, {len(program.buffers)} buffers" in table


class Clock:
    """A network hook that knows the moment (the loss head's forward runs in moment L-1)."""

    moment = -1

    def before_forward(self, step, node):
        self.moment = step

    def before_backward(self, step, node):
        self.moment = step


class RecordingKernels:
    """The kernel table, recording which tensors each call touched and at which moment."""

    def __init__(self, kernels, clock):
        self._kernels, self._clock, self.uses = kernels, clock, []

    def __getattr__(self, op):
        function = getattr(self._kernels, op)

        def call(*args):
            self.uses += [(a, self._clock.moment, op) for a in args if isinstance(a, Tensor)]  # kept: ids stay unique
            return function(*args)

        return call


class RecordingBackend:
    def __init__(self, backend, clock):
        self.kernels = RecordingKernels(backend.kernels, clock)
        self.to_host, self.to_device, self.is_device = backend.to_host, backend.to_device, backend.is_device


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_every_models_real_step_does_what_its_program_says(backend, name):
    """The program and the execution side by side: the same tensors created in the same order by the same
    owners, each kernel touching a tensor only at a moment the program lists for it, and the arena's
    offsets are the program's plan."""
    net = build_model(name, 3, backend, **OPTIONS.get(name, {}))
    batch = 2
    program = net.program(batch)
    clock = Clock()
    net.hooks.append(clock)
    recording = RecordingBackend(backend, clock)
    for node in net.graph.nodes:
        node.layer.backend = recording
    net.backend = net.loss_head.backend = recording
    made: list[tuple] = []
    create = net.arena.create
    net.arena.create = lambda *args: made.append((args, create(*args))) or made[-1][1]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, *net.graph.input_shape)).astype(np.float32)
    net.forward(x, training=True)
    net.loss(np.arange(batch) % 3)
    clock.moment = len(net.graph.nodes)  # the loss head's backward opens moment L
    net.backward()

    working = (ArrayType.FF_WORKING_MEM, ArrayType.BP_WORKING_MEM)
    scratch = [(a[3], a[0], tuple(a[1])) for a, _ in made if a[0] in working]
    assert scratch == [(s.node, working[s.op is not Op.FORWARD], (s.scratch_bytes // 4,))  # one per step that needs it
                       for s in program.steps if s.scratch_bytes]
    made = [(a, tensor) for a, tensor in made if a[0] not in working]
    planned = [program.buffers[i] for s in program.steps for i in s.creates
               if program.buffers[i].array_type in PLANNED_TYPES]
    assert [(a[3], a[0], tuple(a[1]), np.dtype(a[2])) for a, _ in made] == [
        (b.owner, b.array_type, b.shape, b.dtype) for b in planned]
    buffer_of = {id(tensor): b for (_, tensor), b in zip(made, planned)}
    seen: dict[int, set[int]] = {}
    for tensor, moment, op in recording.kernels.uses:
        b = buffer_of.get(id(tensor))
        if b is None:
            continue  # the input, labels, parameters, working memory
        assert moment == b.first or moment in b.uses, (b.name, moment, op, b.first, b.uses)
        seen.setdefault(b.id, set()).add(moment)
    for b in planned:
        if b.array_type is ArrayType.FF_CACHE:  # made in forward, read by its node's backward and nothing else
            assert seen[b.id] == {b.first, *b.uses}, b.name
    assert len(seen) >= 0.9 * len(planned)  # Flatten and the loss value are read outside the kernel table
    offsets = {(t.owner, t.array_type, t.sequence): t.offset for t in net.arena.plan.tensors}
    counts: dict = {}
    for args, tensor in made:
        sequence = counts[args[3], args[0]] = counts.get((args[3], args[0]), -1) + 1
        assert tensor.offset == offsets[(args[3], args[0], sequence)]
    net.close()


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_every_models_inference_creates_what_its_program_says(backend, name):
    net = build_model(name, 3, backend, **OPTIONS.get(name, {}))
    program = net.program(2, training=False)
    mgr = net.inference_mgr
    made = []
    create = mgr.create

    def recording(array_type, shape, dtype=np.float32):
        if array_type is ArrayType.ACTIVATIONS:
            made.append((mgr.owner, tuple(shape) if not isinstance(shape, int) else (shape,)))
        return create(array_type, shape, dtype)

    mgr.create = recording
    x = np.random.default_rng(0).standard_normal((2, *net.graph.input_shape)).astype(np.float32)
    net.predict(x)
    assert made == [(program.buffers[i].owner, program.buffers[i].shape) for s in program.steps for i in s.creates]
    net.close()


def leaky_graph() -> Graph:
    """A residual net of LeakyReLUs, the layer added with nothing but its kernels and declarations."""
    return Graph(
        [
            ("c1", Conv2d(3, 4, 3, 1, 1, bias=False), ["input"]),
            ("bn", BatchNorm2d(4), ["c1"]),
            ("a1", LeakyReLU(0.1), ["bn"]),
            ("c2", Conv2d(4, 4, 3, 1, 1), ["a1"]),
            ("add", Add(), ["c2", "a1"]),
            ("a2", LeakyReLU(0.2), ["add"]),
            ("pool", MaxPool2d(2), ["a2"]),
            ("flat", Flatten(), ["pool"]),
            ("fc", Dense(16, 5), ["flat"]),
        ],
        input_shape=(3, 4, 4),
    )


def test_a_new_layer_type_needs_only_its_kernels_and_declarations(backend, tmp_path):
    """LeakyReLU through the program, the planned arena and offload (window 1: every unit written and read
    back): the same weights to the bit as without offload, and its gradient written over dout as declared."""
    program = Network(leaky_graph(), backend).program(2)
    a1 = next(s for s in program.steps if s.op is Op.BACKWARD and s.node == 2)
    assert a1.reuse_dout and a1.writes == a1.inputs and not a1.creates

    def train(window):
        net = Network(leaky_graph(), backend, seed=0)
        optimizer = SGD(net.parameters, net.gradients, backend, lr=0.1, momentum=0.9)
        scheduler = OffloadScheduler(backend, window, directory=str(tmp_path)).attach(net) if window else None
        rng = np.random.default_rng(1)
        try:
            for _ in range(3):
                net.forward(rng.standard_normal((2, 3, 4, 4)).astype(np.float32), training=True)
                net.loss(rng.integers(0, 5, 2).astype(np.int64))
                net.backward()
                optimizer.step()
            written = sum(s.bytes_written for s in scheduler.stats) if scheduler else 0
            return net.state_dict(), written
        finally:
            if scheduler is not None:
                scheduler.close()
            net.close()

    reference, _ = train(None)
    weights, written = train(1)
    assert written > 0
    for key, value in reference.items():
        assert np.array_equal(value, weights[key]), key

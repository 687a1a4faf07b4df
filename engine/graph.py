"""The graph: layers wired as a DAG, one execution order, and how long every tensor lives in it.

A model declares nodes by name with the names of their inputs (``"input"`` is the network input);
``Graph`` sorts them topologically (Kahn's algorithm, ties broken by declaration order, so the order
is the one a reader expects) and numbers them ``0..L-1`` in that order: ``node.index``.

**Steps.** A training iteration runs ``2L`` steps: forward of node ``i`` is step ``i``; backward of
node ``i`` is step ``2L-1-i`` (backward runs in reverse order). The loss head runs between step
``L-1`` and step ``L``.

**Tensors and lifespans.** ``graph.tensors(batch_size)`` lists every tensor an iteration creates,
with the node whose ``mgr.layer(...)`` scope creates it (``owner``, the same number the workspace
manager sees as ``mgr.owner``), its ArrayType, shape, and the first and last step that use it:

- ``<node>:out``, ACTIVATIONS, owner ``i``: made at step ``i``; read by each consumer's forward,
  by the consumer's backward when the consumer keeps its input (Conv2d, BatchNorm2d, Dense), and by
  the node's own backward when it keeps its output (ReLU).
- ``<node>:<saved>``, FF_CACHE, owner ``i``: what the layer keeps (batch-norm statistics, argmax,
  dropout mask), live from step ``i`` to step ``2L-1-i``. A layer creates its output first, then
  its saved tensors in ``saved_specs`` order.
- ``<node>:grad``, ACTIVATION_GRAD, the gradient of the node's output: made by the backward of its
  last consumer (owner = that consumer; None for the output node, whose gradient the loss makes),
  read by the node's backward at step ``2L-1-i``. Where a tensor fans out, the contributions are
  summed with the ``add`` kernel into a new tensor at the later consumer's step.
- ``input`` (INPUT, owner None) and the loss head's ``loss:probs`` and ``loss:value`` (ACTIVATIONS,
  owner None: the loss runs outside any layer scope).

``graph.lifespans()`` gives name → ``(first, last)``: what an offload scheduler needs to know which
tensors a window of steps touches, and what a memory planner needs to share memory between tensors
that are never alive together. Grad tensors are logical: Add hands one gradient to both inputs
without a copy, so real usage is at most the plan's.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from engine.layers.base import Layer, Shape, nbytes
from engine.memory import ArrayType

GRAPH_INPUT = -1
"""The index ``node.inputs`` uses for the network input."""

INPUT_NAME = "input"


@dataclass
class Node:
    """One layer in the graph. ``inputs`` are node indices (GRAPH_INPUT for the network input)."""

    index: int
    name: str
    layer: Layer
    inputs: tuple[int, ...]
    consumers: tuple[int, ...] = field(default=())

    @property
    def forward_step(self) -> int:
        return self.index

    def __repr__(self) -> str:
        return f"Node({self.index}, {self.name!r}, {type(self.layer).__name__}, inputs={self.inputs})"


class Lifespan(NamedTuple):
    first: int
    last: int


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of an iteration: who makes it, what it is, how big, and when it is alive."""

    name: str
    owner: int | None
    array_type: ArrayType
    shape: Shape
    dtype: Any
    first: int
    last: int

    @property
    def nbytes(self) -> int:
        return nbytes(self.shape, self.dtype)


class Graph:
    """A DAG of layers with a topological order; built from ``(name, layer, input_names)`` triples."""

    def __init__(self, declarations: Iterable[tuple[str, Layer, list[str] | tuple[str, ...]]], input_shape: Shape):
        """``input_shape`` is one sample's shape (C, H, W) or (features,): it sizes the memory plan."""
        declared = list(declarations)
        if not declared:
            raise ValueError("a graph needs at least one node")
        names = [name for name, _, _ in declared]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"duplicate node names: {', '.join(duplicates)}")
        if INPUT_NAME in names:
            raise ValueError(f"{INPUT_NAME!r} is reserved for the network input")
        shared = sorted({name for name, layer, _ in declared if sum(layer is other for _, other, _ in declared) > 1})
        if shared:  # one layer in two places would share weights: two gradient contributions, one name
            raise ValueError(f"nodes {', '.join(shared)} use the same layer object: give each node its own layer")
        known = set(names) | {INPUT_NAME}
        for name, layer, inputs in declared:
            unknown = [i for i in inputs if i not in known]
            if unknown:
                raise ValueError(f"node {name!r} reads unknown node(s) {unknown}; known: {sorted(known)}")
            if len(inputs) != layer.num_inputs:
                raise ValueError(
                    f"node {name!r}: {type(layer).__name__} takes {layer.num_inputs} input(s), got {inputs}"
                )

        order = _topological_order(names, {name: list(inputs) for name, _, inputs in declared})
        position = {name: i for i, name in enumerate(order)}
        by_name = {name: (layer, inputs) for name, layer, inputs in declared}
        self.nodes: list[Node] = []
        for i, name in enumerate(order):
            layer, inputs = by_name[name]
            layer.name = name
            self.nodes.append(
                Node(i, name, layer, tuple(GRAPH_INPUT if n == INPUT_NAME else position[n] for n in inputs))
            )
        consumers: dict[int, list[int]] = {i: [] for i in range(-1, len(self.nodes))}
        for node in self.nodes:
            for source in node.inputs:
                consumers[source].append(node.index)
        for node in self.nodes:
            node.consumers = tuple(consumers[node.index])
        self.input_consumers = tuple(consumers[GRAPH_INPUT])
        self.output = self.nodes[-1]
        dangling = [n.name for n in self.nodes[:-1] if not n.consumers]
        if dangling:
            raise ValueError(
                f"node(s) {dangling} feed nothing: every node must lead to the output {self.output.name!r}"
            )
        if not self.input_consumers:
            raise ValueError("no node reads the network input")
        self.input_shape = tuple(input_shape)
        self.by_name = {node.name: node for node in self.nodes}

    def __len__(self) -> int:
        return len(self.nodes)

    def backward_step(self, node: Node) -> int:
        return 2 * len(self.nodes) - 1 - node.index

    def shapes(self, batch_size: int) -> dict[int, Shape]:
        """Each node's output shape (and GRAPH_INPUT's) for a batch; raises the first layer's shape error."""
        shapes: dict[int, Shape] = {GRAPH_INPUT: (batch_size, *self.input_shape)}
        for node in self.nodes:
            shapes[node.index] = tuple(node.layer.output_shape([shapes[i] for i in node.inputs]))
        return shapes

    def tensors(self, batch_size: int = 1) -> list[TensorSpec]:
        """Every tensor of one training iteration, with owner, type, shape and lifespan (module docstring)."""
        L = len(self.nodes)
        shapes = self.shapes(batch_size)
        specs: list[TensorSpec] = []

        def output_uses(source: int) -> list[int]:
            uses = []
            for c in self.input_consumers if source == GRAPH_INPUT else self.nodes[source].consumers:
                uses.append(c)
                if self.nodes[c].layer.keeps_input:
                    uses.append(2 * L - 1 - c)
            return uses

        input_uses = output_uses(GRAPH_INPUT)
        specs.append(TensorSpec(INPUT_NAME, None, ArrayType.INPUT, shapes[GRAPH_INPUT], np.float32, 0, max(input_uses)))
        for node in self.nodes:
            i = node.index
            uses = [i, *output_uses(i)]
            if node.layer.keeps_output:
                uses.append(2 * L - 1 - i)
            specs.append(TensorSpec(f"{node.name}:out", i, ArrayType.ACTIVATIONS, shapes[i], np.float32, i, max(uses)))
            for saved in node.layer.saved_specs([shapes[s] for s in node.inputs]):
                specs.append(
                    TensorSpec(
                        f"{node.name}:{saved.name}", i, ArrayType.FF_CACHE, saved.shape, saved.dtype, i, 2 * L - 1 - i
                    )
                )
        out = self.output
        specs.append(TensorSpec("loss:probs", None, ArrayType.ACTIVATIONS, shapes[out.index], np.float32, L - 1, L))
        specs.append(TensorSpec("loss:value", None, ArrayType.ACTIVATIONS, (1,), np.float32, L - 1, L - 1))
        for node in reversed(self.nodes):
            i = node.index
            if node.consumers:
                last_consumer = max(node.consumers)
                owner, first = last_consumer, 2 * L - 1 - last_consumer
            else:
                owner, first = None, L
            specs.append(
                TensorSpec(
                    f"{node.name}:grad", owner, ArrayType.ACTIVATION_GRAD, shapes[i], np.float32, first, 2 * L - 1 - i
                )
            )
        return specs

    def allocations(self, batch_size: int = 1) -> list[TensorSpec]:
        """The ACTIVATIONS, FF_CACHE and ACTIVATION_GRAD tensors a training iteration really allocates,
        in creation order, with the steps they really live: what the planned arena places.

        Unlike ``tensors`` (one logical gradient per node), this follows ``Network.backward`` tensor by
        tensor, as each layer declares in ``input_gradients`` (a new gradient per input asked for; one
        even when none is (BatchNorm2d); ``dout`` handed on (Add); ``dout`` written over when nothing
        else reads it (ReLU)), a fan-out sums into a new tensor (``<node>:grad_sum@<consumer>``); a
        gradient lives until its last reader, through every tensor that aliases it. The logits live
        until the loss head's backward (step ``L``), as do the loss head's tensors. ``Network`` checks
        every step that the layers did what this says.
        """
        from engine.layers.base import InputGradients

        L = len(self.nodes)
        shapes = self.shapes(batch_size)
        made: list[TensorSpec] = []
        for t in self.tensors(batch_size):
            if t.array_type in (ArrayType.ACTIVATIONS, ArrayType.FF_CACHE):
                last = max(t.last, L) if t.owner == self.output.index or t.owner is None else t.last
                made.append(TensorSpec(t.name, t.owner, t.array_type, t.shape, t.dtype, t.first, last))

        class Grad:  # one gradient buffer while the simulation runs
            def __init__(self, name: str, owner: int | None, shape: Shape, step: int):
                self.name, self.owner, self.shape, self.first, self.last = name, owner, shape, step, step

        buffers: list[Grad] = []

        def new(name: str, owner: int | None, shape: Shape, step: int) -> Grad:
            buffers.append(Grad(name, owner, shape, step))
            return buffers[-1]

        out = self.output
        grads: dict[int, Grad] = {out.index: new(f"{out.name}:grad", None, shapes[out.index], L)}  # the loss
        for node in reversed(self.nodes):
            step = 2 * L - 1 - node.index
            dout = grads.pop(node.index)
            dout.last = step
            reuse_dout = all(other is not dout for other in grads.values())
            results: list[Grad | None] = []
            for source in node.inputs:
                needed = source != GRAPH_INPUT
                name = f"{'input' if source == GRAPH_INPUT else self.nodes[source].name}:grad@{node.name}"
                policy = node.layer.input_gradients
                if policy is InputGradients.PASS_THROUGH:
                    results.append(dout if needed else None)
                elif policy is InputGradients.OVER_DOUT and needed and reuse_dout:
                    results.append(dout)
                elif needed or policy is InputGradients.ALWAYS_NEW:
                    results.append(new(name, node.index, shapes[source], step))
                else:
                    results.append(None)
            for source, dx in zip(node.inputs, results):
                if source == GRAPH_INPUT or dx is None:
                    continue
                if source in grads:  # a fan-out: both contributions are read by the add into a new tensor
                    grads[source].last = dx.last = step
                    grads[source] = new(f"{self.nodes[source].name}:grad_sum@{node.name}", node.index,
                                        shapes[source], step)
                else:
                    grads[source] = dx
        for g in buffers:
            made.append(TensorSpec(g.name, g.owner, ArrayType.ACTIVATION_GRAD, tuple(g.shape), np.float32,
                                   g.first, g.last))
        return made

    def inference_allocations(self, batch_size: int = 1) -> list[TensorSpec]:
        """The ACTIVATIONS an inference forward allocates (one output per node, none for a layer that
        ``inference_passes_input``), each living from its node's step to its last reader's, through
        the nodes that pass it on; the logits live to step ``L`` (read after the last node).

        Why: inference used to keep every output of a batch in one bump workspace (248.1 MiB for
        ResNet-18 at batch 32, the evaluation's whole excess over the training steps' RSS); placed by
        these lifespans the same batch needs the few outputs alive at once.
        """
        L = len(self.nodes)
        shapes = self.shapes(batch_size)
        holder = {GRAPH_INPUT: GRAPH_INPUT}  # node -> the node whose tensor its output is
        last: dict[int, int] = {}
        for node in self.nodes:
            for source in node.inputs:
                owner = holder[source]
                last[owner] = max(last.get(owner, -1), node.index)
            holder[node.index] = holder[node.inputs[0]] if node.layer.inference_passes_input else node.index
        last[holder[self.output.index]] = L
        made = [TensorSpec(f"{node.name}:out", node.index, ArrayType.ACTIVATIONS, shapes[node.index], np.float32,
                           node.index, max(last.get(node.index, node.index), node.index))
                for node in self.nodes if not node.layer.inference_passes_input]
        # the loss head, when a loss is asked for after an inference forward (owner None, as in training)
        made += [TensorSpec(t.name, None, t.array_type, t.shape, t.dtype, t.first, L)
                 for t in self.tensors(batch_size) if t.owner is None and t.array_type is ArrayType.ACTIVATIONS]
        return made

    def lifespans(self) -> dict[str, Lifespan]:
        """Tensor name → (first step, last step); steps 0..L-1 forward, L..2L-1 backward."""
        return {t.name: Lifespan(t.first, t.last) for t in self.tensors(1)}


def _topological_order(names: list[str], inputs: dict[str, list[str]]) -> list[str]:
    """Kahn's algorithm; among nodes ready at once, the one declared first goes first. Raises on a cycle."""
    declared_at = {name: i for i, name in enumerate(names)}
    waiting = {name: sum(1 for i in inputs[name] if i != INPUT_NAME) for name in names}
    readers: dict[str, list[str]] = {name: [] for name in names}
    for name in names:
        for source in inputs[name]:
            if source != INPUT_NAME:
                readers[source].append(name)
    ready = sorted((n for n in names if waiting[n] == 0), key=declared_at.__getitem__)
    order = []
    while ready:
        name = ready.pop(0)
        order.append(name)
        for reader in readers[name]:
            waiting[reader] -= 1
            if waiting[reader] == 0:
                ready.append(reader)
        ready.sort(key=declared_at.__getitem__)
    if len(order) != len(names):
        stuck = sorted(set(names) - set(order), key=declared_at.__getitem__)
        raise ValueError(f"the graph has a cycle through: {', '.join(stuck)}")
    return order

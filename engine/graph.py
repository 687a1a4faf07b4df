"""The graph: layers wired as a DAG, and one execution order.

A model declares nodes by name with the names of their inputs (``"input"`` is the network input);
``Graph`` sorts them topologically (Kahn's algorithm, ties broken by declaration order, so the order
is the one a reader expects) and numbers them ``0..L-1`` in that order: ``node.index``.

**Moments.** A training iteration runs ``2L`` moments: forward of node ``i`` is moment ``i``;
backward of node ``i`` is moment ``2L-1-i`` (backward runs in reverse order). The loss head runs
between moment ``L-1`` and moment ``L``.

What tensors an iteration makes, who aliases or sums them and how long each lives is not the
graph's business: ``engine.program`` compiles the graph for a batch shape into the step program, and
everything that plans memory reads that.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from engine.layers.base import Layer
from engine.memory import Shape

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


class Graph:
    """A DAG of layers with a topological order; built from ``(name, layer, input_names)`` triples."""

    def __init__(self, declarations: Iterable[tuple[str, Layer, list[str] | tuple[str, ...]]], input_shape: Shape):
        """``input_shape`` is one sample's shape (C, H, W) or (features,): it sizes the step program."""
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

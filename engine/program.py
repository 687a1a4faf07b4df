"""The step program: one iteration of a graph, compiled once for a batch shape, as a list of steps.

Which buffer exists at which moment of an iteration, who writes it, who hands it on, who sums into it
and when it dies is decided here, once, from the layers' declarations (``output_shape``,
``saved_specs``, ``keeps_input``, ``keeps_output``, ``input_gradients``, ``inference_passes_input``).
Everything else reads the result:

* ``Network.forward`` / ``loss`` / ``backward`` execute the steps in order (engine.network): they
  pass the buffers a step names, bind what the call returns to the buffers the step says, and retire
  what the step says. They hold no allocation or aliasing rule of their own.
* the planned arena places the program's ACTIVATIONS, FF_CACHE and ACTIVATION_GRAD buffers
  (``Network.arena_plan``), and checks every creation against them;
* the offload plan groups each node's ACTIVATIONS and FF_CACHE buffers into units
  (``engine.offload.plan.program_units``);
* ``Network.memory_report``, ``planned_peaks`` and ``engine memory`` sum the buffers alive at each
  moment; ``engine memory --program`` prints the program itself (``Program.table``).

**Time.** A training iteration of a graph of L nodes has ``2L`` *moments* (the numbering of the
network hooks): the forward of node ``i`` is moment ``i``, its backward moment ``2L-1-i``. The loss
head's forward runs after moment ``L-1`` has closed (the caller calls ``net.loss`` between forward
and backward) and its backward at the start of moment ``L``, before the output node's backward.
Several program steps can share a moment: a node's backward and the fan-out sums that follow it.

**Buffers.** Every tensor an iteration makes is a ``Buffer``: name, ArrayType, shape, dtype, the
node whose ``mgr.layer`` scope creates it (``owner``, None for the loss head and the caller's
input), the moment it is made (``first``) and the last moment anything reads or holds it (``last``),
and every moment that reads it (``uses``). Lifespans are not computed by a separate formula: they
are the union of the steps that name the buffer.

**Rules, all here:**

* a node's forward makes its output (ACTIVATIONS), then its ``saved_specs`` (FF_CACHE) in order;
  in inference it makes only the output, or none when the layer declares
  ``inference_passes_input`` (Dropout hands its input on);
* a node's backward reads its output gradient, its inputs when ``keeps_input``, its output when
  ``keeps_output``, its saved buffers; for each input it makes a new gradient (``NEW``), hands
  ``dout`` on (``PASS_THROUGH``: Add), writes over ``dout`` when no other pending gradient is that
  same buffer (``OVER_DOUT``: ReLU), or makes one even when none is asked for (``ALWAYS_NEW``:
  BatchNorm2d's kernel always writes dx);
* where a node's output feeds several consumers, the second contribution to its gradient is added
  into the first (a ``GRAD_SUM`` step in the consumer's moment and scope, over the earlier buffer),
  or into a new buffer when the earlier one is also another input's pending gradient (Add handed it
  to both); a layer that ``accumulates_input_gradients`` (``ChunkedConvBN``) adds its contribution
  into the pending gradient itself, chunk by chunk, and its input gradient is no buffer at all. The
  same bits either way (a + b, elementwise, in the same order of operands). ResNet-18 at 224, batch 128,
  every chunked layer recomputing: the activation gradients alive at the step's worst moment (layer1's
  first conv's backward) were four of 98 MiB (the skip's gradient, dout, dx and their sum); with the sum
  over the skip's, three; with the conv adding into it, two (``engine memory``);
* with ``layer_gradients`` (the optimizer updates each layer inside backward: ``engine.optim``), a
  node with parameters makes its parameter gradients as one GRADIENTS buffer, first of what its
  backward makes, alive for that moment only; without it they live in the network's GRADIENTS block
  for the whole run and are no buffer of the program;
* the loss head makes ``probs`` and ``value`` (ACTIVATIONS) and, in backward, the logits' gradient;
  the logits and the loss head's buffers are held until the loss backward: the caller may read them
  between ``net.loss`` and ``net.backward``, after moment ``L-1`` has closed.

A buffer is *retired* at the end of the moment of its last use (the arena marks its slot outdated
there, so a later use raises). ResNet-18 (CIFAR) compiles to 144 steps and 160 buffers in about 12 ms,
once per batch shape and mode (``Network.program`` caches it); the layer calls dominate a step by far.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from engine.graph import GRAPH_INPUT, INPUT_NAME, Graph, Node
from engine.layers.base import InputGradients
from engine.memory import ArrayType, Shape, nbytes


class Op(enum.Enum):
    FORWARD = "forward"
    LOSS = "loss"
    LOSS_BACKWARD = "loss backward"
    BACKWARD = "backward"
    GRAD_SUM = "grad sum"


@dataclass(frozen=True)
class Buffer:
    """One tensor of an iteration: what it is, who makes it, and every moment that uses it."""

    id: int
    name: str
    array_type: ArrayType
    shape: Shape
    dtype: np.dtype
    owner: int | None  # the node whose mgr.layer scope creates it; None: the loss head or the caller
    first: int  # the moment it is made
    last: int  # the last moment that reads or holds it
    uses: tuple[int, ...]  # the moments that read or hold it, sorted (its creation not included)

    @property
    def nbytes(self) -> int:
        return nbytes(self.shape, self.dtype)

    @property
    def offloadable(self) -> bool:
        """A node's output or saved tensor (ACTIVATIONS, FF_CACHE): what an offload plan's units hold
        (``engine.offload.plan.program_units``); the rest (gradients, input, loss head) stays in the step's arena."""
        return self.owner is not None and self.array_type in (ArrayType.ACTIVATIONS, ArrayType.FF_CACHE)


@dataclass(frozen=True)
class Step:
    """One call of an iteration: the layer call it makes and what it does to which buffers."""

    index: int
    time: int  # the moment (hook numbering); several steps may share one
    op: Op
    node: int | None  # the node (and mgr.layer scope) of the call; None for the loss head
    inputs: tuple[int, ...]  # buffers passed to the call, in order (backward: the output gradient)
    results: tuple[int | None, ...]  # the buffer each returned tensor is (None: nothing asked for)
    creates: tuple[int, ...]  # new buffers, in the order the call creates them (what mgr.create sees)
    reads: tuple[int, ...]  # every buffer the call reads: inputs and what the layer kept
    writes: tuple[int, ...] = ()  # existing buffers written in place (ReLU's gradient over dout)
    aliases: tuple[int, ...] = ()  # existing buffers returned as results (Add's gradient, Dropout at inference)
    holds: tuple[int, ...] = ()  # buffers kept valid through this step without being read (the caller's logits)
    forget: tuple[int, ...] = ()  # buffers no later step is handed: the executor drops its references
    retires: tuple[int, ...] = ()  # buffers whose last use is this moment (on the moment's closing step)
    need: tuple[bool, ...] = ()  # backward: which inputs' gradients are asked for
    reuse_dout: bool = False  # backward: the layer may write its input gradient over dout
    accumulate: tuple[bool, ...] = ()  # backward: which inputs' gradients the layer adds into their pending one
    opens: bool = False  # the first step of a node's moment: the "before" hook fires
    closes: bool = False  # the last step of a node's moment: retirements, the "after" hook
    scratch_bytes: int = 0  # working memory (FF_WORKING_MEM or BP_WORKING_MEM) the call needs


@dataclass
class Program:
    """A compiled iteration: steps in execution order and the buffers they name (module docstring)."""

    graph: Graph = field(repr=False)
    batch_size: int
    training: bool
    steps: list[Step]
    buffers: list[Buffer]
    input: int  # the buffer of the network input
    output: int  # the buffer of the logits (the program's result)
    moments: int  # 2L in training, L in inference
    name: str = "network"

    @property
    def node_names(self) -> list[str]:
        return [node.name for node in self.graph.nodes]

    def phase(self, *ops: Op) -> list[Step]:
        return [s for s in self.steps if s.op in ops]

    @cached_property
    def forward_steps(self) -> list[Step]:
        """What ``net.forward`` runs."""
        return self.phase(Op.FORWARD)

    @cached_property
    def backward_steps(self) -> list[Step]:
        """What ``net.backward`` runs: the loss head's backward, then each node's backward and sums."""
        return self.phase(Op.LOSS_BACKWARD, Op.BACKWARD, Op.GRAD_SUM)

    def live_bytes(self, time: int, types: Sequence[ArrayType] | None = None) -> int:
        """Bytes of the buffers alive at ``time`` (of ``types``; all when None)."""
        return sum(b.nbytes for b in self.buffers if b.first <= time <= b.last
                   and (types is None or b.array_type in types))

    def scratch_at(self) -> list[int]:
        """Working-memory bytes per moment (the largest step of the moment)."""
        scratch = [0] * self.moments
        for s in self.steps:
            scratch[s.time] = max(scratch[s.time], s.scratch_bytes)
        return scratch

    def table(self) -> str:
        """The program as a text table, one row per step, one buffer per line (``engine memory --program``)."""
        names = self.node_names

        def label(ids: Sequence[int]) -> list[str]:
            return [self.buffers[i].name for i in ids]

        rows: list[list[list[str]]] = [[["#"], ["t"], ["op"], ["node"], ["creates"], ["reads"],
                                        ["in place / hands on"], ["retires after"]]]
        for s in self.steps:
            kind = "" if s.node is None else type(self.graph.nodes[s.node].layer).__name__
            node = "loss head" if s.node is None else f"{names[s.node]} ({kind})"
            made = [f"{self.buffers[i].name} {self.buffers[i].array_type.name} "
                    f"{'×'.join(map(str, self.buffers[i].shape))}" for i in s.creates]
            moved = ([f"over {self.buffers[i].name}" for i in s.writes]
                     + [f"→ {self.buffers[i].name}" for i in s.aliases if i not in s.writes])
            reads = label(s.reads) + [f"(held) {name}" for name in label(s.holds)]
            rows.append([[str(s.index)], [str(s.time)], [s.op.value], [node], made, reads, moved,
                         label(s.retires)])
        widths = [max(len(line) for r in rows for line in r[c] or [""]) for c in range(len(rows[0]))]
        lines = []
        for r in rows:
            for k in range(max(len(cell) for cell in r)):
                lines.append("  ".join((cell[k] if k < len(cell) else "").ljust(w)
                                       for cell, w in zip(r, widths)).rstrip())
            if r is rows[0]:
                lines.append("  ".join("-" * w for w in widths))
        kind = "training" if self.training else "inference"
        peak = max(range(self.moments), key=self.live_bytes)
        lines.append(f"{kind} program of {self.name}, batch {self.batch_size}: {len(self.steps)} steps, "
                     f"{len(self.buffers)} buffers; most bytes alive at once {self.live_bytes(peak):,} at moment "
                     f"{peak} (t: the moment; forward of node i is i, its backward 2L-1-i)")
        return "\n".join(lines)


class _Builder:
    """Collects steps and buffers while a program is compiled; lifespans come from the steps."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []
        self.buffers: list[dict[str, Any]] = []

    def buffer(self, name: str, array_type: ArrayType, shape: Shape, dtype: Any, owner: int | None,
               time: int) -> int:
        self.buffers.append({"name": name, "array_type": array_type, "shape": tuple(int(d) for d in shape),
                             "dtype": np.dtype(dtype), "owner": owner, "first": time, "uses": set()})
        return len(self.buffers) - 1

    def step(self, time: int, op: Op, node: int | None, **fields: Any) -> dict[str, Any]:
        entry = {"time": time, "op": op, "node": node, "inputs": (), "results": (), "creates": (), "reads": (),
                 **fields}
        for key in ("reads", "holds", "writes"):
            for b in entry.get(key, ()):
                self.buffers[b]["uses"].add(time)
        self.steps.append(entry)
        return entry

    def finish(self, graph: Graph, batch_size: int, training: bool, input_id: int, output_id: int,
               moments: int, name: str) -> Program:
        buffers = [Buffer(i, b["name"], b["array_type"], b["shape"], b["dtype"], b["owner"], b["first"],
                          max([b["first"], *b["uses"]]), tuple(sorted(b["uses"])))
                   for i, b in enumerate(self.buffers)]
        handed_later: set[int] = {output_id}
        forget: list[tuple[int, ...]] = [()] * len(self.steps)
        for k in range(len(self.steps) - 1, -1, -1):  # what no later step is handed (the result excepted)
            entry = self.steps[k]
            forget[k] = tuple(dict.fromkeys(b for b in entry["inputs"] if b not in handed_later))
            handed_later.update(entry["inputs"])
        ending: dict[int, list[int]] = {}
        for b in buffers:
            ending.setdefault(b.last, []).append(b.id)
        steps = []
        for k, entry in enumerate(self.steps):
            following = self.steps[k + 1] if k + 1 < len(self.steps) else None
            is_node = entry["op"] in (Op.FORWARD, Op.BACKWARD, Op.GRAD_SUM)
            closes = is_node and (following is None or following["time"] != entry["time"]
                                  or following["op"] not in (Op.GRAD_SUM,))
            opens = entry["op"] in (Op.FORWARD, Op.BACKWARD)
            steps.append(Step(index=k, forget=forget[k], opens=opens, closes=closes,
                              retires=tuple(ending.get(entry["time"], ())) if closes else (), **entry))
        return Program(graph, batch_size, training, steps, buffers, input_id, output_id, moments, name)


def compile_training(graph: Graph, batch_size: int, name: str = "network", layer_gradients: bool = False) -> Program:
    """The training program of ``graph`` for ``batch_size``: forward, loss, loss backward, backward.

    The layers must be bound to a backend (a ``Network`` does it): their scratch sizes come from it.
    ``layer_gradients``: each node's parameter gradients are a buffer of its backward moment (rules above).
    """
    return _compile(graph, batch_size, True, name, layer_gradients)


def compile_inference(graph: Graph, batch_size: int, name: str = "network") -> Program:
    """The inference program: forwards only, no saved buffers, Dropout hands its input on."""
    return _compile(graph, batch_size, False, name)


def _compile(graph: Graph, batch_size: int, training: bool, name: str, layer_gradients: bool = False) -> Program:
    L = len(graph.nodes)
    shapes = graph.shapes(batch_size)
    b = _Builder()
    input_id = b.buffer(INPUT_NAME, ArrayType.INPUT, shapes[GRAPH_INPUT], np.float32, None, 0)
    out: dict[int, int] = {GRAPH_INPUT: input_id}  # node -> its output buffer
    saved: dict[int, list[int]] = {}
    for node in graph.nodes:
        i = node.index
        layer = node.layer
        inputs = tuple(out[s] for s in node.inputs)
        in_shapes = [shapes[s] for s in node.inputs]
        scratch = 4 * layer.forward_scratch(in_shapes)
        if not training and layer.inference_passes_input:
            out[i] = inputs[0]
            b.step(i, Op.FORWARD, i, inputs=inputs, results=(inputs[0],), reads=inputs, aliases=(inputs[0],),
                   scratch_bytes=scratch)
            continue
        out[i] = b.buffer(f"{node.name}:out", ArrayType.ACTIVATIONS, shapes[i], np.float32, i, i)
        creates = [out[i]]
        if training:
            saved[i] = [b.buffer(f"{node.name}:{spec.name}", ArrayType.FF_CACHE, spec.shape, spec.dtype, i, i)
                        for spec in layer.saved_specs(in_shapes)]
            creates += saved[i]
        b.step(i, Op.FORWARD, i, inputs=inputs, results=(out[i],), creates=tuple(creates), reads=inputs,
               scratch_bytes=scratch)
    logits = out[graph.output.index]
    if not training:
        return b.finish(graph, batch_size, False, input_id, logits, L, name)

    # The loss head runs after moment L-1 closed: what it makes, and the logits, are held to moment L.
    probs = b.buffer("loss:probs", ArrayType.ACTIVATIONS, shapes[graph.output.index], np.float32, None, L - 1)
    value = b.buffer("loss:value", ArrayType.ACTIVATIONS, (1,), np.float32, None, L - 1)
    b.step(L - 1, Op.LOSS, None, inputs=(logits,), creates=(probs, value), reads=(logits,))
    dlogits = b.buffer(f"{graph.output.name}:grad", ArrayType.ACTIVATION_GRAD, shapes[graph.output.index],
                       np.float32, None, L)
    b.step(L, Op.LOSS_BACKWARD, None, results=(dlogits,), creates=(dlogits,), reads=(probs,),
           holds=(logits, value))

    grads: dict[int, int] = {graph.output.index: dlogits}  # node -> the buffer holding its output gradient
    for node in reversed(graph.nodes):
        _backward(b, graph, node, 2 * L - 1 - node.index, shapes, out, saved, grads, layer_gradients)
    return b.finish(graph, batch_size, True, input_id, logits, 2 * L, name)


def _backward(b: _Builder, graph: Graph, node: Node, time: int, shapes: dict[int, Shape], out: dict[int, int],
              saved: dict[int, list[int]], grads: dict[int, int], layer_gradients: bool = False) -> None:
    """The steps of one node's backward: the layer call, then a sum per input that already has a gradient."""
    i = node.index
    layer = node.layer
    dout = grads.pop(i)
    reuse_dout = all(other != dout for other in grads.values())  # Add left the same buffer for another node
    need = tuple(source != GRAPH_INPUT for source in node.inputs)
    reads = [dout]
    if layer.keeps_input:
        reads += [out[s] for s in node.inputs]
    if layer.keeps_output:
        reads.append(out[i])
    reads += saved.get(i, [])
    policy = layer.input_gradients
    results: list[int | None] = []
    creates: list[int] = []
    writes: list[int] = []
    aliases: list[int] = []
    parameters = sum(int(np.prod(p.shape)) for p in layer.parameter_specs())
    if layer_gradients and parameters:
        creates.append(b.buffer(f"{node.name}:parameter_grads", ArrayType.GRADIENTS, (parameters,), np.float32, i,
                                time))
    accumulate: list[bool] = []
    for source, needed in zip(node.inputs, need):
        name = f"{INPUT_NAME if source == GRAPH_INPUT else graph.nodes[source].name}:grad@{node.name}"
        accumulate.append(needed and policy is InputGradients.NEW and layer.accumulates_input_gradients
                          and _summable_in_place(grads, source, dout))
        if accumulate[-1]:  # a fan-out whose earlier contribution only this sum reads: the layer adds into it
            results.append(grads[source])
            writes.append(grads[source])
            aliases.append(grads[source])
        elif policy is InputGradients.PASS_THROUGH:
            results.append(dout if needed else None)
            if needed:
                aliases.append(dout)
        elif policy is InputGradients.OVER_DOUT and needed and reuse_dout:
            results.append(dout)
            writes.append(dout)
            aliases.append(dout)
        elif needed or policy is InputGradients.ALWAYS_NEW:
            creates.append(b.buffer(name, ArrayType.ACTIVATION_GRAD, shapes[source], np.float32, i, time))
            results.append(creates[-1] if needed else None)
        else:
            results.append(None)
    in_shapes = [shapes[s] for s in node.inputs]
    scratch = 4 * (layer.backward_scratch(in_shapes, need, accumulate=tuple(accumulate)) if any(accumulate)
                   else layer.backward_scratch(in_shapes, need))
    b.step(time, Op.BACKWARD, i, inputs=(dout,), results=tuple(results), creates=tuple(creates), reads=tuple(reads),
           writes=tuple(dict.fromkeys(writes)), aliases=tuple(dict.fromkeys(aliases)), need=need,
           reuse_dout=reuse_dout, scratch_bytes=scratch, accumulate=tuple(accumulate) if any(accumulate) else ())
    for source, dx, added in zip(node.inputs, results, accumulate):
        if source == GRAPH_INPUT or dx is None or added:
            continue
        if source in grads:  # a fan-out: this contribution summed with the earlier one
            earlier = grads[source]
            if _summable_in_place(grads, source, dx):  # over the earlier one: no third buffer
                b.step(time, Op.GRAD_SUM, i, inputs=(earlier, dx), results=(earlier,), reads=(earlier, dx),
                       writes=(earlier,), aliases=(earlier,))
                continue
            total = b.buffer(f"{graph.nodes[source].name}:grad_sum@{node.name}", ArrayType.ACTIVATION_GRAD,
                             shapes[source], np.float32, i, time)
            b.step(time, Op.GRAD_SUM, i, inputs=(earlier, dx), results=(total,), creates=(total,),
                   reads=(earlier, dx))
            grads[source] = total
        else:
            grads[source] = dx


def _summable_in_place(grads: dict[int, int], source: int, other: int) -> bool:
    """Whether a new contribution to ``source``'s gradient may be added into its pending one: there is one, no
    other pending gradient is that same buffer (Add hands one buffer to both its inputs), and it is not ``other``
    (the node's own dout, read while the layer adds; or the contribution itself)."""
    earlier = grads.get(source)
    return earlier is not None and earlier != other and sum(g == earlier for g in grads.values()) == 1

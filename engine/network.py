"""Network: a graph of layers with its parameters, gradients and buffers, trained one step at a time.

    logits = net.forward(x, training=True)   # x: N×C×H×W float32 array on the backend (or a Tensor)
    loss = net.loss(labels)                  # int64 labels -> float
    net.backward()                           # fills net.gradients

Host (NumPy) batches and labels are accepted on a GPU backend too: they are copied over first.

**The step program.** ``net.program(batch)`` is the iteration compiled from the graph
(``engine.program``): which call runs when, which buffers it creates, reads, writes in place, hands
on and retires. ``forward``, ``loss`` and ``backward`` execute its steps and nothing else: they pass
each call the tensors bound to the buffers the step names, bind the results as the step says, and
retire what it says. A training and an inference program are compiled once per batch size.

**Memory.** Every parameter lives in one PARAMETERS ContiguousBlock (``net.parameters``), every
gradient in one GRADIENTS block with the same names and layout (``net.gradients``), BatchNorm's
running statistics in a third block (``net.buffers``); layers get views into them.
``net.set_gradient_storage("per_layer")`` drops the whole GRADIENTS block: each node's backward then
makes its parameter gradients as a buffer of the step program, alive for that moment only and placed
by the training arena like the activation gradients: for an optimizer that updates each layer as
soon as its backward has written them (``engine.optim.UpdateInBackward``), nothing reads a layer's
gradients later (ResNet-18: a 42.6 MiB block becomes at most 9.0 MiB, the largest layer's, inside
the arena's gaps). Everything an
iteration makes comes from the workspace manager: ``net.mgr`` (mode "training") for training steps,
``net.inference_mgr`` (mode "inference") for ``forward(training=False)`` and ``predict``. In training,
ACTIVATIONS, FF_CACHE and ACTIVATION_GRAD go to ``net.arena`` (a ``PlannedArena``): offsets planned
before the first step from the program's buffers (``net.arena_plan(batch)``); ``end_step`` after each
forward and backward moment retires what that moment was the last to use.

**Scope of an iteration.** ``forward`` enters ``mgr.iteration()`` (which resets the per-iteration
workspaces) and leaves it open: the logits, the loss and every tensor kept for backward stay valid
until ``backward`` has run, which closes the scope as its last act. In inference, ``predict`` closes
it once the logits are copied to the host; a bare ``forward(training=False)`` leaves it open so the
returned logits can be read. A new ``forward`` first closes a scope left open, and an exception inside
forward or backward closes it too. Each layer runs inside ``mgr.layer(node.index)``, so its outputs
and saved tensors are created while ``mgr.owner`` is its node index. The loss head runs outside any
layer scope (owner None).

**Hooks.** ``net.hooks`` holds objects with any of ``on_iteration_start(net)``,
``before_forward(step, node)``, ``after_forward(step, node)``, ``before_backward(step, node)``,
``after_parameter_gradients(step, node, gradients)``, ``after_backward(step, node)``,
``on_iteration_end(net)`` (a ``NetworkHook``); ``step`` is the program's moment (``engine.program``:
forward of node i is i, its backward 2L-1-i). They fire in training iterations only:
``after_parameter_gradients`` right after the backward call of a node with parameters, with the
node's gradients as one 1-D array laid out like its slice of ``net.parameters`` (valid during the
call only: in per-layer storage later moments reuse its bytes); ``on_iteration_start`` right after
the iteration scope opens,
``on_iteration_end`` after the last backward step, just before it closes. An
iteration abandoned before the end of backward (a forward without backward, an error) closes without
``on_iteration_end``; the next ``on_iteration_start`` is the hook's cue to drop what it left.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import numpy as np

from engine.backend import ComputeBackend
from engine.chunking import fuse_chunkable
from engine.graph import Graph, Node
from engine.layers.chunked import ChunkedConvBN, ChunkedPair
from engine.layers.dropout import Dropout
from engine.layers.loss import SoftmaxCrossEntropy
from engine.memory import ArrayType, ContiguousBlock, WorkspaceManager
from engine.memory.arena import ArenaPlan, PlannedArena, make_plan
from engine.memory.tensor import Tensor, WorkspaceError
from engine.program import Op, Program, Step, compile_inference, compile_training

INFERENCE_PLANNED_TYPES = (ArrayType.ACTIVATIONS, ArrayType.FF_WORKING_MEM)
"""What the inference arena provides: outputs and each layer's working memory, placed by lifespan."""
PLANNED_TYPES = (ArrayType.ACTIVATIONS, ArrayType.FF_CACHE, ArrayType.ACTIVATION_GRAD, ArrayType.FF_WORKING_MEM,
                 ArrayType.BP_WORKING_MEM, ArrayType.GRADIENTS)
"""What the planned arena provides in training (an offload scheduler takes over the first two).

Working memory is planned too (one buffer per step that declares scratch, alive for that moment):
in a separate "working" workspace it was a block of its own beside the arena, as large as the
largest layer's scratch, although that layer (ResNet-18's layer4 3×3 convolutions, 19.0 MiB at batch
32) runs where few activation gradients are alive. In the arena it fills the gaps instead: the README
main command's arena (activation gradients and working memory: offload N=4 places the rest) needs
38.5 MiB where the two blocks were 32.0 + 19.0 MiB. GRADIENTS are planned only in per-layer gradient
storage (``Network.set_gradient_storage``), where they are program buffers of one moment each: the
arena grows to 38.8 MiB where a 9.0 MiB block stood beside it (``net.arena_plan``; whole-process peak
RSS of that command 396.9 -> 368.1 -> 359.3 MiB, ``benchmarks/bench_memory.py --process``)."""

GRADIENT_STORAGES = ("whole", "per_layer")
"""``net.gradient_storage``: every layer's gradients in one block, or each in its backward moment only."""

HOOK_METHODS = (
    "on_iteration_start",
    "before_forward",
    "after_forward",
    "before_backward",
    "after_parameter_gradients",
    "after_backward",
    "on_iteration_end",
)


class NetworkHook(Protocol):
    """What ``net.hooks`` hold (the offload scheduler, the optimizer-state offload, test probes). A hook
    may define any subset of these; the network calls the ones it has, in training iterations only."""

    def on_iteration_start(self, net: Network) -> None: ...
    def before_forward(self, step: int, node: Node) -> None: ...
    def after_forward(self, step: int, node: Node) -> None: ...
    def before_backward(self, step: int, node: Node) -> None: ...
    def after_parameter_gradients(self, step: int, node: Node, gradients: Any) -> None: ...
    def after_backward(self, step: int, node: Node) -> None: ...
    def on_iteration_end(self, net: Network) -> None: ...


class ProgramMismatchError(WorkspaceError):
    """A layer returned something other than what the step program says (an alias that is not one)."""


class LoadResult(NamedTuple):
    missing_keys: list[str]
    unexpected_keys: list[str]


@dataclass
class LayerMemory:
    """One row of ``memory_report``: bytes per node for one batch size."""

    name: str
    kind: str
    output_shape: tuple[int, ...]
    parameter_bytes: int
    output_bytes: int
    saved_bytes: int  # kept for backward: FF_CACHE tensors plus the input/output the layer reads back
    working_bytes: int  # the larger of forward and backward scratch


@dataclass
class MemoryReport:
    batch_size: int
    rows: list[LayerMemory]
    parameter_bytes: int
    gradient_bytes: int
    buffer_bytes: int
    iteration_peak_bytes: int  # largest sum of live iteration tensors + that step's scratch
    peak_step: int
    planned_peak_bytes: int  # long-lived blocks + iteration peak (a liveness-based plan, no fragmentation)
    by_type_at_peak: dict[str, int] = field(default_factory=dict)
    gradient_storage: str = "whole"  # net.gradient_storage: "per_layer": gradient_bytes is 0, they are buffers
    # The planned arena (ACTIVATIONS, FF_CACHE, ACTIVATION_GRAD): offsets planned from lifespans.
    arena_planned_bytes: int = 0  # the arena the static plan needs
    arena_lower_bound_bytes: int = 0  # the most of those bytes alive at one step (no placement beats it)
    arena_total_bytes: int = 0  # all of those tensors at once: what keeping them for the whole step costs
    measured: dict[str, int] = field(default_factory=dict)  # filled by Network.measure_memory

    def as_dict(self) -> dict[str, Any]:
        return {
            "batch_size": self.batch_size,
            "rows": [vars(r) for r in self.rows],
            "parameter_bytes": self.parameter_bytes,
            "gradient_bytes": self.gradient_bytes,
            "buffer_bytes": self.buffer_bytes,
            "iteration_peak_bytes": self.iteration_peak_bytes,
            "peak_step": self.peak_step,
            "planned_peak_bytes": self.planned_peak_bytes,
            "by_type_at_peak": dict(self.by_type_at_peak),
            "gradient_storage": self.gradient_storage,
            "arena_planned_bytes": self.arena_planned_bytes,
            "arena_lower_bound_bytes": self.arena_lower_bound_bytes,
            "arena_total_bytes": self.arena_total_bytes,
            "measured": dict(self.measured),
        }


class Network:
    """A trainable model: a Graph bound to a backend, blocks of weights, and two workspace managers."""

    def __init__(
        self,
        graph: Graph,
        backend: ComputeBackend,
        *,
        seed: int = 0,
        name: str = "network",
        workspace_mode: str = "enabled",
        chunkable: bool | str = True,
    ) -> None:
        """``workspace_mode`` "enabled" uses workspaces; "none" gives every tensor its own allocation.
        ``chunkable``: the graph's conv → batch norm → activation → max-pool chains on large planes run as one
        layer over chunks of images (``engine.layers.chunked``), where the backend has its kernels; "pairs":
        and two such chains where the second is the only reader of the first as one ``ChunkedPair``
        (``--chunks pairs``)."""
        if workspace_mode not in ("enabled", "none"):
            raise ValueError(f"workspace_mode must be 'enabled' or 'none', got {workspace_mode!r}")
        if chunkable not in (True, False, "pairs"):
            raise ValueError(f"chunkable must be True, False or 'pairs', got {chunkable!r}")
        if chunkable and "batchnorm_chunk_apply" in backend.kernels:
            graph = fuse_chunkable(graph, pairs=chunkable == "pairs")
        self.graph = graph
        self.backend = backend
        self.name = name
        self.seed = seed
        self.hooks: list[NetworkHook] = []
        enabled = workspace_mode == "enabled"
        self.mgr = WorkspaceManager(backend, mode="training" if enabled else "none")
        # A child of the training manager: closing the network (``close``) closes both.
        self.inference_mgr = self.mgr.sub_manager("inference" if enabled else "none", name="inference")
        self.loss_head = SoftmaxCrossEntropy(backend)
        # Training tensors go to offsets planned from their lifespans (engine.memory.arena), not a bump
        # workspace that keeps all of them for the whole step.
        self.arena: PlannedArena | None = None
        if enabled:
            self.arena = PlannedArena(backend, f"{self.mgr.name}/planned", self.arena_plan)
            self.mgr.track_arena(self.arena)
            self.mgr.set_default_provider(PLANNED_TYPES, self.arena)
        # Inference outputs likewise, by their lifespans in the inference program (net.inference_plan): a bump
        # workspace kept a whole batch's outputs (ResNet-18, batch 32: 248.1 MiB against 24.0 planned).
        self.inference_arena: PlannedArena | None = None
        if enabled:
            # Between training steps the training arena's block is idle: evaluation's outputs go there when
            # it is large enough, so evaluating touches no pages of its own.
            self.inference_arena = PlannedArena(backend, f"{self.inference_mgr.name}/planned", self.inference_plan,
                                                lender=self.arena)
            self.inference_mgr.track_arena(self.inference_arena)
            self.inference_mgr.set_default_provider(INFERENCE_PLANNED_TYPES, self.inference_arena)

        parameter_specs, buffer_specs = [], []
        for node in graph.nodes:
            key = node.layer.tensor_key
            parameter_specs += [(key(node.name, p.name), tuple(p.shape)) for p in node.layer.parameter_specs()]
            buffer_specs += [(key(node.name, b.name), tuple(b.shape)) for b in node.layer.buffer_specs()]
        # Tracked by the manager, so memory dumps and the monitor count them.
        self.parameters = ContiguousBlock(backend, ArrayType.PARAMETERS, parameter_specs, manager=self.mgr)
        self.gradients = ContiguousBlock(backend, ArrayType.GRADIENTS, parameter_specs, manager=self.mgr)
        self.gradient_storage = "whole"  # set_gradient_storage("per_layer"): program buffers, one moment each
        # Buffers are long-lived like parameters but never optimized: a block of their own.
        self.buffers = ContiguousBlock(backend, ArrayType.PARAMETERS, buffer_specs, manager=self.mgr)

        init_rng = np.random.default_rng(seed)
        self.rng = np.random.default_rng([seed, 1])  # dropout masks; checkpoint rng.bit_generator.state
        for node in graph.nodes:
            layer = node.layer
            own = {p.name: node.layer.tensor_key(node.name, p.name) for p in layer.parameter_specs()}
            own_buffers = {b.name: node.layer.tensor_key(node.name, b.name) for b in layer.buffer_specs()}
            layer.bind(
                backend,
                self.mgr,
                {k: self.parameters.views[v] for k, v in own.items()},
                {k: self.gradients.views[v] for k, v in own.items()},
                {k: self.buffers.views[v] for k, v in own_buffers.items()},
            )
            for key, value in layer.init_parameters(init_rng).items():
                self.parameters.views[own[key]][...] = backend.to_device(value)
            for spec in layer.buffer_specs():
                self.buffers.views[own_buffers[spec.name]][...] = spec.initial_value
            if isinstance(layer, Dropout):
                layer.rng = self.rng

        self._scope: Any = None  # the open mgr.iteration() context, if any
        self._scope_training = False
        self._logits: Tensor | None = None
        self._loss_ready = False
        self._programs: dict[tuple[int, bool, bool], Program] = {}
        self._slices = self.parameter_slices()  # node index -> its [start, stop) of the parameter block
        self._program: Program | None = None  # the program of the open iteration
        self._registers: dict[int, Tensor] = {}  # buffer id -> the tensor bound to it in the open iteration

    # ---- gradients ---------------------------------------------------------------------------------

    def parameter_slices(self) -> dict[int, tuple[int, int]]:
        """Node index -> its parameters' [start, stop) in ``net.parameters.flat`` (nodes with parameters).

        A node's parameters are consecutive in the block (specs are laid out node by node), so one
        slice of the block is one layer: what the update in backward (``engine.optim``) updates at once.
        """
        offsets = self.parameters.offsets
        slices = {}
        for node in self.graph.nodes:
            keys = [node.layer.tensor_key(node.name, p.name) for p in node.layer.parameter_specs()]
            if keys:
                slices[node.index] = (offsets[keys[0]][0], offsets[keys[-1]][1])
        return slices

    def set_gradient_storage(self, storage: str) -> None:
        """Where the layers' parameter gradients go: ``"whole"`` (one GRADIENTS block laid out like the
        parameters: every gradient kept to the end of backward, what a whole-block update, a gradient
        allreduce or a test that reads ``net.gradients`` after backward needs) or ``"per_layer"`` (no
        block: the training program gives each node's backward its gradients as a buffer of that moment,
        which the arena places like the activation gradients, and ``after_parameter_gradients`` hooks
        see them before the moment ends: only for an optimizer that updates each layer right there,
        ``engine.optim.UpdateInBackward``; ``net.gradients`` is then an empty block).

        The old block is dropped (and no longer counted by ``net.mgr``); the programs and arena plans are
        made again. Between iterations only.
        """
        if storage not in GRADIENT_STORAGES:
            raise ValueError(f"gradient storage must be one of {', '.join(GRADIENT_STORAGES)}, got {storage!r}")
        if self._scope is not None:
            raise RuntimeError(f"{self.name}: the gradient storage changes between iterations only")
        if storage == self.gradient_storage:
            return
        specs = [(node.layer.tensor_key(node.name, p.name), tuple(p.shape)) for node in self.graph.nodes
                 for p in node.layer.parameter_specs()]
        block = ContiguousBlock(self.backend, ArrayType.GRADIENTS, specs if storage == "whole" else [],
                                manager=self.mgr)
        self.mgr.untrack_block(self.gradients)
        self.gradients = block
        for node in self.graph.nodes:  # per layer: bound to the moment's buffer by each backward (_execute)
            node.layer.grads = {p.name: block.views[node.layer.tensor_key(node.name, p.name)]
                                for p in node.layer.parameter_specs()} if storage == "whole" else {}
        self.gradient_storage = storage
        for node in self.chunked:  # widened for the other storage's program (_widen_chunks)
            node.layer.wide.clear()
        self._programs.clear()
        if self.arena is not None:
            self.arena.forget_plans()

    @property
    def chunked(self) -> list[Node]:
        """The nodes that run their batch in chunks (``ChunkedConvBN``, ``ChunkedPair``), in graph order."""
        return [node for node in self.graph.nodes if isinstance(node.layer, (ChunkedConvBN, ChunkedPair))]

    def set_recomputed(self, names: Iterable[str]) -> None:
        """Chunked nodes of ``names`` recompute their chunks in backward; the others keep their batch norm's
        output (``ChunkedConvBN.mode``). The same bits either way; the programs are compiled again."""
        if self._scope is not None:
            raise RuntimeError(f"{self.name}: what the chunked layers keep changes between iterations only")
        names = set(names)
        unknown = names - {node.name for node in self.chunked}
        if unknown:
            raise ValueError(f"{self.name}: no chunked layer named {', '.join(sorted(unknown))}")
        for node in self.chunked:  # a pair always recomputes (it has no keep mode)
            node.layer.mode = "recompute" if node.name in names or isinstance(node.layer, ChunkedPair) else "keep"
        self._programs.clear()
        if self.arena is not None:
            self.arena.forget_plans()
        if self.inference_arena is not None:
            self.inference_arena.forget_plans()

    def _parameter_gradients(self, step: Step, mgr: WorkspaceManager) -> Any:
        """The 1-D gradients of the node a backward step runs (None: it has no parameters). Per layer: the
        step's GRADIENTS buffer, made now (the program lists it first) and bound to the layer's views."""
        span = self._slices.get(step.node)
        if span is None:
            return None
        if self.gradient_storage == "whole":
            return self.gradients.flat[span[0]:span[1]]
        made = self._program.buffers[step.creates[0]]
        flat = mgr.create(made.array_type, made.shape, dtype=made.dtype).array
        node = self.graph.nodes[step.node]
        views = {}
        for p in node.layer.parameter_specs():
            lo, hi = self.parameters.offsets[node.layer.tensor_key(node.name, p.name)]
            views[p.name] = flat[lo - span[0]:hi - span[0]].reshape(tuple(p.shape))
        node.layer.grads = views
        return flat

    # ---- one iteration ----------------------------------------------------------------------------

    def program(self, batch_size: int, training: bool = True) -> Program:
        """The compiled step program of one iteration at ``batch_size`` (cached per batch size and mode)."""
        layer_gradients = bool(training) and self.gradient_storage == "per_layer"
        key = (int(batch_size), bool(training), layer_gradients)
        program = self._programs.get(key)
        if program is None:
            if training:
                program = self._widen_chunks(int(batch_size), layer_gradients)
            else:
                program = compile_inference(self.graph, int(batch_size), self.name)
            self._programs[key] = program
        return program

    def _widen_chunks(self, batch_size: int, layer_gradients: bool) -> Program:
        """The training program at ``batch_size``, with the recomputing chunked layers' passes widened where the
        step has room (``ChunkedConvBN.widenable``), largest conv output first. A pass is widened when the
        working memory it adds at its moment keeps the step within its peak both ways the step is laid out:
        every buffer (as without offload), and what the offload arena does not hold, counted as sums per moment
        (what ``memory_report`` and ``planned_peaks`` read) and placed (``arena_plan``: placement can fragment
        where the sums fit). Decided once per batch size (``wide``), for both gradient storages."""
        def compile() -> Program:
            return compile_training(self.graph, batch_size, self.name, layer_gradients)

        layers = [node for node in self.chunked if node.layer.widenable()]
        if not layers or any(batch_size in node.layer.wide for node in layers):
            return compile()
        for node in layers:
            node.layer.wide[batch_size] = frozenset()
        program = compile()
        shapes = self.graph.shapes(batch_size)
        offloaded = (ArrayType.ACTIVATIONS, ArrayType.FF_CACHE)
        rest = tuple(t for t in PLANNED_TYPES if t not in offloaded)
        moments = range(program.moments)
        live = [[sum(b.nbytes for b in program.buffers if (everything or not b.offloadable) and b.first <= m <= b.last)
                 for m in moments] for everything in (True, False)]
        scratch = program.scratch_at()
        peaks = [max(v[m] + scratch[m] for m in moments) for v in live]
        arenas = [self._arena_plan(program, types).planned_peak for types in (PLANNED_TYPES, rest)]
        L = len(self.graph.nodes)
        widened: list[tuple[ChunkedConvBN, str]] = []
        for node in sorted(layers, key=lambda n: -int(np.prod(n.layer.shapes(tuple(shapes[n.inputs[0]]))[0]))):
            layer, in_shapes = node.layer, [tuple(shapes[i]) for i in node.inputs]
            for phase in layer.widenable():
                moment = node.index if phase == "forward" else 2 * L - 1 - node.index
                size = layer.forward_scratch if phase == "forward" else layer.backward_scratch
                before = 4 * size(in_shapes)
                layer.wide[batch_size] |= {phase}
                added = 4 * size(in_shapes) - before
                if (all(v[moment] + scratch[moment] + added <= peak for v, peak in zip(live, peaks))
                        and self._arena_plan(compile(), rest).planned_peak <= arenas[1]):
                    scratch[moment] += added
                    widened.append((layer, phase))
                else:
                    layer.wide[batch_size] -= {phase}
        while widened and self._arena_plan(compile(), PLANNED_TYPES).planned_peak > arenas[0]:
            layer, phase = widened.pop()  # the smallest last: fragmentation of the whole arena, rare
            layer.wide[batch_size] -= {phase}
        return compile()

    def forward(self, x: Tensor | np.ndarray | Any, training: bool = True) -> Tensor:
        """Run the program's forward steps; returns the logits Tensor (valid until the iteration scope closes)."""
        self._check_input(x)
        self.end_iteration()
        mgr = self.mgr if training else self.inference_mgr
        for node in self.graph.nodes:
            node.layer.use_manager(mgr)
        scope = mgr.iteration()
        scope.__enter__()
        self._scope, self._scope_training, self._loss_ready = scope, training, False
        try:
            program = self.program(int(x.shape[0]), training)
            if training:
                self._call_hooks("on_iteration_start", self)
            if training and self.arena is not None:  # after the hooks: a provider they install is seen
                types = [t for t in PLANNED_TYPES if mgr.provider_for(t) is self.arena]
                self.arena.start_iteration(int(x.shape[0]), types)
            inference_arena = self._inference_arena_in_use(training)
            if inference_arena is not None:
                inference_arena.start_iteration(
                    int(x.shape[0]), [t for t in INFERENCE_PLANNED_TYPES if mgr.provider_for(t) is inference_arena])
            if self.backend.is_device and isinstance(x, np.ndarray):  # a host batch: copy it to the device
                x = mgr.leverage_to(ArrayType.INPUT, x)
            self._program, self._registers = program, {program.input: x}
            self._execute(program.forward_steps, mgr, training)
            self._logits = self._registers[program.output]
            return self._logits
        except BaseException:
            self.end_iteration()
            raise

    def loss(self, labels: Any) -> float:
        """Softmax cross-entropy (batch mean) of the last forward's logits against int64 ``labels``."""
        if self._scope is None or self._logits is None:
            raise RuntimeError(f"{self.name}: call forward(x) before loss(labels)")
        mgr = self.mgr if self._scope_training else self.inference_mgr
        if self.backend.is_device and isinstance(labels, np.ndarray):
            labels = self.backend.to_device(labels)
        value = self.loss_head.forward(mgr, self._logits, labels)
        self._loss_ready = True
        return value

    def backward(self) -> None:
        """Backpropagate the last loss: the program's backward steps; fills ``net.gradients``."""
        if self._scope is None or not self._scope_training:
            raise RuntimeError(f"{self.name}: backward() needs forward(x, training=True) first")
        if not self._loss_ready:
            raise RuntimeError(f"{self.name}: call loss(labels) between forward and backward")
        try:
            self._execute(self._program.backward_steps, self.mgr, True)
            self._call_hooks("on_iteration_end", self)
        finally:
            self.end_iteration()

    def _execute(self, steps: list[Step], mgr: WorkspaceManager, training: bool) -> None:
        """Run ``steps``: hand each call the buffers it names, bind its results, retire what it says.

        The loss head's forward is ``net.loss`` (it needs the labels); every other step runs here. The
        only checks are the program's own: a result the program says is an existing buffer must be
        that tensor (``ProgramMismatchError`` otherwise, before anything reads it).
        """
        registers = self._registers
        nodes = self.graph.nodes
        buffers = self._program.buffers
        arena = self.arena if training else self._inference_arena_in_use(training)
        for step in steps:
            op = step.op
            node = nodes[step.node] if step.node is not None else None
            if step.opens and training:
                self._call_hooks("before_forward" if op is Op.FORWARD else "before_backward", step.time, node)
            if op is Op.FORWARD:
                with mgr.layer(step.node):
                    results = [node.layer.forward([registers[b] for b in step.inputs], training)]
            elif op is Op.BACKWARD:
                with mgr.layer(step.node):
                    gradients = self._parameter_gradients(step, mgr)
                    args = (registers[step.inputs[0]], list(step.need), step.reuse_dout)
                    if step.accumulate:  # the program's pending gradients the layer adds into
                        into = [registers[b] if added else None for b, added in zip(step.results, step.accumulate)]
                        results = node.layer.backward(*args, accumulate=into)
                    else:
                        results = node.layer.backward(*args)
                if gradients is not None:
                    self._call_hooks("after_parameter_gradients", step.time, node, gradients)
                    if self.gradient_storage == "per_layer":
                        node.layer.grads = {}  # the buffer's bytes belong to later moments
            elif op is Op.GRAD_SUM:
                if step.creates:
                    made = buffers[step.creates[0]]
                    with mgr.layer(step.node):
                        total = mgr.create(made.array_type, made.shape, dtype=made.dtype)
                else:  # over the earlier contribution (the program's rule)
                    total = registers[step.inputs[0]]
                self.backend.kernels.add_forward(registers[step.inputs[0]], registers[step.inputs[1]], total)
                results = [total]
            elif op is Op.LOSS_BACKWARD:
                results = [self.loss_head.backward(mgr)]
            else:
                raise RuntimeError(f"{self.name}: program step {step.index} ({op.value}) runs in net.loss")
            for buffer, tensor in zip(step.results, results):
                if buffer is None:
                    continue
                if buffer in step.aliases and tensor is not registers.get(buffer):
                    raise ProgramMismatchError(
                        f"{self.name}: step {step.index} ({op.value} of {node.name if node else 'loss'}) should hand "
                        f"on {buffers[buffer].name} itself but returned another tensor: the layer's input_gradients "
                        f"or inference_passes_input declaration disagrees with what it does"
                    )
                registers[buffer] = tensor
            for buffer in step.forget:
                registers.pop(buffer, None)
            if step.closes:
                if op is not Op.FORWARD:
                    node.layer.clear_saved()
                if arena is not None:
                    arena.end_step(step.time, step.node, backward=op is not Op.FORWARD)
                if training:
                    self._call_hooks("after_forward" if op is Op.FORWARD else "after_backward", step.time, node)

    def end_iteration(self) -> None:
        """Close the open iteration scope (if any) and forget every tensor of it."""
        scope, self._scope = self._scope, None
        self._logits = None
        self._loss_ready = False
        self._registers = {}
        for node in self.graph.nodes:
            node.layer.clear_saved()
        self.loss_head.saved = {}
        if scope is not None:
            scope.__exit__(None, None, None)
        if self.arena is not None:
            self.arena.end_iteration()
        if self.inference_arena is not None:
            self.inference_arena.end_iteration()

    def _inference_arena_in_use(self, training: bool) -> PlannedArena | None:
        """The inference arena when this forward is an inference one and nothing else provides its outputs."""
        arena = self.inference_arena
        if training or arena is None or self.inference_mgr.provider_for(ArrayType.ACTIVATIONS) is not arena:
            return None
        return arena

    def close(self) -> None:
        """Release every workspace of this network (both managers); the network is unusable afterwards."""
        self.end_iteration()
        self.mgr.close()

    def predict(self, x: Any, out: np.ndarray | None = None) -> np.ndarray:
        """Inference logits as a host float32 array (written into ``out`` when given)."""
        logits = self.forward(x, training=False)
        try:
            host = self.backend.to_host(logits.array)
            if out is None:
                out = np.array(host, dtype=np.float32, copy=True)
            else:
                out[...] = host
        finally:
            self.end_iteration()
        return out

    def _check_input(self, x: Any) -> None:
        shape = tuple(x.shape)
        expected = len(self.graph.input_shape) + 1
        if len(shape) != expected or x.dtype != np.float32:
            raise ValueError(
                f"{self.name} expects input of shape (N, {', '.join(map(str, self.graph.input_shape))}) float32, "
                f"got {shape} {x.dtype}"
            )

    def _call_hooks(self, method: str, *args: Any) -> None:
        for hook in self.hooks:
            function = getattr(hook, method, None)
            if function is not None:
                function(*args)

    # ---- weights ------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, np.ndarray]:
        """Host copies with torchvision's names: parameters and buffers float32, num_batches_tracked int64."""
        state: dict[str, np.ndarray] = {}
        for node in self.graph.nodes:
            layer = node.layer
            for spec in layer.parameter_specs():
                key = node.layer.tensor_key(node.name, spec.name)
                state[key] = np.array(self.backend.to_host(self.parameters.views[key]), dtype=np.float32)
            for spec in layer.buffer_specs():
                key = node.layer.tensor_key(node.name, spec.name)
                state[key] = np.array(self.backend.to_host(self.buffers.views[key]), dtype=np.float32)
            for key, counter in _counters(node).items():
                state[key] = np.array(counter.num_batches_tracked, dtype=np.int64)
        return state

    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> LoadResult:
        """Copy weights in by name. Every name and shape is checked first; a problem raises one ValueError
        listing every missing, unexpected and mismatched key (missing/unexpected only when ``strict``).
        ``num_batches_tracked`` is accepted and optional."""
        targets: dict[str, Any] = {}
        counters: dict[str, Any] = {}
        for node in self.graph.nodes:
            layer = node.layer
            for spec in layer.parameter_specs():
                key = node.layer.tensor_key(node.name, spec.name)
                targets[key] = self.parameters.views[key]
            for spec in layer.buffer_specs():
                key = node.layer.tensor_key(node.name, spec.name)
                targets[key] = self.buffers.views[key]
            counters.update(_counters(node))
        missing = [k for k in targets if k not in state]
        unexpected = [k for k in state if k not in targets and k not in counters]
        mismatched = []
        values: dict[str, np.ndarray] = {}
        for key, target in targets.items():
            if key not in state:
                continue
            value = _host_array(state[key])
            if tuple(value.shape) != tuple(target.shape):
                mismatched.append(f"{key}: expected {tuple(target.shape)}, got {tuple(value.shape)}")
            elif not np.issubdtype(value.dtype, np.floating):
                mismatched.append(f"{key}: expected a float array, got dtype {value.dtype}")
            else:
                values[key] = value
        for key in counters:
            if key in state and _host_array(state[key]).size != 1:
                mismatched.append(f"{key}: expected a scalar count, got shape {_host_array(state[key]).shape}")
        problems = []
        if strict and missing:
            problems.append(f"missing keys ({len(missing)}): {', '.join(missing)}")
        if strict and unexpected:
            problems.append(f"unexpected keys ({len(unexpected)}): {', '.join(unexpected)}")
        if mismatched:
            problems.append(f"shape mismatches ({len(mismatched)}): {'; '.join(mismatched)}")
        if problems:
            raise ValueError(f"cannot load state dict into {self.name}: " + " | ".join(problems))
        for key, value in values.items():
            targets[key][...] = self.backend.to_device(np.ascontiguousarray(value, dtype=np.float32))
        for key, layer in counters.items():
            if key in state:
                layer.num_batches_tracked = int(_host_array(state[key]).reshape(()))
        return LoadResult(missing, unexpected)

    # ---- memory ------------------------------------------------------------------------------------

    def memory_report(self, batch_size: int, arena: bool = True) -> MemoryReport:
        """Per-layer bytes for one training iteration at ``batch_size``, and the liveness-based peak.

        Everything comes from the training program: a row's "kept for backward" is what the node's
        backward step reads besides its output gradient; the peak is the largest sum, over the moments,
        of the buffers alive then plus the moment's working memory. ``arena``: also the arena's static plan
        (``arena_*_bytes``; 0 without): the memory limit's search (``engine.offload.budget``) reads the peak
        alone, and the plan was a fifth of each of its measures (0.1 of 0.5 s at MobileNetV2 224, batch 32).
        """
        program = self.program(batch_size)
        forward = {s.node: s for s in program.steps if s.op is Op.FORWARD}
        backward = {s.node: s for s in program.steps if s.op is Op.BACKWARD}
        rows = []
        for node in self.graph.nodes:
            f, b = forward[node.index], backward[node.index]
            output = program.buffers[f.results[0]]
            rows.append(
                LayerMemory(
                    name=node.name,
                    kind=type(node.layer).__name__,
                    output_shape=output.shape,
                    parameter_bytes=sum(4 * int(np.prod(p.shape)) for p in node.layer.parameter_specs()),
                    output_bytes=output.nbytes,
                    saved_bytes=sum(program.buffers[i].nbytes for i in b.reads if i not in b.inputs),
                    working_bytes=max(f.scratch_bytes, b.scratch_bytes),
                )
            )
        scratch = program.scratch_at()
        L = len(self.graph.nodes)
        peak, peak_step, by_type = 0, 0, {}
        for step in range(program.moments):
            total = program.live_bytes(step) + scratch[step]
            if total > peak:
                peak, peak_step = total, step
                by_type = {}
                for t in program.buffers:
                    if t.first <= step <= t.last:
                        by_type[t.array_type.name] = by_type.get(t.array_type.name, 0) + t.nbytes
                scratch_type = ArrayType.FF_WORKING_MEM if step < L else ArrayType.BP_WORKING_MEM
                by_type[scratch_type.name] = scratch[step]
        plan = self.arena_plan(batch_size) if arena else None
        parameter_bytes = int(self.parameters.flat.nbytes)
        gradient_bytes = int(self.gradients.flat.nbytes)
        buffer_bytes = int(self.buffers.flat.nbytes)
        return MemoryReport(
            batch_size=batch_size,
            rows=rows,
            parameter_bytes=parameter_bytes,
            gradient_bytes=gradient_bytes,
            buffer_bytes=buffer_bytes,
            iteration_peak_bytes=peak,
            peak_step=peak_step,
            planned_peak_bytes=parameter_bytes + gradient_bytes + buffer_bytes + peak,
            by_type_at_peak=by_type,
            gradient_storage=self.gradient_storage,
            arena_planned_bytes=plan.planned_peak if plan is not None else 0,
            arena_lower_bound_bytes=plan.lower_bound if plan is not None else 0,
            arena_total_bytes=plan.total_bytes if plan is not None else 0,
        )

    def measure_memory(self, batch_size: int, report: MemoryReport | None = None) -> MemoryReport:
        """Run one real training step (random data, no optimizer update) and add what the workspaces reserved.

        ``report.measured``: reserved bytes of the planned types, of everything, and the process's peak RSS.
        """
        from engine.memory.monitor import max_rss_bytes

        report = report if report is not None else self.memory_report(batch_size)
        rng = np.random.default_rng(0)
        x = rng.standard_normal((batch_size, *self.graph.input_shape)).astype(np.float32)
        num_classes = int(self.graph.shapes(1)[self.graph.output.index][-1])
        labels = (np.arange(batch_size) % num_classes).astype(np.int64)
        self.forward(self.backend.to_device(x), training=True)
        self.loss(labels)
        self.backward()
        reserved = self.mgr.reserved_bytes_by_type()
        report.measured = {
            "arena_reserved_bytes": sum(reserved.get(t.name, 0) for t in PLANNED_TYPES),
            "arena_live_peak_bytes": self.arena.measured_peak if self.arena is not None else 0,
            "reserved_bytes": sum(reserved.values()),
            "peak_rss_bytes": max_rss_bytes(),
            **{f"reserved_{k}": v for k, v in sorted(reserved.items())},
        }
        return report

    arena_types = PLANNED_TYPES  # what the training arena plans (an offload scheduler takes over two of them)

    def arena_plan(self, batch_size: int, types: Iterable[ArrayType] = PLANNED_TYPES) -> ArenaPlan:
        """The static plan of the training tensors of ``types`` (default: all the arena can provide): the
        program's buffers, and each step's working memory (``Step.scratch_bytes``: one FF_WORKING_MEM or
        BP_WORKING_MEM buffer its layer makes, alive for the step's moment only)."""
        return self._arena_plan(self.program(batch_size), types)

    def _arena_plan(self, program: Program, types: Iterable[ArrayType]) -> ArenaPlan:
        types = frozenset(types)
        specs: list[Any] = []
        for step in program.steps:  # in creation order (the arena counts each owner's tensors per type)
            specs += [program.buffers[i] for i in step.creates if program.buffers[i].array_type in types]
            kind = ArrayType.FF_WORKING_MEM if step.op is Op.FORWARD else ArrayType.BP_WORKING_MEM
            if step.scratch_bytes and kind in types:
                layer = self.graph.nodes[step.node].layer
                late = isinstance(layer, ChunkedConvBN) and layer.wide.get(program.batch_size, frozenset()) & {
                    "forward" if step.op is Op.FORWARD else "backward"}
                specs.append(_Spec(f"{self.graph.nodes[step.node].name}:scratch@{step.op.value}", step.node, kind,
                                   (step.scratch_bytes // 4,), np.dtype(np.float32), step.time, step.time,
                                   bool(late)))
        return make_plan(specs)

    def inference_plan(self, batch_size: int, types: Any = INFERENCE_PLANNED_TYPES) -> ArenaPlan:
        """The static plan of an inference forward's tensors of ``types``. ACTIVATIONS: the inference
        program's buffers (Dropout hands its input on), the logits held past the last step (``predict``
        reads them after it), and the loss head's two tensors for a ``net.loss`` after an inference forward
        (as in training). FF_WORKING_MEM: what each layer's inference forward works in
        (``Layer.inference_working_specs``), alive for its step only."""
        types = frozenset(types)
        program = self.program(batch_size, training=False)
        L = len(self.graph.nodes)
        specs: list[Any] = []
        if ArrayType.ACTIVATIONS in types:
            specs += [_Spec(b.name, b.owner, b.array_type, b.shape, b.dtype, b.first,
                            L if b.id == program.output else b.last)
                      for b in program.buffers if b.array_type is ArrayType.ACTIVATIONS]
            logits = program.buffers[program.output]
            specs += [_Spec("loss:probs", None, ArrayType.ACTIVATIONS, logits.shape, np.dtype(np.float32), L - 1, L),
                      _Spec("loss:value", None, ArrayType.ACTIVATIONS, (1,), np.dtype(np.float32), L - 1, L)]
        if ArrayType.FF_WORKING_MEM in types:
            shapes = self.graph.shapes(batch_size)
            for step in program.forward_steps:
                node = self.graph.nodes[step.node]
                for w in node.layer.inference_working_specs([shapes[i] for i in node.inputs]):
                    specs.append(_Spec(f"{node.name}:{w.name}", step.node, ArrayType.FF_WORKING_MEM,
                                       tuple(w.shape), np.dtype(w.dtype), step.time, step.time))
        return make_plan(specs)

    def node(self, name: str) -> Node:
        return self.graph.by_name[name]

    @property
    def num_parameters(self) -> int:
        return int(self.parameters.flat.size)


class _Spec(NamedTuple):
    """One tensor for ``make_plan`` that no program buffer describes (the inference plan's extras)."""

    name: str
    owner: Any
    array_type: ArrayType
    shape: tuple[int, ...]
    dtype: Any
    first: int
    last: int
    late: bool = False  # placed after the others (engine.memory.planner.greedy_order)


def _counters(node: Node) -> dict[str, Any]:
    """A node's num_batches_tracked names (torchvision's) and the layers that count them: a batch norm (or a
    chunked chain) counts its own; a ``ChunkedPair`` has two batch norms (``counters``)."""
    layer = node.layer
    if hasattr(layer, "counters"):
        return layer.counters()
    if hasattr(layer, "num_batches_tracked"):
        return {layer.tensor_key(node.name, "num_batches_tracked"): layer}
    return {}


def _host_array(value: Any) -> np.ndarray:
    """A NumPy view of a state-dict value (NumPy array, scalar, or a torch tensor on the CPU)."""
    if hasattr(value, "detach") and hasattr(value, "numpy"):
        value = value.detach().cpu().numpy()
    return np.asarray(value)

"""A training step on the CUDA backend as one CUDA graph per batch shape, eager as the fallback.

ResNet-18's step is 174 launches (kernels/README.md); on the first H100 run each cost ~87 µs of host
time, 15 ms a step before a kernel ran. Every tensor of a step has a planned address (the arena, the
workspaces after their first cycle), so the step can be captured once per batch shape and replayed
with one launch of the graph (CuPy stream capture; the Numba kernels go to CuPy's current stream,
``kernels/cuda/_launch.py``). What that needs, and how ``StepRunner`` provides it:

- **Fixed input slots.** Each batch shape gets a device array for the images and one for the labels,
  allocated once; every step copies its batch into them (outside the graph) and the network reads
  them in place (a device array is not copied again by ``net.forward`` / ``net.loss``).
- **Per-step values in device memory.** The learning rate (from the schedule) and Adam's step size and
  bias correction change every step; baked into a launch's arguments they would replay forever as
  captured. ``kernels.cuda.optim.sgd_update_from`` / ``adam_update_from`` read them from a 3-float
  device array that the host fills before each step (``step_scalars``: the very float32 values the
  baked launchers pass, so the weights are the same bits).
- **Nothing inside the capture that touches the host.** ``Backend.capturing`` is set while capturing;
  the loss head then skips its host-side label check (done here on the host batch instead) and its
  read of the loss, and any allocation, copy or wait raises ``CaptureError`` (on a GPU these would be
  captured or would break the capture; the simulator shows them the same way).
- **Bookkeeping.** A shape is captured after ``warmup`` eager steps (the first cycle sizes every
  workspace and plans the arena); a graph is dropped when memory moved since its capture (a block
  reallocated: ``memory_epoch``, offload's arena and pinned swap buffer included); batch norm's host counter
  advances on replays; networks with hooks (listeners, ``--offload-params``) or the update in backward run
  eagerly, with the reason in ``eager_reason``.
- **Offload on the pinned tier** is captured with the step: its scheduler is a hook that says itself whether
  it can be (``capture_blocker``, asked at capture time once the first step chose the swap tier; the disk
  tier and ``--offload-n auto`` cannot), its saves, loads and event waits are queued on copy streams that
  join the capture (``engine/offload/staging.py``), and each replay adds the captured step's figures to its
  per-step stats (``OffloadScheduler.replayed``: the same bytes written and read, no host stall). On the
  H200 (2026-11-27) offload N=4 ran eagerly for want of this: 385 images/s against 1,659 captured.
- **Dropout's mask** is a per-step value from the network's host generator; it cannot be written into
  its arena slot before a replay (that slot holds other tensors earlier in the step). So the runner owns
  a device mask buffer per Dropout node and batch shape, fills it before every step from the very draw
  the eager forward makes (``Dropout.draw_mask``, same generator, same order: the program's forward
  order), and the layer's forward copies it into its slot with a launch (``Dropout.mask_fill``), which
  the graph holds. The CPU backend's forward is untouched and draws as before. (On the H200,
  2026-11-27, MobileNetV2 was not captured for this reason.)
- **Host values through pinned staging** (``engine/host_staging.py``): the batch, the labels, the
  scalars and the masks go through a ring of two pinned buffer sets with asynchronous copies on the
  runner's stream; the host waits only to refill a set whose copy has not run. ``ndarray.set`` from
  NumPy memory blocked until the previous replay was done: the H200's "host µs per captured step" read
  25,347 µs of a 28.2 ms step. ``host_seconds`` is the host's own time in ``step()``, the ring's waits
  (the GPU's time) apart in ``wait_seconds``.
- **The loss** lands in an arena slot that later tensors reuse: each step copies it into a runner-owned
  device scalar with a launch (captured too), which ``last_loss()`` reads.

``engine train`` runs its step through this runner on ``--backend cuda`` (``Trainer(cuda_graph=...)``,
``--no-cuda-graph`` to turn it off), with ``keep_logits`` for its accuracy and the update's guard: the
update kernels read the step's loss (``loss_out``) and write nothing when it is not finite, so a
diverged replay keeps the last good step's weights, as the eager step's check before its update does.

``capture="cupy"`` is the real thing (``cupy.cuda.Stream.begin_capture`` on a non-blocking stream,
``Graph.launch``); it needs a GPU and is exercised by ``benchmarks/gpu_session.sh``. ``capture="record"``
is the simulator's stand-in with the same semantics: under ``count_only`` nothing runs while capturing,
every launch is recorded with its arguments, and a replay issues exactly those launches again. So the
tests show, without a GPU, that replaying the captured launches trains to the same bits as eager steps:
any per-step value that a launch baked in, or any work done outside a kernel launch, would differ.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class RecordedGraph:
    """The simulator's CUDA graph: the launches of one captured step, replayed in order with their arguments."""

    launches: list[tuple[str, Any, Any, Any, tuple[Any, ...]]]

    def launch(self, stream: Any = None) -> None:
        replay: dict[Any, Any] = {}  # the offload copies this replay queued, by the captured copy
        for _name, kernel, blocks, threads, args in self.launches:
            if blocks is None:  # not a launch: an offload copy, wait or join (kernels.cuda._launch.record_operations)
                kernel(replay)
            else:
                kernel[blocks, threads](*args)

    @property
    def operations(self) -> int:
        """Recorded work that is not a kernel launch (the simulator's offload copies, waits and joins)."""
        return sum(1 for entry in self.launches if entry[2] is None)

    def __len__(self) -> int:
        return len(self.launches) - self.operations


def record_capture(body: Any, stream: Any = None) -> RecordedGraph:
    """Capture ``body()`` by recording its launches; like stream capture, nothing runs meanwhile."""
    from kernels.cuda import count_only, record_launches
    from kernels.cuda._launch import record_operations

    with count_only(), record_launches() as calls, record_operations(calls):
        body()
    return RecordedGraph(list(calls))


class CupyGraph:
    """A real CUDA graph captured from CuPy's stream; ``len`` is the number of kernel launches it holds."""

    def __init__(self, graph: Any, launches: int):
        self.graph = graph
        self.launches = launches

    def launch(self, stream: Any = None) -> None:
        self.graph.launch(stream=stream)

    def __len__(self) -> int:
        return self.launches


def cupy_capture(body: Any, stream: Any) -> CupyGraph:
    """Capture ``body()`` on ``stream`` (non-blocking, current inside) into a CUDA graph and upload it."""
    from kernels.cuda import record_launches

    with stream, record_launches() as calls:
        stream.begin_capture()
        try:
            body()
        finally:
            graph = stream.end_capture()  # an invalidated capture raises here, after ending it
    upload = getattr(graph, "upload", None)  # instantiate on the device now, not at the first launch
    if upload is not None:
        upload(stream)
    return CupyGraph(graph, len(calls))


def memory_epoch(net: Any) -> tuple[int, ...]:
    """Block allocations of the network's arena and workspaces so far: a graph captured at another epoch may
    hold addresses that moved."""
    counts = [net.arena.block_allocations if net.arena is not None else 0]
    for workspace in net.mgr.workspaces.values():
        counts.append(int(workspace.statistics().block_allocations))
    for hook in net.hooks:  # offload's own arena, pinned swap buffer and plan
        epoch = getattr(hook, "graph_epoch", None)
        if epoch is not None:
            counts.extend(epoch())
    return tuple(counts)


@dataclass
class _Shape:
    x: Any
    y: Any
    logits: Any = None  # a copy of the step's logits (keep_logits)
    masks: dict[int, Any] = field(default_factory=dict)  # Dropout node index -> this shape's device mask buffer
    dropouts: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)  # (node, mask shape), forward order
    eager_steps: int = 0
    graph: Any = None
    epoch: tuple[int, ...] = ()
    replays: int = 0
    captures: int = 0
    launches: int = 0  # kernel launches the last captured graph holds


@dataclass
class StepRunner:
    """Runs training steps of ``net`` with ``optimizer`` (SGD or Adam), captured per batch shape when it can.

    ``capture``: "cupy" (a GPU), "record" (the simulator's stand-in), or False (eager with the per-step
    values in device memory: what a graph replays, without the graph). ``warmup``: eager steps of a shape
    before it is captured.
    """

    net: Any
    optimizer: Any
    capture: str | bool = "record"
    warmup: int = 1
    shapes: dict[tuple[int, ...], _Shape] = field(default_factory=dict)
    host_seconds: float = 0.0  # host time spent inside step(), less the staging ring's waits (its own work)
    depth: int = 2  # the staging ring's buffer sets (engine/host_staging.py: why two)
    keep_logits: bool = False  # copy each step's logits out (a launch) for last_logits(): engine train's accuracy
    fallback: bool = False  # a capture that fails: run eagerly from then on (capture_error says why) instead of raising
    capture_error: str | None = None

    def __post_init__(self) -> None:
        from kernels.cuda.optim import SCALARS

        self.backend = self.net.backend
        self.scalars = self.backend.to_device(np.zeros(SCALARS, np.float32))
        # the loss's arena slot is reused later in the step: each step copies it here (a launch, so captured)
        self.loss_out = self.backend.to_device(np.zeros(1, np.float32))
        self.stream = None
        if self.capture == "cupy":
            import cupy

            self.stream = cupy.cuda.Stream(non_blocking=True)
            # a non-blocking stream does not wait for the legacy default stream, where the network's
            # parameters were initialized: drain it once
            cupy.cuda.Device().synchronize()
        if self.capture not in ("cupy", "record", False):
            raise ValueError(f"capture must be 'cupy', 'record' or False, got {self.capture!r}")
        from engine.host_staging import CupyTransport, HostTransport, StagingRing

        transport = CupyTransport(self.stream) if self.backend.is_device else HostTransport()
        self.staging = StagingRing(transport, self.depth)
        self._active: _Shape | None = None  # the shape of the step being run (its mask buffers)
        self._dropouts = self._attach_dropouts()
        self.eager_reason = self._eager_reason()
        self.classes: int | None = None  # from the first eager step: the captured steps check labels here

    def _eager_reason(self) -> str | None:
        if self.capture is False:
            return "capture off"
        others = [h for h in self.net.hooks if not hasattr(h, "capture_blocker")]
        if others:  # offload's scheduler says itself whether its step can be captured (_hooks_reason)
            return f"hooks on the network ({', '.join(type(h).__name__ for h in others)}: offload or listeners)"
        if self.capture == "record" and any(type(node.layer).__name__ == "Flatten" for node in self.net.graph.nodes):
            return ("Flatten copies outside a kernel launch, which the simulator's stand-in graph does not replay "
                    "(a GPU's capture holds the copy)")
        if self.optimizer.in_backward is not None:
            return "the update runs inside backward (a hook)"
        if self.optimizer.name not in ("sgd", "adam"):
            return f"no device-scalar update for optimizer {self.optimizer.name!r}"
        return None

    def _hooks_reason(self) -> str | None:
        """Why the hooks that can take part in a capture (offload's scheduler on the pinned tier) cannot now:
        asked at capture time, after the warm-up steps chose the swap tier."""
        for hook in self.net.hooks:
            blocker = getattr(hook, "capture_blocker", None)
            reason = blocker() if blocker is not None else None
            if reason is not None:
                return reason
        return None

    def _hooks(self, method: str) -> None:
        for hook in self.net.hooks:
            call = getattr(hook, method, None)
            if call is not None:
                call()

    # -- dropout masks ------------------------------------------------------------------------------

    def _attach_dropouts(self) -> list[int]:
        """Point every Dropout layer at this runner's mask buffers (``close()`` detaches them)."""
        from engine.layers import Dropout

        found = []
        for index, node in enumerate(self.net.graph.nodes):
            if isinstance(node.layer, Dropout):
                if node.layer.mask_fill is not None:
                    raise RuntimeError(f"{node.name}: its dropout masks already come from another StepRunner")
                node.layer.mask_fill = self._mask_filler(index)
                found.append(index)
        return found

    def _mask_filler(self, index: int) -> Any:
        def fill(out: Any) -> None:
            from kernels.cuda.elementwise import copy

            if self._active is None:
                raise RuntimeError("a training forward outside StepRunner.step() on a network whose dropout masks "
                                   "the runner fills: call runner.close() first")
            copy(self._active.masks[index], out)  # a launch: the graph holds it, replays copy the new mask

        return fill

    def close(self) -> None:
        """Give the Dropout layers back their own host draws."""
        for index in self._dropouts:
            self.net.graph.nodes[index].layer.mask_fill = None
        self._dropouts = []

    def _new_shape(self, x: np.ndarray, y: np.ndarray) -> _Shape:
        xp = self.backend.xp
        shape = _Shape(xp.empty(x.shape, np.float32), xp.empty(y.shape, np.int64))
        program = self.net.program(int(x.shape[0]), True)
        if self.keep_logits:
            shape.logits = xp.empty(program.buffers[program.output].shape, np.float32)
        if self._dropouts:
            for step in program.forward_steps:  # the order the eager forward draws in
                if step.node in self._dropouts:
                    mask_shape = tuple(program.buffers[step.inputs[0]].shape)
                    shape.dropouts.append((step.node, mask_shape))
                    shape.masks[step.node] = xp.zeros(mask_shape, np.uint8)
        return shape

    # -- the step -----------------------------------------------------------------------------------

    def _update(self) -> None:
        from kernels.cuda.optim import adam_update_from, sgd_update_from

        opt = self.optimizer
        params, grads = opt.parameters.flat, opt.gradients.flat
        if opt.name == "sgd":
            buffer = opt.state.views["momentum_buffer"] if opt.state is not None else grads
            sgd_update_from(_array(params), _array(grads), _array(buffer), self.scalars, opt.momentum,
                            opt.weight_decay, opt.nesterov, guard=self.loss_out)
        else:
            adam_update_from(_array(params), _array(grads), _array(opt.state.views["exp_avg"]),
                             _array(opt.state.views["exp_avg_sq"]), self.scalars, opt.beta1, opt.beta2, opt.eps,
                             opt.weight_decay, guard=self.loss_out)

    def _body(self, shape: _Shape) -> None:
        logits = self.net.forward(shape.x, training=True)
        from kernels.cuda.elementwise import copy

        if shape.logits is not None:  # the logits' slot is reused too: a copy for last_logits()
            copy(logits.array, shape.logits)
        self.net.loss(shape.y)  # checks the labels on the host when not capturing
        copy(self.net.loss_head.loss_array, self.loss_out)  # also the update's guard: a non-finite loss skips it
        self.classes = int(self.net.loss_head.saved["probs"].shape[1])
        self.net.backward()
        self._update()

    def _write_step_values(self, shape: _Shape, x: np.ndarray, y: np.ndarray) -> None:
        """Everything the step reads that changes per step, through the pinned staging ring: the update's
        scalars, the batch, the labels, and each Dropout's mask drawn now, in forward order, as the eager
        forward would draw it."""
        from kernels.cuda.optim import step_scalars

        opt = self.optimizer
        step = opt.steps_taken + 1
        values = step_scalars(opt.lr, getattr(opt, "beta1", 0.9), getattr(opt, "beta2", 0.999), step)
        items = [(self.scalars, np.asarray(values, np.float32)), (shape.y, np.asarray(y, np.int64))]
        if isinstance(x, np.ndarray):
            items.append((shape.x, np.asarray(x, np.float32)))
        else:  # a batch already on the device (engine train's input ring): copied on this stream
            shape.x[...] = x
        for index, mask_shape in shape.dropouts:
            items.append((shape.masks[index], self.net.graph.nodes[index].layer.draw_mask(mask_shape)))
        self.staging.stage(items)

    def step(self, x: Any, y: np.ndarray) -> None:
        """One training step on a batch (images on the host or the device, labels on the host); the loss stays
        on the device (``last_loss()`` reads it). A non-finite loss skips the update on the device."""
        start, waited = time.perf_counter(), self.staging.wait_seconds
        if y.size and (y.min() < 0 or (self.classes is not None and y.max() >= self.classes)):
            raise ValueError(f"labels must lie in [0, {self.classes}), got values from {y.min()} to {y.max()}")
        key = tuple(x.shape)
        shape = self.shapes.get(key)
        if shape is None:
            shape = self.shapes[key] = self._new_shape(x, y)
        if shape.graph is not None and shape.epoch != memory_epoch(self.net):
            shape.graph = None  # a block moved since the capture: its addresses are stale
            shape.eager_steps = 0
        context = self.stream if self.stream is not None else _nothing()
        self._active = shape
        try:
            with context:
                self._run(shape, x, y)
        finally:
            self._active = None
        self.optimizer.steps_taken += 1
        self.host_seconds += time.perf_counter() - start - (self.staging.wait_seconds - waited)

    @property
    def wait_seconds(self) -> float:
        """Host time spent waiting for a staging buffer's copy (the GPU's time, not the host's work)."""
        return self.staging.wait_seconds

    def _run(self, shape: _Shape, x: np.ndarray, y: np.ndarray) -> None:
        self._write_step_values(shape, x, y)
        captured_now = False
        if shape.graph is None and self.eager_reason is None and shape.eager_steps >= self.warmup:
            self.eager_reason = self._hooks_reason()
        if shape.graph is None and self.eager_reason is None and shape.eager_steps >= self.warmup:
            counters = self._host_counters()
            hook_states = [(hook, hook.capture_checkpoint()) for hook in self.net.hooks
                           if hasattr(hook, "capture_checkpoint")]  # offload's per-step figures
            try:
                shape.graph = self._capture(shape)
            except Exception as exc:
                if not self.fallback:
                    raise
                # the capture ran some of the step's Python: its host counters go back, then the step runs
                # eagerly, as every later one (the same weights: the eager step is what the graph replays)
                self._restore_host_counters(counters)
                for hook, state in hook_states:
                    hook.capture_restore(state)
                self.capture_error = f"{type(exc).__name__}: {exc}"
                self.eager_reason = f"the capture failed ({self.capture_error})"
                self._body(shape)
                shape.eager_steps += 1
                return
            shape.epoch = memory_epoch(self.net)
            shape.captures += 1
            shape.launches = len(shape.graph)
            captured_now = True  # the capture ran the step's Python (its host counters) once
            self._hooks("captured")
        if shape.graph is not None:
            shape.graph.launch(self.stream)
            shape.replays += 1
            if not captured_now:
                self._advance_host_counters()
                self._hooks("replayed")  # offload's per-step figures (OffloadScheduler.replayed)
        else:
            self._body(shape)
            shape.eager_steps += 1

    def _host_counters(self) -> dict[int, int]:
        return {i: int(node.layer.num_batches_tracked) for i, node in enumerate(self.net.graph.nodes)
                if hasattr(node.layer, "num_batches_tracked")}

    def _restore_host_counters(self, counters: dict[int, int]) -> None:
        for i, value in counters.items():
            self.net.graph.nodes[i].layer.num_batches_tracked = value

    def _advance_host_counters(self) -> None:
        """What a step does on the host besides launching kernels, which a replay does not: batch norm's
        ``num_batches_tracked`` (a torchvision buffer, saved in checkpoints; no kernel reads it)."""
        for node in self.net.graph.nodes:
            if hasattr(node.layer, "num_batches_tracked"):
                node.layer.num_batches_tracked += 1

    def _capture(self, shape: _Shape) -> Any:
        self.backend.capturing = True
        try:
            if self.capture == "cupy":
                return cupy_capture(lambda: self._body(shape), self.stream)
            return record_capture(lambda: self._body(shape))
        finally:
            self.backend.capturing = False

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()

    def last_loss(self) -> float:
        """The last step's loss (waits for it)."""
        self.synchronize()
        return float(self.backend.to_host(self.loss_out)[0])

    def last_logits(self, shape: tuple[int, ...]) -> np.ndarray:
        """The logits of the last step on a batch of ``shape`` (waits for them; needs ``keep_logits``)."""
        logits = self.shapes[tuple(shape)].logits
        if logits is None:
            raise RuntimeError("StepRunner(keep_logits=False) keeps no logits")
        self.synchronize()
        return self.backend.to_host(logits)


def residual_graph(channels: int = 2, image: int = 4, classes: int = 3, dropout: float = 0.0) -> Any:
    """A residual block, as ResNet-18's steps are made, small enough for the simulator (tests, --dry runs).
    No Flatten: its copy is CuPy's, not a launch, which a real capture holds and the simulator's recorded
    launches would miss. ``dropout``: a Dropout of that p on the block's branch (MobileNetV2's stand-in:
    a per-step mask the graph must not bake in)."""
    from engine.graph import Graph
    from engine.layers import Add, BatchNorm2d, Conv2d, Dense, Dropout, GlobalAvgPool, ReLU

    branch = [("drop", Dropout(dropout), ["relu1"])] if dropout else []
    return Graph(
        [
            ("conv1", Conv2d(3, channels, 3, 1, 1), ["input"]),
            ("bn1", BatchNorm2d(channels), ["conv1"]),
            ("relu1", ReLU(), ["bn1"]),
            *branch,
            ("conv2", Conv2d(channels, channels, 3, 1, 1), ["drop" if dropout else "relu1"]),
            ("add", Add(), ["conv2", "relu1"]),
            ("relu2", ReLU(), ["add"]),
            ("gap", GlobalAvgPool(), ["relu2"]),
            ("fc", Dense(channels, classes, bias=False), ["gap"]),  # a bias costs the simulator 1.6 s a step
        ],
        input_shape=(3, image, image),
    )


def _array(view: Any) -> Any:
    return view.array if hasattr(view, "array") else view


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None

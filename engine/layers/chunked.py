"""A convolution, its batch norm, its activation and a max-pool run a few images at a time (issue 30).

Why: at ImageNet size the first layers make the largest tensors of a step. ResNet-18's stem at
224×224, batch 32, makes three of 98 MiB (the conv's output, the batch norm's, the ReLU's) and keeps
two for backward; MobileNetV2's second block makes 147 MiB ones. Offload moves what is *kept*, but
the tensors of the moment itself stay, and they grow with the batch. Every op here but batch norm is
per image, so a chunk of images is an ordinary call on fewer images; batch norm couples the batch
and is the barrier: its statistics need every image before the first is normalized, and its
backward needs Σdy and Σdy·x̂ over every image before the first dx.

``ChunkedConvBN`` is one node of the graph that stands for conv → batch norm → [ReLU | ReLU6] →
[MaxPool2d] (``engine.chunking.fuse_chunkable`` rewrites a graph's eligible chains into it). Its batch is walked in
chunks of ``CHUNK_IMAGES`` images, in order:

* forward: pass 1 runs the conv on each chunk and carries the statistics' sums
  (``batchnorm_chunk_statistics``: one pass, shifted float64 sums); the barrier finishes them; pass 2
  normalizes, activates and pools each chunk into the output;
* backward: pass 1 rebuilds each chunk's batch-norm output y and dy (the pool's and the activation's
  backward) and carries (Σdy, Σdy·x̂); the barrier finishes them (β's and γ's gradients); pass 2
  rebuilds y and dy again, takes batch norm's dx and runs the conv's backward on the chunk.

Two modes, chosen by the plan (``mode``), **the same bits** in both:

* ``"keep"``: y (the conv's output normalized in place) is kept for backward as FF_CACHE, as the separate layers
  kept their batch norm's output; a chain without activation or pool (ResNet's conv2 + bn2, MobileNetV2's
  projections) keeps its output instead, which is y (``keeps_output``): MobileNetV2 at 224, batch 32, keeps 24.5 MiB
  less with ``--offload-n 1`` (``engine memory``: 816 → 784 MiB), as its 112-pixel projection's output is kept by
  the next conv anyway; ResNet-18's are read by an Add, and keep the same. Backward rebuilds the gradient per chunk
  in each pass (the pool's backward from the kept argmax; the activation's mask from y is applied inside the
  batch-norm kernels, ``activation=``, so no pass writes dy: MobileNetV2's chunked layers 425–436 → 388–406 ms a
  step). Measured on ResNet-18's stem at 224, batch 32 (median of 3 steps, per-node hooks): rebuilding the
  activation and the pool's argmax too took its backward from 97 ms (the separate layers) to 238 ms, so both modes
  keep the argmax (a byte per pooled output): 125 ms. Tried and dropped: dy of the whole batch in keep mode's
  scratch, made once by pass 1: 114 ms, for 98 MiB more at the stem and 147 MiB at MobileNetV2's 112-pixel expand;
* ``"recompute"``: nothing but the input (the conv keeps it anyway), 3·C statistics and the pool's argmax
  is kept; each backward pass runs the conv again on its chunk, so the layer's tensors at any moment are one
  chunk's (Checkmate's recomputation, not Capuchin's swap: see below). It costs two more conv forwards in
  backward, less a chunk: pass 2 runs last chunk first and starts with what pass 1 left in the scratch (y and
  the pool's gradient). The forward runs each conv once: without a pool, pass 1 writes the conv's output into
  the layer's output, which holds it until pass 2 normalizes it in place (no scratch for it either). With a
  pool the output is the pooled one, so pass 2 runs the conv again on every chunk but the last, still in the
  scratch: three more conv forwards in all, less two chunks, unless the pass is widened (``widenable``).
  ``python benchmarks/step_profile.py --model M --chunks recompute|keep`` at 224, batch 32, median of 4 steps:
  the chunked layers' forward in recompute mode is now keep mode's (MobileNetV2 163 against 158 ms, ResNet-18 214
  against 241; with each conv run twice it had been 182-254 and 337-367 ms in per-node hooks alternating with the
  tree before); their backward is what recomputing costs (MobileNetV2 423 against 283 ms, ResNet-18 657 against
  394).

**Exact for any mode, any offload, any batch split.** The weight gradient is the sum over chunks in
a fixed order, each chunk's the conv kernel's own on those ``CHUNK_IMAGES`` images (``dw = W₃; dw += W₂; …``:
pass 2 runs last chunk first, so that it starts with the chunk pass 1 ended with, still in the scratch);
the statistics and the gradient sums are carried across calls at image boundaries; the conv's
forward and backward-data are called on the same chunks in both modes. So recomputing a chunk
gives the bits it had, and keep, recompute, offload on or off give the same weights
(``tests/engine/test_chunked.py``). The chunk size is fixed (not chosen per run) because it is part
of the arithmetic: a weight gradient summed over other chunks rounds differently.

Why recompute rather than swap the waiting tensors (the issue's first sketch: the conv's output
chunks wait at the barrier in the swap file): on this machine the disk reads 1.0–1.4 GiB/s
(docs/offload.md), so ResNet-18's stem at batch 32 would move 98 MiB out and 3 × 98 MiB back per
step (~0.3 s of disk), while the stem's conv forward on 8-image chunks takes ~75 ms: three of them
cost less, with no IO threads competing for the two cores and nothing written.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from engine.layers.activation import ReLU, ReLU6
from engine.layers.base import BufferSpec, InputGradients, Layer, ParameterSpec, SavedSpec, Shape, checked_array
from engine.layers.batchnorm import BatchNorm2d
from engine.layers.conv import Conv2d
from engine.layers.pool import MaxPool2d
from engine.memory import ArrayType, Tensor

CHUNK_IMAGES = 8
"""Images per chunk: part of the arithmetic (module docstring), so one value for every run. 8 keeps the
conv calls large at the sizes that are chunked (8 × 64 × 112 × 112 outputs for ResNet-18's stem: the
stem's forward 74–77 ms for 32 images in one call, 75 ms as four calls of 8 since ``conv_stem`` cuts at
least two images per thread chunk (83–89 ms before); weight gradient 62.1 → 68.0 ms; 64→64 3×3 @56:
28.9 → 30.0 ms), while a chunk's tensors are a quarter of batch 32's."""

CHUNK_MIN_PIXELS = 56 * 56
"""A chain is made chunkable when its conv's output plane has at least this many pixels: ImageNet's
112×112 and 56×56 stages (where the large tensors are); never a CIFAR-size layer."""


def _chunks(n: int) -> Iterator[tuple[int, int]]:
    for a in range(0, n, CHUNK_IMAGES):
        yield a, min(a + CHUNK_IMAGES, n)


class _Carver:
    """Views of one float32 scratch buffer, handed out in order (float64 first, for alignment)."""

    def __init__(self, flat: np.ndarray | None) -> None:
        self.flat = flat
        self.used = 0  # float32 elements

    @staticmethod
    def elements(shape: Shape, dtype: Any) -> int:
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        return -(-nbytes // 16) * 4  # whole 16-byte units, so the next view stays aligned

    def take(self, shape: Shape, dtype: Any = np.float32) -> np.ndarray:
        size = self.elements(shape, dtype)
        assert self.flat is not None
        view = self.flat[self.used:self.used + size].view(np.uint8)[:int(np.prod(shape)) * np.dtype(dtype).itemsize]
        self.used += size
        return view.view(dtype).reshape(shape)


class _Carved(Layer):
    """What the chunked layers share: working memory carved from one scratch buffer by ``_scratch_layout(x_shape,
    phase, dx)`` (the views in order), and parameters handed on to their parts by ``_share`` whenever the network
    sets them."""

    def _scratch_layout(self, x_shape: Shape, phase: str, dx: str = "new") -> list[tuple[str, Shape, Any]]:
        raise NotImplementedError

    def _share(self, kind: str, tensors: dict[str, Any]) -> None:
        raise NotImplementedError

    def _scratch_elements(self, x_shape: Shape, phase: str, dx: str = "new") -> int:
        return sum(_Carver.elements(shape, dtype) for _, shape, dtype in self._scratch_layout(x_shape, phase, dx))

    def _carve(self, scratch: Tensor | None, x_shape: Shape, phase: str, dx: str = "new") -> dict[str, np.ndarray]:
        carver = _Carver(None if scratch is None else checked_array(scratch, self.describe(), "scratch"))
        return {name: carver.take(shape, dtype) for name, shape, dtype in self._scratch_layout(x_shape, phase, dx)}

    def forward_scratch(self, input_shapes: list[Shape]) -> int:
        return self._scratch_elements(tuple(input_shapes[0]), "forward")

    def inference_working_specs(self, input_shapes: list[Shape]) -> list[SavedSpec]:
        return [SavedSpec("scratch", (self._scratch_elements(tuple(input_shapes[0]), "infer"),))]

    def backward_scratch(self, input_shapes: list[Shape], need: tuple[bool, ...] | None = None,
                         accumulate: tuple[bool, ...] | None = None) -> int:
        return self._scratch_elements(tuple(input_shapes[0]), "backward", self._dx_kind(need, accumulate))

    def _backward_start(self, x_shape: Shape, need_input_grads: list[bool], accumulate: Any) -> tuple:
        """(adding, dx, its array, the carved scratch) of a backward: the input gradient not asked for (None),
        added into ``accumulate``'s pending one (``adding``: each chunk through the scratch's "dx" first), or a
        tensor of its own."""
        kind = self._dx_kind(need_input_grads, accumulate and [a is not None for a in accumulate])
        adding = kind == "add"
        dx = None if kind == "none" else (accumulate[0] if adding else self.input_grad(x_shape))
        scratch = self.scratch(ArrayType.BP_WORKING_MEM, self._scratch_elements(x_shape, "backward", kind))
        carved = self._carve(scratch, x_shape, "backward", kind)
        return adding, dx, None if dx is None else self._array(dx, "dx"), carved

    @staticmethod
    def _dx_kind(need: Any, accumulate: Any) -> str:
        """The input gradient: "none" (not asked for), "add" (into a pending one) or "new" (a tensor of its own)."""
        if need is not None and not need[0]:
            return "none"
        return "add" if accumulate and accumulate[0] else "new"

    # params, grads and buffers are set by the network (bind, the gradient storage, each backward's
    # per-layer gradients): the parts follow every assignment
    params = property(lambda self: self._params,
                      lambda self, v: (setattr(self, "_params", v), self._share("params", v)))
    grads = property(lambda self: self._grads,
                     lambda self, v: (setattr(self, "_grads", v), self._share("grads", v)))
    buffers = property(lambda self: self._buffers,
                       lambda self, v: (setattr(self, "_buffers", v), self._share("buffers", v)))

    def _array(self, tensor: Tensor | np.ndarray, argument: str) -> np.ndarray:
        """What the chunk loops slice: the tensor's array, checked as the kernel table checks its arguments (a
        swapped-out or retired tensor raises here, not after a chunk read stale bytes)."""
        return checked_array(tensor, self.describe(), argument)


class ChunkedConvBN(_Carved):
    """conv → batch norm → [activation] → [max-pool] over chunks of images (module docstring)."""

    keeps_input = True
    input_gradients = InputGradients.NEW
    accumulates_input_gradients = True  # pass 2 adds each chunk's dx into a pending gradient (``backward``)
    qualified_names = True  # parameters keep the separate layers' names (conv1.weight, bn1.bias, ...)

    def __init__(self, conv: Conv2d, bn: BatchNorm2d, act: ReLU | None = None, pool: MaxPool2d | None = None,
                 mode: str = "keep") -> None:
        super().__init__()
        self.conv, self.bn, self.act, self.pool = conv, bn, act, pool
        self.parts = [p for p in (conv, bn, act, pool) if p is not None]
        self.activation = None if act is None else ("relu6" if isinstance(act, ReLU6) else "relu")
        self.wide: dict[int, frozenset[str]] = {}  # batch size -> the widened passes (``widenable``)
        self.mode = mode

    @property
    def mode(self) -> str:
        return self._mode

    @mode.setter
    def mode(self, mode: str) -> None:
        if mode not in ("keep", "recompute"):
            raise ValueError(f"{self.describe()}: mode must be 'keep' or 'recompute', got {mode!r}")
        self._mode = mode
        self.wide = {}

    def widenable(self) -> tuple[str, ...]:
        """The passes of recompute mode that can hold the whole batch in working memory instead of running the
        conv again, where the step has room for it (``Network.program`` decides per batch size and sets ``wide``):

        * "forward", with a pool: pass 1 keeps every chunk's conv output and pass 2 reads it (without a pool the
          layer's output holds it already);
        * "backward": pass 1 keeps every chunk's y and pass 2 reads it.

        Recompute mode exists to bound what is *kept* between forward and backward; working memory at a moment
        where the step's arena is below its peak anyway costs no limit anything. ResNet-18 at 224, batch 32,
        every chunked layer recomputing: the stem's forward has 85.7 MiB of room under the step's peak (130.5
        MiB, set in layer1's backward) and needs 73.5 MiB more; MobileNetV2's five 49-55 MiB ys fit their
        backward moments (74-142 MiB of room). Per-node hooks, every chunked layer recomputing, two runs alternating
        with the tree before: MobileNetV2's chunked backward 343-384 against 369-380 ms (the widened 1×1 and
        depthwise convs are cheap: within the noise), its forward 121-149 against 182-254 (the no-pool change
        above); ResNet-18's forward 218-225 against 337-367 (its stem's forward widened: 73.5 MiB more working
        memory at a moment with 85.7 MiB of room)."""
        if self._mode != "recompute":
            return ()
        return ("forward", "backward") if self.pool is not None else ("backward",)

    def _wide(self, batch: int, phase: str) -> bool:
        return phase in self.wide.get(batch, ())  # only recompute mode's (a mode change clears ``wide``)

    @property
    def keeps_output(self) -> bool:
        """Keep mode, no activation and no pool: the batch norm's output is the layer's output, so backward reads
        the output (the step program keeps it: engine/program.py), not a second copy saved as "y"."""
        return self._mode == "keep" and self.act is None and self.pool is None

    def output_rebuilt_from(self, x_shape: Shape) -> str | None:
        """What the offload plan may rebuild this layer's output from instead of swapping it, on an input of
        ``x_shape``; None: nothing (``engine.offload.plan.recompute_candidates``).

        * "y", keep mode with an activation and no pool: the output is activation(y), one elementwise pass with
          the activation's kernel, whose clamp is the chunk kernel's (the same bits, -0.0 and NaN included).
          ``engine memory --model M --image-size 224 --offload-n 1``, batch 32: MobileNetV2 writes 841.8 MiB
          per step instead of 1.26 GiB (seven expand and depthwise chains' outputs, 447 MiB, rebuilt instead)
          and plans a 627.3 MiB peak instead of 651.8; ResNet-18 358.4 MiB instead of 407.4. MobileNetV2
          ``engine train --offload-n auto`` in a cgroup limit of 800 MiB (three alternating rounds against the
          tree before): 461.5 instead of 744.0 MiB written per step, stall 125-145 instead of 296-322 ms, step
          1.15-1.24 instead of 1.30-1.37 s, and no layer recomputing (one before); under 700 MiB 1.42 against
          1.56 s.
        * "x", recompute mode with no pool: the output is the forward's pass 2 again, the conv of each chunk of the
          input x normalized with the saved scale and shift, written straight into the output. A conv that needs working
          memory on a chunk (the stride-1 depthwise ones: 0.4-2.6 MiB) gets it from the offload arena's tail
          (``rebuild_scratch_elements``; ``OffloadPlan.rebuild_scratch_bytes``). Recompute mode keeps no y, so under a
          tight limit its outputs were what the swap file moved. The input may itself be a rebuilt output (the plan
          rebuilds that one first), or the network's input, which the INPUT ring holds all step
          (``engine.offload.plan.NETWORK_INPUT``: MobileNetV2's stem). MobileNetV2 at 224, batch 32, under 620 MiB
          (seven chains recompute there), ``engine train --offload-n auto``, three alternating rounds against the tree
          before either rebuild: 327.7 instead of 625.6 MiB written per step, stall 117-137 instead of 255-302 ms, step
          1.41-1.57 instead of 1.70-1.78 s (unlimited: 0.88-1.34 s that hour), the same loss. With 1×1 convs only and no
          chains it had been 360.5 MiB and 1.49-1.61 s. With the depthwise and stem outputs too, under 610 MiB: 168
          instead of 232 MiB written, but the step did not move (``python benchmarks/cgroup_proof.py --goal``: 1.39× its
          unlimited step against 1.37-1.38×).
        * None otherwise: a pool's output needs the pool."""
        if self.pool is not None:
            return None
        if self._mode == "keep":
            return "y" if self.act is not None else None
        return "x" if self.backend is not None else None

    def rebuild_scratch_elements(self, x_shape: Shape) -> int:
        """Float32 working memory the "x" rebuild's conv needs on a chunk of an input of ``x_shape`` (0: none)."""
        return self._conv_workspace(x_shape, "forward")

    def _conv_workspace(self, x_shape: Shape, direction: str) -> int:
        """The conv's scratch (float32 elements) in ``direction`` ("forward", "backward_data", "backward_weight")
        on a chunk of an input of ``x_shape``: the larger of a full chunk's and the last one's."""
        conv, n = self.conv, x_shape[0]
        size = getattr(self.backend.kernels, f"conv2d_{direction}_workspace_size")
        return max(int(size(self._chunk_shape(x_shape, m), conv.weight_shape, conv.stride, conv.padding, conv.groups))
                   for m in {min(n, CHUNK_IMAGES), n % CHUNK_IMAGES or CHUNK_IMAGES})

    def recompute_output(self, inputs: list[Tensor], out: Tensor, scratch: Any = None) -> None:
        """The offload plan's rebuild (``output_rebuilt_from``): from [y], out = activation(y) with the activation's
        kernel; from [x, scale_shift], each chunk's conv into out, then its batch-norm apply and activation in
        place (the forward's pass 2 with out as z: the same kernels, the same bits)."""
        k = self.backend.kernels
        if self._mode == "keep":
            getattr(k, f"{self.activation}_forward")(inputs[0], out)
            return
        xa, ss, oa = self._array(inputs[0], "x"), self._array(inputs[1], "scale_shift"), self._array(out, "out")
        for a, b in _chunks(xa.shape[0]):
            z = oa[a:b]
            self._conv_forward(xa[a:b], z, scratch)
            k.batchnorm_chunk_apply(z, ss, self.activation, None, z)

    # ---- declarations ------------------------------------------------------------------------------

    def _qualified(self, layer: Layer, specs: list) -> list:
        return [type(s)(f"{layer.name}.{s.name}", *[getattr(s, f) for f in s.__dataclass_fields__ if f != "name"])
                for s in specs]

    def parameter_specs(self) -> list[ParameterSpec]:
        conv, bn = self.conv, self.bn
        return self._qualified(conv, conv.parameter_specs()) + self._qualified(bn, bn.parameter_specs())

    def buffer_specs(self) -> list[BufferSpec]:
        return self._qualified(self.bn, self.bn.buffer_specs())

    def init_parameters(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
        values = {f"{self.conv.name}.{k}": v for k, v in self.conv.init_parameters(rng).items()}
        values.update({f"{self.bn.name}.{k}": v for k, v in self.bn.init_parameters(rng).items()})
        return values

    @property
    def num_batches_tracked(self) -> int:
        return self.bn.num_batches_tracked

    @num_batches_tracked.setter
    def num_batches_tracked(self, value: int) -> None:
        self.bn.num_batches_tracked = value

    def shapes(self, x_shape: Shape) -> tuple[Shape, Shape]:
        """(the conv's output shape, the layer's output shape)."""
        z = self.conv.output_shape([tuple(x_shape)])
        self.bn.output_shape([z])
        return z, (self.pool.output_shape([z]) if self.pool is not None else z)

    def output_shape(self, input_shapes: list[Shape]) -> Shape:
        self.check_num_inputs(input_shapes)
        return self.shapes(input_shapes[0])[1]

    def saved_specs(self, input_shapes: list[Shape]) -> list[SavedSpec]:
        z, out = self.shapes(input_shapes[0])
        C = z[1]
        specs = [SavedSpec("scale_shift", (C, 2), np.float64), SavedSpec("save_invstd", (C,))]
        if self.mode == "keep" and not self.keeps_output:
            specs.insert(0, SavedSpec("y", z))
        if self.pool is not None:  # a byte per output (ResNet-18's stem at batch 32: 6.1 MiB against y's 98)
            specs.append(SavedSpec("argmax", out, self.pool.argmax_dtype))
        return specs

    def _chunk_shape(self, shape: Shape, n: int) -> Shape:
        return (min(n, CHUNK_IMAGES), *shape[1:])

    def _scratch_layout(self, x_shape: Shape, phase: str, dx: str = "new") -> list[tuple[str, Shape, Any]]:
        """The views the scratch buffer is carved into, in order; ``phase`` "forward", "backward", "infer"; ``dx``
        (backward): "new" (the input gradient is a tensor of its own), "add" (added into a pending gradient: a chunk
        of it in the scratch first) or "none" (not asked for: no backward-data workspace either; ResNet-18's stem at
        224 declared 14.1 MiB for it, against 3.2 for its weight gradient's)."""
        n = x_shape[0]
        z, out = self.shapes(x_shape)
        zc = self._chunk_shape(z, n)
        C = z[1]
        forward = self._conv_workspace(x_shape, "forward")
        layout: list[tuple[str, Shape, Any]] = []
        if phase in ("forward", "infer"):
            if phase == "forward":
                layout.append(("sums", (C, 3), np.float64))
            layout.append(("conv", (forward,), np.float32))
            if phase == "infer" or (self.mode == "recompute" and self.pool is not None):
                layout.append(("z", z if phase == "forward" and self._wide(n, "forward") else zc, np.float32))
            if self.pool is not None:
                if phase == "forward" and self.mode == "keep":
                    layout.append(("a", zc, np.float32))
                if phase == "infer":  # training keeps the argmax for backward (saved_specs)
                    layout.append(("argmax", self._chunk_shape(out, n), self.pool.argmax_dtype))
        else:
            layout.append(("sums", (C, 2), np.float64))
            backward = max(self._conv_workspace(x_shape, "backward_data") if dx != "none" else 0,
                           self._conv_workspace(x_shape, "backward_weight"))
            layout.append(("conv", (backward,), np.float32))
            layout.append(("partial", (int(np.prod(self.conv.weight_shape)) + (z[1] if self.conv.has_bias else 0),),
                           np.float32))
            if self.mode == "recompute":
                layout.append(("conv_forward", (forward,), np.float32))
                layout.append(("y", z if self._wide(n, "backward") else zc, np.float32))
            if self.pool is not None or self.mode == "keep":  # recompute without a pool: dz goes over its y
                layout.append(("d", zc, np.float32))
            if dx == "add":
                layout.append(("dx", self._chunk_shape(x_shape, n), np.float32))
        return layout

    # ---- wiring ------------------------------------------------------------------------------------

    def tensor_key(self, node_name: str, name: str) -> str:
        return f"{self.bn.name}.{name}" if name == "num_batches_tracked" else name

    def _share(self, kind: str, tensors: dict[str, Any]) -> None:
        """Hand each part its own tensors of ``tensors`` (keyed by full name) under its short names."""
        for part in getattr(self, "parts", ()):
            prefix = f"{part.name}."
            setattr(part, kind, {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)})

    def bind(self, backend: Any, mgr: Any, params: dict[str, Any], grads: dict[str, Any],
             buffers: dict[str, Any]) -> None:
        for part in self.parts:
            part.backend, part.mgr = backend, mgr
        super().bind(backend, mgr, params, grads, buffers)

    def use_manager(self, mgr: Any) -> None:
        super().use_manager(mgr)
        for part in self.parts:
            part.use_manager(mgr)

    # ---- compute -----------------------------------------------------------------------------------

    def _conv_forward(self, x: np.ndarray, z: np.ndarray, scratch: np.ndarray) -> None:
        c = self.conv
        self.backend.kernels.conv2d_forward(x, c.params["weight"], c.params.get("bias"), z, c.stride, c.padding,
                                            c.groups, scratch)

    def _pool_forward(self, a: np.ndarray, out: np.ndarray, argmax: np.ndarray) -> None:
        p = self.pool
        self.backend.kernels.maxpool2d_forward(a, out, argmax, p.kernel_size, p.stride, p.padding)

    def forward(self, inputs: list[Tensor], training: bool) -> Tensor:
        x = inputs[0]
        x_shape = tuple(x.shape)
        z_shape, out_shape = self.shapes(x_shape)
        out = self.output(out_shape)
        k = self.backend.kernels
        xa, oa = self._array(x, "x"), self._array(out, "out")
        if not training:
            scratch = self.mgr.create(ArrayType.FF_WORKING_MEM, (self._scratch_elements(x_shape, "infer"),))
            s = self._carve(scratch, x_shape, "infer")
            bn, buffers = self.bn, self.bn.buffers
            for a, b in _chunks(x_shape[0]):
                z = s["z"][:b - a]
                self._conv_forward(xa[a:b], z, s["conv"])
                k.batchnorm_forward_infer(z, bn.params["weight"], bn.params["bias"], buffers["running_mean"],
                                          buffers["running_var"], z, bn.eps)
                if self.activation is not None:
                    getattr(k, f"{self.activation}_forward")(z, z)
                if self.pool is not None:
                    self._pool_forward(z, oa[a:b], s["argmax"][:b - a])
                else:
                    oa[a:b] = z
            return out
        keep = self.mode == "keep"
        y = out if self.keeps_output else (self.keep("y", z_shape) if keep else None)
        scale_shift = self.keep("scale_shift", (z_shape[1], 2), np.float64)
        save_invstd = self.keep("save_invstd", (z_shape[1],))
        argmax = None if self.pool is None else self.keep("argmax", out_shape, self.pool.argmax_dtype)
        argmax_a = None if argmax is None else self._array(argmax, "argmax")
        scratch = self.scratch(ArrayType.FF_WORKING_MEM, self._scratch_elements(x_shape, "forward"))
        s = self._carve(scratch, x_shape, "forward")
        ya, ss = (self._array(y, "y") if keep else None), self._array(scale_shift, "scale_shift")

        # recompute mode without a pool: pass 1 writes each chunk's conv output into the layer's output, which
        # holds it until pass 2 normalizes it in place (no conv is run twice; module docstring)
        direct = not keep and self.pool is None
        wide = self._wide(x_shape[0], "forward")  # with a pool: the whole batch's conv output in the scratch

        def conv_chunk(a: int, b: int) -> np.ndarray:
            z = ya[a:b] if keep else (oa[a:b] if direct else (s["z"][a:b] if wide else s["z"][:b - a]))
            self._conv_forward(xa[a:b], z, s["conv"])
            return z

        for a, b in _chunks(x_shape[0]):  # pass 1: the statistics' sums, carried chunk after chunk
            k.batchnorm_chunk_statistics(conv_chunk(a, b), s["sums"], a == 0)
        bn = self.bn
        k.batchnorm_chunk_finish(s["sums"], x_shape[0] * z_shape[2] * z_shape[3], bn.params["weight"],
                                 bn.params["bias"], bn.buffers["running_mean"], bn.buffers["running_var"], ss,
                                 self._array(save_invstd, "save_invstd"), bn.momentum, bn.eps)
        bn.num_batches_tracked += 1
        for i, (a, b) in enumerate(reversed(list(_chunks(x_shape[0])))):  # pass 2: normalize, activate, pool
            # last chunk first: with a pool, recompute mode's last conv output is still in the scratch from pass 1
            if keep or direct or wide:
                z = ya[a:b] if keep else (oa[a:b] if direct else s["z"][a:b])
            else:
                z = s["z"][:b - a] if i == 0 else conv_chunk(a, b)
            if self.keeps_output or direct:  # the conv's output went to the layer's output: normalized in place
                k.batchnorm_chunk_apply(z, ss, self.activation, None, z)
            elif self.pool is None:
                k.batchnorm_chunk_apply(z, ss, self.activation, z if keep else None, oa[a:b])
            else:
                act = s["a"][:b - a] if keep else z
                k.batchnorm_chunk_apply(z, ss, self.activation, z if keep else None, act)
                self._pool_forward(act, oa[a:b], argmax_a[a:b])
        self.saved = {"x": x, "y": y, "scale_shift": scale_shift, "save_invstd": save_invstd, "argmax": argmax}
        return out

    def backward(self, dout: Tensor, need_input_grads: list[bool], reuse_dout: bool = False,
                 accumulate: list[Tensor | None] | None = None) -> list[Tensor | None]:
        """Two passes over the chunks (module docstring). ``accumulate``: [a pending gradient of the input or
        None]; given one, pass 2 writes each chunk's dx into the scratch and adds it into that chunk of the pending
        gradient (``add_forward``: the bits of the step program's sum of two whole tensors), so the input gradient
        needs no tensor of its own: ResNet-18's first conv of each block, whose input also feeds the skip."""
        saved = self.saved
        x = saved["x"]
        x_shape = tuple(x.shape)
        z_shape, _ = self.shapes(x_shape)
        k = self.backend.kernels
        conv, bn = self.conv, self.bn
        adding, dx, dxa, s = self._backward_start(x_shape, need_input_grads, accumulate)
        xa, da = self._array(x, "x"), self._array(dout, "dout")
        ya = None if saved["y"] is None else self._array(saved["y"], "y")
        ss = self._array(saved["scale_shift"], "scale_shift")
        save_invstd = self._array(saved["save_invstd"], "save_invstd")
        gamma, beta = bn.params["weight"], bn.params["bias"]
        argmax = None if saved["argmax"] is None else self._array(saved["argmax"], "argmax")

        wide = self._wide(x_shape[0], "backward")  # pass 1's ys of the whole batch in the scratch

        def y_and_dy(a: int, b: int, again: bool = False) -> tuple[np.ndarray, np.ndarray]:
            """The chunk's batch-norm output (kept, rebuilt, or rebuilt by pass 1 when ``again`` and wide) and the
            gradient of its activation's output: the layer's dout, or the pool's backward of it in ``s["d"]`` (the
            chunk kernels apply the activation's mask from y on the fly: one pass over y and the gradient,
            nothing written for it)."""
            if ya is not None:
                y = ya[a:b]
            elif wide and again:
                y = s["y"][a:b]
            else:
                y = s["y"][a:b] if wide else s["y"][:b - a]
                self._conv_forward(xa[a:b], y, s["conv_forward"])
                k.batchnorm_chunk_apply(y, ss, None, None, y)
            if self.pool is None:
                return y, da[a:b]
            d = s["d"][:b - a]
            p = self.pool
            k.maxpool2d_backward(da[a:b], argmax[a:b], d, p.kernel_size, p.stride, p.padding)
            return y, d

        act = self.activation
        for a, b in _chunks(x_shape[0]):  # pass 1: Σdy and Σdy·x̂, carried
            y, g = y_and_dy(a, b)
            k.batchnorm_chunk_gradient_sums(y, g, gamma, beta, s["sums"], a == 0, act)
        last = (y, g)  # the last chunk's y and gradient: pass 2 starts with it
        bn.grads["bias"][...] = s["sums"][:, 0]
        bn.grads["weight"][...] = s["sums"][:, 1]
        count = x_shape[0] * z_shape[2] * z_shape[3]
        dw, dbias = conv.grads["weight"], conv.grads.get("bias")
        partial_w = s["partial"][:dw.size].reshape(dw.shape)
        partial_b = None if dbias is None else s["partial"][dw.size:dw.size + dbias.size]
        for i, (a, b) in enumerate(reversed(list(_chunks(x_shape[0])))):  # pass 2: dx, the conv's backward
            y, g = last if i == 0 else y_and_dy(a, b, again=True)
            # dz: over the pool's gradient when there is one, else over the rebuilt y, used for the last time
            # here (the kernel reads each value before writing it): recompute mode then needs one chunk tensor
            # less (MobileNetV2's 112-pixel expand: 36.75 MiB); keep mode keeps y, so dz has its own
            d = s["d"][:b - a] if "d" in s else y
            k.batchnorm_chunk_dx(y, g, gamma, beta, save_invstd, s["sums"], count, d, act)
            if dx is not None:
                target = s["dx"][:b - a] if adding else dxa[a:b]
                k.conv2d_backward_data(d, conv.params["weight"], target, conv.stride, conv.padding,
                                       conv.groups, s["conv"])
                if adding:
                    k.add_forward(dxa[a:b], target, dxa[a:b])
            first = i == 0
            k.conv2d_backward_weight(xa[a:b], d, dw if first else partial_w, dbias if first else partial_b,
                                     conv.stride, conv.padding, conv.groups, s["conv"])
            if not first:  # the chunks' sums, last chunk first: dw = W₃; dw += W₂; ... (the same in both modes)
                np.add(dw, partial_w, out=dw)
                if dbias is not None:
                    np.add(dbias, partial_b, out=dbias)
        return [dx]


class ChunkedPair(_Carved):
    """Two chunked chains, the second the only reader of the first, run chunk by chunk as one node
    (``--chunks pairs``): the tensor between them and its gradient are never whole.

    Why: at 224 the tensor between two chunked chains is the step's largest and exists twice in backward (the
    second chain keeps it for its weight gradient, and makes its gradient whole before the first chain's backward
    starts). MobileNetV2's 112-pixel expansion: 147 MiB at batch 32, 588 MiB at 128, each. Here each pass
    recomputes the first chain's chunk from the pair's input (``benchmarks/pair_study.py``, which this layer
    follows call for call): MobileNetV2's features.2 pair holds 368.7 → 172.7 MiB at its worst moment at batch 32
    (1,434 → 430 MiB at 128), for ~70 ms more than the separate chains with their intermediate rebuilt (docs/offload.md,
    "Two chained chains as one").

    * forward: pass A the first conv per chunk, its statistics carried; pass B the first conv again, normalized
      and activated in the scratch, the second conv into the output, its statistics carried; pass C (last chunk
      first) the output normalized and activated in place;
    * backward, three passes over the rebuilt chunks (both chains' y from the input, with the saved scales and
      shifts): (1) the second batch norm's (Σdy, Σdy·x̂); (2) the second chain's dx, its conv's backward-data
      and the first batch norm's sums; (3) last chunk first, both chains' dx, the first conv's backward-data
      into dx and both weight gradients.

    The same bits as the two chains in either mode: every kernel runs on the same chunks of the same values, the
    carried sums in image order and the weight gradients last chunk first (``tests/engine/test_chunked.py``).
    Recompute only: it keeps nothing of the intermediate, so a keep mode would be the separate chains."""

    keeps_input = True
    input_gradients = InputGradients.NEW
    accumulates_input_gradients = True
    qualified_names = True
    keeps_output = False

    def __init__(self, first: ChunkedConvBN, second: ChunkedConvBN) -> None:
        super().__init__()
        if first.pool is not None or second.pool is not None:
            raise ValueError("a pair of chunked chains has no pool")
        self.stages = (first, second)
        self.parts = [*first.parts, *second.parts]
        first.mode = second.mode = "recompute"
        self.wide: dict[int, frozenset[str]] = {}  # never widened (``widenable``); Network clears it

    @property
    def mode(self) -> str:
        return "recompute"

    @mode.setter
    def mode(self, mode: str) -> None:
        if mode != "recompute":
            raise ValueError(f"{self.describe()}: a pair of chunked chains recomputes its chunks; it has no "
                             f"{mode!r} mode (leave out --chunks pairs to keep)")

    def widenable(self) -> tuple[str, ...]:
        return ()

    def output_rebuilt_from(self, x_shape: Shape) -> str | None:
        """None: the offload plan swaps (or keeps) the pair's output. Rebuilding it from x would run both chains'
        forward again per chunk, with one chunk of the intermediate in the arena's tail (``rebuild_scratch_bytes``,
        "the price of any rebuild" in ``build_plan``, a few MiB for a conv's workspace; here 38.5 MiB for MobileNetV2's
        features.2 pair at 224, 8 images of 96×112×112): the bytes a pair exists to avoid, at the limits where it is
        taken. Not built (2026-11-28)."""
        return None

    def part_input_shape(self, part: Layer, x_shape: Shape) -> Shape:
        """The input shape ``part`` (a conv of either stage) sees on an input of ``x_shape`` (the warm-up's jobs)."""
        return tuple(x_shape) if part in self.stages[0].parts else self.stages[0].shapes(tuple(x_shape))[1]

    # ---- declarations ------------------------------------------------------------------------------

    def parameter_specs(self) -> list[ParameterSpec]:
        return [s for stage in self.stages for s in stage.parameter_specs()]

    def buffer_specs(self) -> list[BufferSpec]:
        return [s for stage in self.stages for s in stage.buffer_specs()]

    def init_parameters(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
        values: dict[str, np.ndarray] = {}
        for stage in self.stages:  # in graph order: the separate chains' draws
            values.update(stage.init_parameters(rng))
        return values

    def counters(self) -> dict[str, Any]:
        """torchvision's num_batches_tracked names and the batch norms that count them (``Network.state_dict``)."""
        return {f"{stage.bn.name}.num_batches_tracked": stage.bn for stage in self.stages}

    def tensor_key(self, node_name: str, name: str) -> str:
        return name

    def shapes(self, x_shape: Shape) -> tuple[Shape, Shape]:
        """(the first chain's output shape, the pair's output shape)."""
        mid = self.stages[0].shapes(tuple(x_shape))[1]
        return mid, self.stages[1].shapes(mid)[1]

    def output_shape(self, input_shapes: list[Shape]) -> Shape:
        self.check_num_inputs(input_shapes)
        return self.shapes(input_shapes[0])[1]

    def saved_specs(self, input_shapes: list[Shape]) -> list[SavedSpec]:
        mid, out = self.shapes(tuple(input_shapes[0]))
        return [SavedSpec("scale_shift1", (mid[1], 2), np.float64), SavedSpec("save_invstd1", (mid[1],)),
                SavedSpec("scale_shift2", (out[1], 2), np.float64), SavedSpec("save_invstd2", (out[1],))]

    def _workspace(self, x_shape: Shape, directions: tuple[tuple[int, str], ...]) -> int:
        mid = self.shapes(x_shape)[0]
        inputs = (x_shape, mid)
        return max(self.stages[i]._conv_workspace(inputs[i], d) for i, d in directions)

    def _partial(self, stage: ChunkedConvBN, z_channels: int) -> int:
        return int(np.prod(stage.conv.weight_shape)) + (z_channels if stage.conv.has_bias else 0)

    def _scratch_layout(self, x_shape: Shape, phase: str, dx: str = "new") -> list[tuple[str, Shape, Any]]:
        """Views of the scratch, float64 first: "forward" (training), "infer", "backward" (``dx`` as
        ``ChunkedConvBN._scratch_layout``'s)."""
        n = x_shape[0]
        mid, out = self.shapes(x_shape)
        chunk = (min(n, CHUNK_IMAGES), *mid[1:])
        if phase in ("forward", "infer"):
            layout: list[tuple[str, Shape, Any]] = []
            if phase == "forward":
                layout += [("sums1", (mid[1], 3), np.float64), ("sums2", (out[1], 3), np.float64)]
            return layout + [("conv", (self._workspace(x_shape, ((0, "forward"), (1, "forward"))),), np.float32),
                             ("z1", chunk, np.float32)]
        directions = ((0, "forward"), (1, "forward"), (1, "backward_data"), (1, "backward_weight"),
                      (0, "backward_weight")) + (((0, "backward_data"),) if dx != "none" else ())
        first, second = self.stages
        layout = [("g1", (mid[1], 2), np.float64), ("g2", (out[1], 2), np.float64),
                  ("conv", (self._workspace(x_shape, directions),), np.float32),
                  ("partial1", (self._partial(first, mid[1]),), np.float32),
                  ("partial2", (self._partial(second, out[1]),), np.float32),
                  ("y1", chunk, np.float32), ("a1", chunk, np.float32),
                  ("y2", (min(n, CHUNK_IMAGES), *out[1:]), np.float32)]
        if dx == "add":
            layout.append(("dx", (min(n, CHUNK_IMAGES), *x_shape[1:]), np.float32))
        return layout

    # ---- wiring ------------------------------------------------------------------------------------

    def _share(self, kind: str, tensors: dict[str, Any]) -> None:
        for stage in getattr(self, "stages", ()):  # each stage hands its parts their own (by qualified name)
            setattr(stage, kind, tensors)

    def bind(self, backend: Any, mgr: Any, params: dict[str, Any], grads: dict[str, Any],
             buffers: dict[str, Any]) -> None:
        for stage in self.stages:
            stage.bind(backend, mgr, params, grads, buffers)
        super().bind(backend, mgr, params, grads, buffers)

    def use_manager(self, mgr: Any) -> None:
        super().use_manager(mgr)
        for stage in self.stages:
            stage.use_manager(mgr)

    # ---- compute -----------------------------------------------------------------------------------

    def forward(self, inputs: list[Tensor], training: bool) -> Tensor:
        first, second = self.stages
        k = self.backend.kernels
        x = inputs[0]
        x_shape = tuple(x.shape)
        mid, out_shape = self.shapes(x_shape)
        out = self.output(out_shape)
        xa, oa = self._array(x, "x"), self._array(out, "out")
        N = x_shape[0]
        if not training:  # each chunk through both chains, as the separate chains' inference does
            scratch = self.mgr.create(ArrayType.FF_WORKING_MEM, (self._scratch_elements(x_shape, "infer"),))
            s = self._carve(scratch, x_shape, "infer")
            for a, b in _chunks(N):
                z1, z2 = s["z1"][:b - a], oa[a:b]
                for stage, source, z in ((first, xa[a:b], z1), (second, z1, z2)):
                    bn = stage.bn
                    stage._conv_forward(source, z, s["conv"])
                    k.batchnorm_forward_infer(z, bn.params["weight"], bn.params["bias"], bn.buffers["running_mean"],
                                              bn.buffers["running_var"], z, bn.eps)
                    if stage.activation is not None:
                        getattr(k, f"{stage.activation}_forward")(z, z)
            return out
        kept = {name: self.keep(name, (shape[1], 2), np.float64) if name.startswith("scale")
                else self.keep(name, (shape[1],))
                for name, shape in (("scale_shift1", mid), ("save_invstd1", mid), ("scale_shift2", out_shape),
                                    ("save_invstd2", out_shape))}
        ss1, ss2 = self._array(kept["scale_shift1"], "scale_shift1"), self._array(kept["scale_shift2"], "scale_shift2")
        scratch = self.scratch(ArrayType.FF_WORKING_MEM, self._scratch_elements(x_shape, "forward"))
        s = self._carve(scratch, x_shape, "forward")

        def finish(stage: ChunkedConvBN, sums: np.ndarray, shape: Shape, ss: np.ndarray, invstd: str) -> None:
            bn = stage.bn
            k.batchnorm_chunk_finish(sums, N * shape[2] * shape[3], bn.params["weight"], bn.params["bias"],
                                     bn.buffers["running_mean"], bn.buffers["running_var"], ss,
                                     self._array(kept[invstd], invstd), bn.momentum, bn.eps)
            bn.num_batches_tracked += 1

        for a, b in _chunks(N):  # pass A: the first batch norm's statistics
            z1 = s["z1"][:b - a]
            first._conv_forward(xa[a:b], z1, s["conv"])
            k.batchnorm_chunk_statistics(z1, s["sums1"], a == 0)
        finish(first, s["sums1"], mid, ss1, "save_invstd1")
        for a, b in _chunks(N):  # pass B: the first chain's chunk, the second conv into the output, its statistics
            z1 = s["z1"][:b - a]
            first._conv_forward(xa[a:b], z1, s["conv"])
            k.batchnorm_chunk_apply(z1, ss1, first.activation, None, z1)
            second._conv_forward(z1, oa[a:b], s["conv"])
            k.batchnorm_chunk_statistics(oa[a:b], s["sums2"], a == 0)
        finish(second, s["sums2"], out_shape, ss2, "save_invstd2")
        for a, b in reversed(list(_chunks(N))):  # pass C: normalized and activated in place
            k.batchnorm_chunk_apply(oa[a:b], ss2, second.activation, None, oa[a:b])
        self.saved = {"x": x, **kept}
        return out

    def backward(self, dout: Tensor, need_input_grads: list[bool], reuse_dout: bool = False,
                 accumulate: list[Tensor | None] | None = None) -> list[Tensor | None]:
        first, second = self.stages
        k = self.backend.kernels
        saved = self.saved
        x = saved["x"]
        x_shape = tuple(x.shape)
        mid, out_shape = self.shapes(x_shape)
        N = x_shape[0]
        adding, dx, dxa, s = self._backward_start(x_shape, need_input_grads, accumulate)
        xa, da = self._array(x, "x"), self._array(dout, "dout")
        ss1, ss2, inv1, inv2 = (self._array(saved[name], name)
                                for name in ("scale_shift1", "scale_shift2", "save_invstd1", "save_invstd2"))
        bn1, bn2 = first.bn, second.bn
        count1, count2 = N * mid[2] * mid[3], N * out_shape[2] * out_shape[3]

        def rebuild(a: int, b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            """Both chains' batch-norm outputs y of the chunk (before their activations) and the first chain's
            output, from the input with the saved scales and shifts."""
            n = b - a
            y1, a1, y2 = s["y1"][:n], s["a1"][:n], s["y2"][:n]
            first._conv_forward(xa[a:b], y1, s["conv"])
            k.batchnorm_chunk_apply(y1, ss1, None, None, y1)
            if first.activation is None:
                a1[...] = y1
            else:
                getattr(k, f"{first.activation}_forward")(y1, a1)
            second._conv_forward(a1, y2, s["conv"])
            k.batchnorm_chunk_apply(y2, ss2, None, None, y2)
            return y1, a1, y2

        def conv_data(stage: ChunkedConvBN, d: np.ndarray, target: np.ndarray) -> None:
            c = stage.conv
            k.conv2d_backward_data(d, c.params["weight"], target, c.stride, c.padding, c.groups, s["conv"])

        def conv_weight(stage: ChunkedConvBN, source: np.ndarray, d: np.ndarray, first_chunk: bool,
                        partial: np.ndarray) -> None:
            c = stage.conv
            dw, dbias = c.grads["weight"], c.grads.get("bias")
            partial_w = partial[:dw.size].reshape(dw.shape)
            partial_b = None if dbias is None else partial[dw.size:dw.size + dbias.size]
            k.conv2d_backward_weight(source, d, dw if first_chunk else partial_w, dbias if first_chunk else partial_b,
                                     c.stride, c.padding, c.groups, s["conv"])
            if not first_chunk:  # the chunks' sums, last chunk first, as ChunkedConvBN's
                np.add(dw, partial_w, out=dw)
                if dbias is not None:
                    np.add(dbias, partial_b, out=dbias)

        g1, g2 = s["g1"], s["g2"]
        for a, b in _chunks(N):  # pass 1: the second batch norm's sums
            _, _, y2 = rebuild(a, b)
            k.batchnorm_chunk_gradient_sums(y2, da[a:b], bn2.params["weight"], bn2.params["bias"], g2, a == 0,
                                            second.activation)
        bn2.grads["bias"][...] = g2[:, 0]
        bn2.grads["weight"][...] = g2[:, 1]
        for a, b in _chunks(N):  # pass 2: the second chain's dx and backward-data, the first batch norm's sums
            y1, a1, y2 = rebuild(a, b)
            k.batchnorm_chunk_dx(y2, da[a:b], bn2.params["weight"], bn2.params["bias"], inv2, g2, count2, y2,
                                 second.activation)
            conv_data(second, y2, a1)  # a1 is read by nothing more in this pass: its gradient goes over it
            k.batchnorm_chunk_gradient_sums(y1, a1, bn1.params["weight"], bn1.params["bias"], g1, a == 0,
                                            first.activation)
        bn1.grads["bias"][...] = g1[:, 0]
        bn1.grads["weight"][...] = g1[:, 1]
        for i, (a, b) in enumerate(reversed(list(_chunks(N)))):  # pass 3, last chunk first: dx, the weights
            y1, a1, y2 = rebuild(a, b)
            k.batchnorm_chunk_dx(y2, da[a:b], bn2.params["weight"], bn2.params["bias"], inv2, g2, count2, y2,
                                 second.activation)
            conv_weight(second, a1, y2, i == 0, s["partial2"])  # a1's last read: its gradient goes over it next
            conv_data(second, y2, a1)
            k.batchnorm_chunk_dx(y1, a1, bn1.params["weight"], bn1.params["bias"], inv1, g1, count1, y1,
                                 first.activation)
            if dxa is not None:
                target = s["dx"][:b - a] if adding else dxa[a:b]
                conv_data(first, y1, target)
                if adding:
                    k.add_forward(dxa[a:b], target, dxa[a:b])
            conv_weight(first, xa[a:b], y1, i == 0, s["partial1"])
        return [dx]

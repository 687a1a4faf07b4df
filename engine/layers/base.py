"""The Layer base class: what every layer declares and the two calls the graph makes.

A layer is a small object that knows four things:

- its **parameters** (names, shapes, PyTorch's default initialization) and **buffers** (running
  statistics): the Network gathers them into ContiguousBlocks and hands each layer *views*
  (``self.params``, ``self.grads``, ``self.buffers``), so an optimizer updates every weight in one pass;
- the **shape** of its output for given input shapes, and the error it raises for a wrong input shape;
- what it **keeps for backward**: its input (``keeps_input``), its output (``keeps_output``), and
  extra FF_CACHE tensors (``saved_specs``), and where its backward puts input gradients
  (``input_gradients``), so the step program (``engine.program``) knows how long every tensor lives;
- the **scratch** its kernels need (``forward_scratch`` / ``backward_scratch``).

Those declarations are all the rest of the engine learns about a layer: a new layer type needs its
kernel calls and its declarations, and nothing in the network, the graph, the arena or offload
(``LeakyReLU`` was added that way).

Layers allocate only through the WorkspaceManager (``self.mgr.create(ArrayType.X, shape)``) and run
only kernels of the backend's table (``self.backend.kernels.<op>``): a layer never asks which backend
it runs on. The network calls ``forward(inputs, training)`` inside ``mgr.layer(node.index)`` and
``backward(dout, need_input_grads, reuse_dout)`` in reverse order, as the step program says; a layer
remembers what it needs between the two in ``self.saved`` and forgets it in ``clear_saved()``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.backend import ComputeBackend
from engine.memory import ArrayType, Shape, Tensor, WorkspaceManager


@dataclass(frozen=True)
class ParameterSpec:
    """A learnable tensor: ``name`` is the suffix after the layer's name (``weight``, ``bias``)."""

    name: str
    shape: Shape


@dataclass(frozen=True)
class BufferSpec:
    """A tensor the forward pass updates but no optimizer touches (BatchNorm's running statistics)."""

    name: str
    shape: Shape
    initial_value: float


@dataclass(frozen=True)
class SavedSpec:
    """A tensor kept from forward to backward in FF_CACHE (besides the layer's input or output)."""

    name: str
    shape: Shape
    dtype: Any = np.float32


class InputGradients(enum.Enum):
    """Where a layer's backward puts its input gradients: the step program (engine.program) reads this
    declaration, so the program, the planned arena and the layer's ``backward`` agree on which gradient
    tensors exist."""

    NEW = "new"  # a new ACTIVATION_GRAD per input that needs one
    ALWAYS_NEW = "always new"  # one new gradient even when no input needs it (the kernel always writes dx)
    PASS_THROUGH = "pass through"  # hands ``dout`` itself to every input (Add)
    OVER_DOUT = "over dout"  # writes over ``dout`` when nothing else reads it, else a new one (ReLU)


class Layer:
    """Base class. Subclasses set the class attributes and implement the shape and compute methods."""

    num_inputs: int = 1
    keeps_input: bool = False  # backward reads the forward input (so it lives until this backward)
    keeps_output: bool = False  # backward reads the forward output (ReLU's mask)
    input_gradients: InputGradients = InputGradients.NEW
    inference_passes_input: bool = False  # inference forward returns its input itself (Dropout): no new output
    recomputable: bool = False  # recompute_output rebuilds the output bit for bit from the input (offload plan)
    accumulates_input_gradients: bool = False  # backward(..., accumulate=) adds into a pending gradient (program)

    def __init__(self) -> None:
        self.name = "<unnamed>"  # set by the graph to the node's name (torchvision's module path)
        self.backend: ComputeBackend = None  # type: ignore[assignment]  # set by bind()
        self.mgr: WorkspaceManager = None  # type: ignore[assignment]  # set by bind()
        self.params: dict[str, Any] = {}  # backend arrays: views into the network's blocks
        self.grads: dict[str, Any] = {}
        self.buffers: dict[str, Any] = {}
        self.saved: dict[str, Any] = {}  # tensors and host values kept from forward to backward

    # ---- declarations --------------------------------------------------------------------------

    def parameter_specs(self) -> list[ParameterSpec]:
        return []

    def buffer_specs(self) -> list[BufferSpec]:
        return []

    def init_parameters(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
        """Host float32 arrays for every parameter, drawn from ``rng`` in declaration order."""
        return {}

    def output_shape(self, input_shapes: list[Shape]) -> Shape:
        """The output shape for these input shapes; raises ValueError naming the layer if they are wrong."""
        raise NotImplementedError

    def saved_specs(self, input_shapes: list[Shape]) -> list[SavedSpec]:
        """The FF_CACHE tensors a training forward creates, in the order it creates them."""
        return []

    def forward_scratch(self, input_shapes: list[Shape]) -> int:
        """float32 elements of FF_WORKING_MEM the forward kernels need."""
        return 0

    def inference_working_specs(self, input_shapes: list[Shape]) -> list[SavedSpec]:
        """The FF_WORKING_MEM tensors an inference forward makes, in the order it makes them (the inference
        arena plans them): the forward scratch, if the layer's forward takes one."""
        elements = self.forward_scratch(input_shapes)
        return [SavedSpec("scratch", (int(elements),))] if elements > 0 else []

    def backward_scratch(self, input_shapes: list[Shape], need: tuple[bool, ...] | None = None) -> int:
        """float32 elements of BP_WORKING_MEM the backward kernels need when the gradients of the inputs
        ``need`` marks are asked for (None: all of them)."""
        return 0

    # ---- wiring ----------------------------------------------------------------------------------

    def tensor_key(self, node_name: str, name: str) -> str:
        """The full name (state dicts, the parameter blocks) of this layer's tensor ``name`` in node ``node_name``.

        A layer that stands for several (``engine.layers.chunked.ChunkedConvBN``) declares full names and
        answers them as they are, so checkpoints keep torchvision's names whichever layers run them."""
        return f"{node_name}.{name}"

    def bind(self, backend: ComputeBackend, mgr: WorkspaceManager, params: dict[str, Any], grads: dict[str, Any],
             buffers: dict[str, Any]) -> None:
        """Attach the backend, the workspace manager and this layer's views into the network's blocks."""
        self.backend = backend
        self.mgr = mgr
        self.params = params
        self.grads = grads
        self.buffers = buffers

    def use_manager(self, mgr: WorkspaceManager) -> None:
        """Allocate through ``mgr`` from now on (the network switches between training and inference)."""
        self.mgr = mgr

    # ---- compute ---------------------------------------------------------------------------------

    def forward(self, inputs: list[Tensor], training: bool) -> Tensor:
        raise NotImplementedError

    def backward(self, dout: Tensor, need_input_grads: list[bool], reuse_dout: bool = False) -> list[Tensor | None]:
        """Gradients with respect to each input (None where not needed); parameter gradients go to
        ``self.grads`` (the kernels overwrite them). ``reuse_dout`` is True when nothing else will read
        ``dout``: a layer whose kernel allows it may then write its input gradient over it (ReLU does),
        which saves one ACTIVATION_GRAD tensor. A layer that ``accumulates_input_gradients`` also takes
        ``accumulate``: per input, None or an existing gradient tensor to add that input's gradient into
        (returned as the input's gradient), where the step program sums a fan-out's contributions."""
        raise NotImplementedError

    def clear_saved(self) -> None:
        self.saved = {}

    def recompute_output(self, inputs: list[Tensor], out: Tensor, scratch: Any = None) -> None:
        """Rebuild the forward output of ``inputs`` into ``out`` with the forward's own kernel (same bits).

        Only for ``recomputable`` layers: the offload plan rebuilds such an output from kept inputs
        instead of swapping it (engine.offload.plan). ``out`` may be an input for elementwise layers.
        ``scratch``: float32 working memory the plan set aside (``Recompute.scratch_bytes``), or None.
        """
        raise NotImplementedError(f"{self.describe()} cannot recompute its output")

    # ---- helpers for subclasses -----------------------------------------------------------------

    def describe(self) -> str:
        return f"{type(self).__name__} {self.name!r}"

    def shape_error(self, expected: str, got: Shape | list[Shape]) -> ValueError:
        return ValueError(f"{self.describe()} expects input of shape {expected}, got {tuple_str(got)}")

    def check_num_inputs(self, input_shapes: list[Shape]) -> None:
        if len(input_shapes) != self.num_inputs:
            raise ValueError(f"{self.describe()} takes {self.num_inputs} input(s), got {len(input_shapes)}")

    def output(self, shape: Shape) -> Tensor:
        """A new ACTIVATIONS tensor for this layer's output."""
        return self.mgr.create(ArrayType.ACTIVATIONS, tuple(shape), dtype=np.float32)

    def input_grad(self, shape: Shape) -> Tensor:
        """A new ACTIVATION_GRAD tensor for the gradient with respect to an input."""
        return self.mgr.create(ArrayType.ACTIVATION_GRAD, tuple(shape), dtype=np.float32)

    def keep(self, name: str, shape: Shape, dtype: Any = np.float32) -> Tensor:
        """A new FF_CACHE tensor kept for backward."""
        return self.mgr.create(ArrayType.FF_CACHE, tuple(shape), dtype=dtype)

    def scratch(self, array_type: ArrayType, elements: int) -> Tensor | None:
        """A 1-D float32 scratch buffer of working memory; None when the kernels need none (they take None
        for a zero-size scratch), so a step makes exactly the working memory its program step declares
        (``forward_scratch`` / ``backward_scratch``: the training arena plans one buffer per step that needs it)."""
        if int(elements) <= 0:
            return None
        return self.mgr.create(array_type, (int(elements),), dtype=np.float32)


def checked_array(x: Any, op: str, argument: str = "argument 0") -> Any:
    """The raw array of a workspace Tensor, checked as the kernel table checks it (a stale or released tensor
    raises naming ``op``); a plain array as it is. For layers that hand kernels views of their tensors."""
    return x.kernel_array(op, argument) if hasattr(x, "kernel_array") else x


def tuple_str(shape: Shape | list[Shape]) -> str:
    if isinstance(shape, list):
        return " and ".join(tuple_str(s) for s in shape)
    return "(" + ", ".join(str(d) for d in shape) + ")"


def uniform(rng: np.random.Generator, bound: float, shape: Shape) -> np.ndarray:
    return rng.uniform(-bound, bound, size=shape).astype(np.float32)

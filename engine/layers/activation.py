"""ReLU, ReLU6 and LeakyReLU. Backward takes its mask from the forward *output*, so the layer keeps its
output, and writes the input gradient over the output gradient when nothing else reads that.

LeakyReLU is the proof that a layer type needs only its kernel calls and its declarations: it was
added with its kernels (reference, CPU, CUDA) and the class below, and nothing in the network, the
graph, the step program, the arena or offload changed (tests/engine/test_program.py trains it with
and without offload).

``recompute_output`` (ReLU, ReLU6) reruns the forward kernel: when the input is kept anyway (a batch
norm's output, In-Place ABN) the offload plan rebuilds the output from it instead of writing it to
disk and reading it back (one pass over memory instead of a write and a read, and the same bits).
When the offload scheduler swaps that input and checks it itself (``engine.offload.scheduler``'s
``_FusedCheck``), it sets ``forward_with_input_check``: the training forward then runs the same
kernel fused with a checksum of the input, read in the same pass (no second pass over the bytes).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine.layers.base import InputGradients, Layer, Shape
from engine.memory import Tensor


class ReLU(Layer):
    keeps_output = True
    recomputable = True
    input_gradients = InputGradients.OVER_DOUT
    forward_op = "relu_forward"
    backward_op = "relu_backward"
    # (x, out) -> None: the forward kernel fused with a checksum of x, set by the offload scheduler
    forward_with_input_check: Callable[[Tensor, Tensor], None] | None = None

    def output_shape(self, input_shapes: list[Shape]) -> Shape:
        self.check_num_inputs(input_shapes)
        return tuple(input_shapes[0])

    def forward(self, inputs: list[Tensor], training: bool) -> Tensor:
        x = inputs[0]
        out = self.output(x.shape)
        if training and self.forward_with_input_check is not None:
            self.forward_with_input_check(x, out)
        else:
            getattr(self.backend.kernels, self.forward_op)(x, out)
        if training:
            self.saved = {"out": out}
        return out

    def recompute_output(self, inputs: list[Tensor], out: Tensor, scratch: Any = None) -> None:
        getattr(self.backend.kernels, self.forward_op)(inputs[0], out)

    def backward(self, dout: Tensor, need_input_grads: list[bool], reuse_dout: bool = False) -> list[Tensor | None]:
        if not need_input_grads[0]:
            return [None]
        out = self.saved["out"]
        dx = dout if reuse_dout else self.input_grad(out.shape)  # the kernel allows dx to be dout
        getattr(self.backend.kernels, self.backward_op)(out, dout, dx)
        return [dx]


class ReLU6(ReLU):
    """min(max(x, 0), 6), MobileNetV2's activation; the gradient passes where 0 < out < 6."""

    forward_op = "relu6_forward"
    backward_op = "relu6_backward"


class LeakyReLU(Layer):
    """x where x > 0, else ``negative_slope`` · x (torch.nn.LeakyReLU). The slope must be >= 0: then the
    output is positive exactly where the input is, and backward needs only the output, like ReLU."""

    keeps_output = True
    input_gradients = InputGradients.OVER_DOUT

    def __init__(self, negative_slope: float = 0.01) -> None:
        super().__init__()
        if not negative_slope >= 0:
            raise ValueError(f"LeakyReLU: negative_slope must be >= 0 (backward masks by the output), got "
                             f"{negative_slope}")
        self.negative_slope = float(negative_slope)

    def output_shape(self, input_shapes: list[Shape]) -> Shape:
        self.check_num_inputs(input_shapes)
        return tuple(input_shapes[0])

    def forward(self, inputs: list[Tensor], training: bool) -> Tensor:
        x = inputs[0]
        out = self.output(x.shape)
        self.backend.kernels.leaky_relu_forward(x, out, self.negative_slope)
        if training:
            self.saved = {"out": out}
        return out

    def backward(self, dout: Tensor, need_input_grads: list[bool], reuse_dout: bool = False) -> list[Tensor | None]:
        if not need_input_grads[0]:
            return [None]
        out = self.saved["out"]
        dx = dout if reuse_dout else self.input_grad(out.shape)  # the kernel allows dx to be dout
        self.backend.kernels.leaky_relu_backward(out, dout, dx, self.negative_slope)
        return [dx]

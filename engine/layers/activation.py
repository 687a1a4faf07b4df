"""ReLU and ReLU6. Backward takes its mask from the forward *output*, so the layer keeps its output,
and writes the input gradient over the output gradient when nothing else reads that.

``recompute_output`` reruns the forward kernel: when the input is kept anyway (a batch norm's output,
In-Place ABN) the offload plan rebuilds the output from it instead of writing it to disk and reading
it back (one pass over memory instead of a write and a read, and the same bits).
"""

from __future__ import annotations

from typing import Any

from engine.layers.base import InputGradients, Layer, Shape


class ReLU(Layer):
    keeps_output = True
    recomputable = True
    input_gradients = InputGradients.OVER_DOUT
    forward_op = "relu_forward"
    backward_op = "relu_backward"

    def output_shape(self, input_shapes: list[Shape]) -> Shape:
        self.check_num_inputs(input_shapes)
        return tuple(input_shapes[0])

    def forward(self, inputs: list[Any], training: bool) -> Any:
        x = inputs[0]
        out = self.output(x.shape)
        getattr(self.backend.kernels, self.forward_op)(x, out)
        if training:
            self.saved = {"out": out}
        return out

    def recompute_output(self, inputs: list[Any], out: Any) -> None:
        getattr(self.backend.kernels, self.forward_op)(inputs[0], out)

    def backward(self, dout: Any, need_input_grads: list[bool], reuse_dout: bool = False) -> list[Any]:
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

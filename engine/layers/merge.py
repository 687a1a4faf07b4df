"""Add: the residual connection. Its backward hands the same gradient to both inputs (no copy);
the graph sums gradients where a tensor feeds several layers. ``recomputable``: the offload plan may
rebuild a ReLU after it from the two kept inputs (Add, then ReLU in place), instead of swapping it."""

from __future__ import annotations

from typing import Any

from engine.layers.base import InputGradients, Layer, Shape
from engine.memory import Tensor


class Add(Layer):
    num_inputs = 2
    input_gradients = InputGradients.PASS_THROUGH
    recomputable = True

    def output_shape(self, input_shapes: list[Shape]) -> Shape:
        self.check_num_inputs(input_shapes)
        a, b = (tuple(s) for s in input_shapes)
        if a != b:
            raise ValueError(f"{self.describe()} expects two inputs of the same shape, got {a} and {b}")
        return a

    def forward(self, inputs: list[Tensor], training: bool) -> Tensor:
        a, b = inputs
        out = self.output(self.output_shape([tuple(a.shape), tuple(b.shape)]))
        self.backend.kernels.add_forward(a, b, out)
        return out

    def recompute_output(self, inputs: list[Tensor], out: Tensor, scratch: Any = None) -> None:
        self.backend.kernels.add_forward(inputs[0], inputs[1], out)

    def backward(self, dout: Tensor, need_input_grads: list[bool], reuse_dout: bool = False) -> list[Tensor | None]:
        return [dout if need else None for need in need_input_grads]

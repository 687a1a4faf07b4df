"""Dense (torch.nn.Linear) and Flatten.

Dense keeps PyTorch's layout, ``weight`` O × I and ``bias`` O, initialized like ``nn.Linear``
(uniform in ±1/sqrt(in_features)); backward needs the input, which the layer keeps (a reference).
Flatten turns N×C×H×W into N×(C·H·W) as a new ACTIVATIONS tensor: a copy, so every layer's output
is a tensor of its own (it sits where tensors are small, before the classifier).
"""

from __future__ import annotations

import math

import numpy as np

from engine.layers.base import Layer, ParameterSpec, Shape, checked_array, uniform
from engine.memory import Tensor


class Dense(Layer):
    keeps_input = True

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.has_bias = bias

    def parameter_specs(self) -> list[ParameterSpec]:
        specs = [ParameterSpec("weight", (self.out_features, self.in_features))]
        if self.has_bias:
            specs.append(ParameterSpec("bias", (self.out_features,)))
        return specs

    def init_parameters(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
        bound = 1.0 / math.sqrt(self.in_features)
        values = {"weight": uniform(rng, bound, (self.out_features, self.in_features))}
        if self.has_bias:
            values["bias"] = uniform(rng, bound, (self.out_features,))
        return values

    def output_shape(self, input_shapes: list[Shape]) -> Shape:
        self.check_num_inputs(input_shapes)
        shape = input_shapes[0]
        if len(shape) != 2 or shape[1] != self.in_features:
            raise self.shape_error(f"(N, {self.in_features})", shape)
        return (shape[0], self.out_features)

    def forward(self, inputs: list[Tensor], training: bool) -> Tensor:
        x = inputs[0]
        out = self.output(self.output_shape([tuple(x.shape)]))
        self.backend.kernels.dense_forward(x, self.params["weight"], self.params.get("bias"), out)
        if training:
            self.saved = {"x": x}
        return out

    def backward(self, dout: Tensor, need_input_grads: list[bool], reuse_dout: bool = False) -> list[Tensor | None]:
        x = self.saved["x"]
        dx = self.input_grad(x.shape) if need_input_grads[0] else None
        self.backend.kernels.dense_backward(
            x, self.params["weight"], dout, dx, self.grads["weight"], self.grads.get("bias")
        )
        return [dx]


class Flatten(Layer):
    def output_shape(self, input_shapes: list[Shape]) -> Shape:
        self.check_num_inputs(input_shapes)
        shape = input_shapes[0]
        if len(shape) < 2:
            raise self.shape_error("(N, ...)", shape)
        return (shape[0], int(np.prod(shape[1:], dtype=np.int64)))

    def forward(self, inputs: list[Tensor], training: bool) -> Tensor:
        x = inputs[0]
        shape = self.output_shape([tuple(x.shape)])
        out = self.output(shape)
        out.array[...] = checked_array(x, "flatten_forward").reshape(shape)
        if training:
            self.saved = {"x_shape": tuple(x.shape)}
        return out

    def backward(self, dout: Tensor, need_input_grads: list[bool], reuse_dout: bool = False) -> list[Tensor | None]:
        if not need_input_grads[0]:
            return [None]
        x_shape = self.saved["x_shape"]
        dx = self.input_grad(x_shape)
        dx.array[...] = checked_array(dout, "flatten_backward").reshape(x_shape)
        return [dx]


"""Dropout: zero each element with probability ``p`` in training, scale the rest by 1/(1-p).

The mask comes from the network's seeded NumPy Generator (``net.rng``), drawn on the host in a
fixed order, so a run with the same seed drops the same elements on every backend. The mask is kept
for backward as a uint8 FF_CACHE tensor. Inference passes the input through unchanged.
"""

from __future__ import annotations

import numpy as np

from engine.layers.base import Layer, SavedSpec, Shape
from engine.memory import Tensor


class Dropout(Layer):
    inference_passes_input = True
    def __init__(self, p: float = 0.5) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"Dropout: p must be in [0, 1), got {p}")
        self.p = p
        self.rng: np.random.Generator | None = None  # set by the network

    def output_shape(self, input_shapes: list[Shape]) -> Shape:
        self.check_num_inputs(input_shapes)
        return tuple(input_shapes[0])

    def saved_specs(self, input_shapes: list[Shape]) -> list[SavedSpec]:
        return [SavedSpec("mask", tuple(input_shapes[0]), np.uint8)]

    def forward(self, inputs: list[Tensor], training: bool) -> Tensor:
        x = inputs[0]
        if not training:
            return x
        if self.rng is None:
            raise RuntimeError(f"{self.describe()} has no random generator: build it inside a Network")
        shape = tuple(x.shape)
        out = self.output(shape)
        mask = self.keep("mask", shape, np.uint8)
        host_mask = (self.rng.random(shape, dtype=np.float32) >= self.p).astype(np.uint8)
        mask.array[...] = self.backend.to_device(host_mask)
        scale = 1.0 / (1.0 - self.p)
        self.backend.kernels.dropout_forward(x, mask, scale, out)
        self.saved = {"mask": mask, "scale": scale}
        return out

    def backward(self, dout: Tensor, need_input_grads: list[bool], reuse_dout: bool = False) -> list[Tensor | None]:
        if not need_input_grads[0]:
            return [None]
        dx = self.input_grad(dout.shape)
        self.backend.kernels.dropout_backward(dout, self.saved["mask"], self.saved["scale"], dx)
        return [dx]

"""Dropout: zero each element with probability ``p`` in training, scale the rest by 1/(1-p).

The mask comes from the network's seeded NumPy Generator (``net.rng``), drawn on the host in a
fixed order, so a run with the same seed drops the same elements on every backend. The mask is kept
for backward as a uint8 FF_CACHE tensor. Inference passes the input through unchanged.

A step captured as a CUDA graph cannot draw on the host inside the step (a replay runs no Python), so
``engine/cuda_graph.py``'s ``StepRunner`` sets ``mask_fill``: it draws the step's mask with
``draw_mask`` before the step (the same generator, the same calls, in the same forward order: the same
bits) into a device buffer of its own, and the forward then only launches the copy into the mask's slot.
Without a runner (the CPU backend, plain eager CUDA) the forward draws as it always has.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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
        self.mask_fill: Callable[[Any], None] | None = None
        """Set by a StepRunner: writes this step's mask (drawn before the step) into the slot passed."""

    def output_shape(self, input_shapes: list[Shape]) -> Shape:
        self.check_num_inputs(input_shapes)
        return tuple(input_shapes[0])

    def saved_specs(self, input_shapes: list[Shape]) -> list[SavedSpec]:
        return [SavedSpec("mask", tuple(input_shapes[0]), np.uint8)]

    def forward(self, inputs: list[Tensor], training: bool) -> Tensor:
        x = inputs[0]
        if not training:
            return x
        shape = tuple(x.shape)
        out = self.output(shape)
        mask = self.keep("mask", shape, np.uint8)
        if self.mask_fill is not None:
            self.mask_fill(mask.array)
        else:
            mask.array[...] = self.backend.to_device(self.draw_mask(shape))
        scale = 1.0 / (1.0 - self.p)
        self.backend.kernels.dropout_forward(x, mask, scale, out)
        self.saved = {"mask": mask, "scale": scale}
        return out

    def draw_mask(self, shape: tuple[int, ...]) -> np.ndarray:
        """One training forward's keep-mask (1 keeps), drawn from the network's generator on the host."""
        if self.rng is None:
            raise RuntimeError(f"{self.describe()} has no random generator: build it inside a Network")
        return (self.rng.random(shape, dtype=np.float32) >= self.p).astype(np.uint8)

    def backward(self, dout: Tensor, need_input_grads: list[bool], reuse_dout: bool = False) -> list[Tensor | None]:
        if not need_input_grads[0]:
            return [None]
        dx = self.input_grad(dout.shape)
        self.backend.kernels.dropout_backward(dout, self.saved["mask"], self.saved["scale"], dx)
        return [dx]

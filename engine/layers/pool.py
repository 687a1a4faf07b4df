"""Pooling: MaxPool2d (keeps the argmax of every window for backward), AvgPool2d and GlobalAvgPool.

Windows are square with PyTorch's output size floor((H + 2 pad - kernel) / stride) + 1; average
pooling counts padding as zeros (PyTorch's default). GlobalAvgPool turns N×C×H×W into N×C, what
torchvision's ``AdaptiveAvgPool2d(1)`` followed by ``flatten`` gives.
"""

from __future__ import annotations

import numpy as np

from engine.layers.base import Layer, SavedSpec, Shape
from engine.memory import ArrayType, Tensor


class _WindowPool(Layer):
    def __init__(self, kernel_size: int, stride: int | None = None, padding: int = 0) -> None:
        super().__init__()
        self.kernel_size = kernel_size
        self.stride = kernel_size if stride is None else stride
        self.padding = padding

    def output_shape(self, input_shapes: list[Shape]) -> Shape:
        self.check_num_inputs(input_shapes)
        shape = input_shapes[0]
        k, s, p = self.kernel_size, self.stride, self.padding
        expected = f"(N, C, H, W) with H, W >= {k - 2 * p}"
        if len(shape) != 4:
            raise self.shape_error(expected, shape)
        n, c, h, w = shape
        oh, ow = (h + 2 * p - k) // s + 1, (w + 2 * p - k) // s + 1
        if oh < 1 or ow < 1:
            raise self.shape_error(expected, shape)
        return (n, c, oh, ow)


class MaxPool2d(_WindowPool):
    """Keeps the argmax as the narrowest integer that holds a window: uint8 (the winner's place in its
    window) up to 16x16 windows, so ResNet's 3x3 max-pool keeps 1 byte per output instead of 4 (issue 11)."""

    @property
    def argmax_dtype(self) -> type:
        return np.uint8 if self.kernel_size * self.kernel_size <= 256 else np.int32

    def saved_specs(self, input_shapes: list[Shape]) -> list[SavedSpec]:
        return [SavedSpec("argmax", self.output_shape(input_shapes), self.argmax_dtype)]

    def inference_working_specs(self, input_shapes: list[Shape]) -> list[SavedSpec]:
        return self.saved_specs(input_shapes)  # the kernel writes the argmax; nothing reads it after

    def forward(self, inputs: list[Tensor], training: bool) -> Tensor:
        x = inputs[0]
        shape = self.output_shape([tuple(x.shape)])
        out = self.output(shape)
        # Inference needs the argmax only while the kernel runs: working memory, not a cache.
        if training:
            argmax = self.keep("argmax", shape, self.argmax_dtype)
        else:
            argmax = self.mgr.create(ArrayType.FF_WORKING_MEM, shape, dtype=self.argmax_dtype)
        self.backend.kernels.maxpool2d_forward(x, out, argmax, self.kernel_size, self.stride, self.padding)
        if training:
            self.saved = {"x_shape": tuple(x.shape), "argmax": argmax}
        return out

    def backward(self, dout: Tensor, need_input_grads: list[bool], reuse_dout: bool = False) -> list[Tensor | None]:
        if not need_input_grads[0]:
            return [None]
        dx = self.input_grad(self.saved["x_shape"])
        self.backend.kernels.maxpool2d_backward(dout, self.saved["argmax"], dx, self.kernel_size, self.stride,
                                                self.padding)
        return [dx]


class AvgPool2d(_WindowPool):
    def forward(self, inputs: list[Tensor], training: bool) -> Tensor:
        x = inputs[0]
        out = self.output(self.output_shape([tuple(x.shape)]))
        self.backend.kernels.avgpool2d_forward(x, out, self.kernel_size, self.stride, self.padding)
        if training:
            self.saved = {"x_shape": tuple(x.shape)}
        return out

    def backward(self, dout: Tensor, need_input_grads: list[bool], reuse_dout: bool = False) -> list[Tensor | None]:
        if not need_input_grads[0]:
            return [None]
        dx = self.input_grad(self.saved["x_shape"])
        self.backend.kernels.avgpool2d_backward(dout, dx, self.kernel_size, self.stride, self.padding)
        return [dx]


class GlobalAvgPool(Layer):
    def output_shape(self, input_shapes: list[Shape]) -> Shape:
        self.check_num_inputs(input_shapes)
        shape = input_shapes[0]
        if len(shape) != 4:
            raise self.shape_error("(N, C, H, W)", shape)
        return (shape[0], shape[1])

    def forward(self, inputs: list[Tensor], training: bool) -> Tensor:
        x = inputs[0]
        out = self.output(self.output_shape([tuple(x.shape)]))
        self.backend.kernels.global_avgpool_forward(x, out)
        if training:
            self.saved = {"x_shape": tuple(x.shape)}
        return out

    def backward(self, dout: Tensor, need_input_grads: list[bool], reuse_dout: bool = False) -> list[Tensor | None]:
        if not need_input_grads[0]:
            return [None]
        dx = self.input_grad(self.saved["x_shape"])
        self.backend.kernels.global_avgpool_backward(dout, dx)
        return [dx]

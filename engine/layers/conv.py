"""Conv2d: a 2-D convolution (square kernel, zero padding, groups: depthwise when groups == channels).

Parameters follow PyTorch: ``weight`` is K × C/groups × R × R, ``bias`` (optional) is K, both drawn
like ``torch.nn.Conv2d``'s defaults (uniform in ±1/sqrt(fan_in)). Backward needs the input, so the
layer keeps it (a reference to the producer's ACTIVATIONS, not a copy). The kernels' scratch comes
from FF_WORKING_MEM / BP_WORKING_MEM, sized by the table's ``*_workspace_size`` functions.

Backward runs its two kernels one after the other on **one** scratch buffer, the larger of the two
sizes: the data kernel's scratch is dead once it returns, and the kernels take any scratch at least
as large as they need. Before, each call had its own and the layer's BP_WORKING_MEM was their sum:
ResNet-18's layer4 3×3 convolutions at batch 32 need 8.8 MiB (data) and 19.0 MiB (weight), so the
step's working memory went from 27.8 MiB to 19.0 MiB (``engine memory --model resnet18``), and the
README's main command's peak RSS with it (issue 13, item 4; figures in docs/benchmarks.md, "Whole process
against PyTorch").
"""

from __future__ import annotations

import math

import numpy as np

from engine.layers.base import Layer, ParameterSpec, Shape, uniform
from engine.memory import ArrayType, Tensor


class Conv2d(Layer):
    keeps_input = True

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        stride: int = 1,
        padding: int = 0,
        groups: int = 1,
        bias: bool = True,
    ) -> None:
        super().__init__()
        if in_channels % groups or out_channels % groups:
            raise ValueError(
                f"Conv2d: in_channels ({in_channels}) and out_channels ({out_channels}) "
                f"must divide by groups ({groups})"
            )
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.kernel_size = kernel_size
        self.stride = stride
        self.padding = padding
        self.groups = groups
        self.has_bias = bias

    @property
    def weight_shape(self) -> Shape:
        k = self.kernel_size
        return (self.out_channels, self.in_channels // self.groups, k, k)

    def parameter_specs(self) -> list[ParameterSpec]:
        specs = [ParameterSpec("weight", self.weight_shape)]
        if self.has_bias:
            specs.append(ParameterSpec("bias", (self.out_channels,)))
        return specs

    def init_parameters(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
        # torch.nn.Conv2d.reset_parameters: kaiming_uniform_(a=sqrt(5)) gives bound 1/sqrt(fan_in).
        fan_in = (self.in_channels // self.groups) * self.kernel_size * self.kernel_size
        bound = 1.0 / math.sqrt(fan_in)
        values = {"weight": uniform(rng, bound, self.weight_shape)}
        if self.has_bias:
            values["bias"] = uniform(rng, bound, (self.out_channels,))
        return values

    def output_shape(self, input_shapes: list[Shape]) -> Shape:
        self.check_num_inputs(input_shapes)
        shape = input_shapes[0]
        expected = f"(N, {self.in_channels}, H, W) with H, W >= {self.kernel_size - 2 * self.padding}"
        if len(shape) != 4 or shape[1] != self.in_channels:
            raise self.shape_error(expected, shape)
        n, _, h, w = shape
        oh = (h + 2 * self.padding - self.kernel_size) // self.stride + 1
        ow = (w + 2 * self.padding - self.kernel_size) // self.stride + 1
        if oh < 1 or ow < 1:
            raise self.shape_error(expected, shape)
        return (n, self.out_channels, oh, ow)

    def _geometry(self, x_shape: Shape) -> tuple:
        return (tuple(x_shape), self.weight_shape, self.stride, self.padding, self.groups)

    def forward_scratch(self, input_shapes: list[Shape]) -> int:
        return int(self.backend.kernels.conv2d_forward_workspace_size(*self._geometry(input_shapes[0])))

    def backward_scratch(self, input_shapes: list[Shape], need: tuple[bool, ...] | None = None) -> int:
        return self._backward_scratch(self._geometry(input_shapes[0]), need is None or need[0])

    def _backward_scratch(self, geometry: tuple, data: bool) -> int:
        """float32 elements of the one scratch both backward kernels use in turn (module docstring)."""
        kernels = self.backend.kernels
        weight = int(kernels.conv2d_backward_weight_workspace_size(*geometry))
        return max(int(kernels.conv2d_backward_data_workspace_size(*geometry)), weight) if data else weight

    def forward(self, inputs: list[Tensor], training: bool) -> Tensor:
        x = inputs[0]
        out = self.output(self.output_shape([tuple(x.shape)]))
        geometry = self._geometry(x.shape)
        scratch = self.scratch(ArrayType.FF_WORKING_MEM, self.backend.kernels.conv2d_forward_workspace_size(*geometry))
        self.backend.kernels.conv2d_forward(
            x, self.params["weight"], self.params.get("bias"), out, self.stride, self.padding, self.groups, scratch
        )
        if training:
            self.saved = {"x": x}
        return out

    def backward(self, dout: Tensor, need_input_grads: list[bool], reuse_dout: bool = False) -> list[Tensor | None]:
        x = self.saved["x"]
        kernels = self.backend.kernels
        geometry = self._geometry(x.shape)
        dx = self.input_grad(x.shape) if need_input_grads[0] else None
        scratch = self.scratch(ArrayType.BP_WORKING_MEM, self._backward_scratch(geometry, need_input_grads[0]))
        if dx is not None:
            kernels.conv2d_backward_data(
                dout, self.params["weight"], dx, self.stride, self.padding, self.groups, scratch
            )
        kernels.conv2d_backward_weight(
            x, dout, self.grads["weight"], self.grads.get("bias"), self.stride, self.padding, self.groups, scratch
        )
        return [dx]

"""BatchNorm2d: per-channel normalization with learned scale and shift, as torch.nn.BatchNorm2d.

Training normalizes with the batch statistics, keeps 1/std (FF_CACHE) and its
*output* for backward, and moves ``running_mean`` / ``running_var`` (buffers, momentum 0.1, unbiased
variance) in place. Inference uses the running statistics. ``num_batches_tracked`` is a host counter,
as PyTorch's, written to and read from state dicts.

Why the output and not the input (In-Place ABN, arXiv 1712.02616): backward rebuilds x̂ = (out − β)/γ
(``batchnorm_backward_from_output``), so the input (a conv's output) dies right after this forward
and the ReLU that usually follows shares the kept tensor: its mask comes from it, and the offload
plan recomputes the ReLU's output from it instead of swapping both (issue 11). Kept for backward in
ResNet-18 at batch 32: one tensor per conv-bn-relu instead of two. It is done with offload off too,
so offload on or off gives the same bits; the kernels use γ with |γ| raised to 1e-5 (γ = 0 could not
be divided by), which with γ initialized to 1 changes nothing.
"""

from __future__ import annotations

import numpy as np

from engine.layers.base import BufferSpec, InputGradients, Layer, ParameterSpec, SavedSpec, Shape
from engine.memory import ArrayType, Tensor


class BatchNorm2d(Layer):
    keeps_output = True
    input_gradients = InputGradients.ALWAYS_NEW

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.1) -> None:
        super().__init__()
        self.num_features = num_features
        self.eps = eps
        self.momentum = momentum
        self.num_batches_tracked = 0

    def parameter_specs(self) -> list[ParameterSpec]:
        return [ParameterSpec("weight", (self.num_features,)), ParameterSpec("bias", (self.num_features,))]

    def buffer_specs(self) -> list[BufferSpec]:
        return [
            BufferSpec("running_mean", (self.num_features,), 0.0),
            BufferSpec("running_var", (self.num_features,), 1.0),
        ]

    def init_parameters(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
        c = self.num_features
        return {"weight": np.ones(c, np.float32), "bias": np.zeros(c, np.float32)}

    def output_shape(self, input_shapes: list[Shape]) -> Shape:
        self.check_num_inputs(input_shapes)
        shape = input_shapes[0]
        if len(shape) != 4 or shape[1] != self.num_features:
            raise self.shape_error(f"(N, {self.num_features}, H, W)", shape)
        return tuple(shape)

    def saved_specs(self, input_shapes: list[Shape]) -> list[SavedSpec]:
        return [SavedSpec("save_invstd", (self.num_features,))]

    def forward_scratch(self, input_shapes: list[Shape]) -> int:
        # the batch mean (the kernel writes it, backward no longer reads it), then on the GPU the partial
        # statistics of a channel split over several blocks (kernels/cuda/batchnorm.py)
        return int(self.backend.kernels.batchnorm_forward_train_workspace_size(tuple(input_shapes[0])))

    def backward_scratch(self, input_shapes: list[Shape], need: tuple[bool, ...] | None = None) -> int:
        return int(self.backend.kernels.batchnorm_backward_from_output_workspace_size(tuple(input_shapes[0])))

    def inference_working_specs(self, input_shapes: list[Shape]) -> list[SavedSpec]:
        return []  # inference normalizes with the running statistics: no batch mean

    def forward(self, inputs: list[Tensor], training: bool) -> Tensor:
        x = inputs[0]
        out = self.output(self.output_shape([tuple(x.shape)]))
        p, b = self.params, self.buffers
        if training:
            save_mean = self.scratch(ArrayType.FF_WORKING_MEM, self.forward_scratch([tuple(x.shape)]))
            save_invstd = self.keep("save_invstd", (self.num_features,))
            self.backend.kernels.batchnorm_forward_train(
                x, p["weight"], p["bias"], b["running_mean"], b["running_var"], out, save_mean, save_invstd,
                self.momentum, self.eps,
            )  # fmt: skip
            self.num_batches_tracked += 1
            self.saved = {"out": out, "save_invstd": save_invstd}
        else:
            self.backend.kernels.batchnorm_forward_infer(
                x, p["weight"], p["bias"], b["running_mean"], b["running_var"], out, self.eps
            )
        return out

    def backward(self, dout: Tensor, need_input_grads: list[bool], reuse_dout: bool = False) -> list[Tensor | None]:
        s = self.saved
        dx = self.input_grad(s["out"].shape)  # the kernel always writes dx
        scratch = self.scratch(ArrayType.BP_WORKING_MEM, self.backward_scratch([tuple(s["out"].shape)]))
        self.backend.kernels.batchnorm_backward_from_output(
            s["out"], dout, self.params["weight"], self.params["bias"], s["save_invstd"], dx,
            self.grads["weight"], self.grads["bias"], scratch,
        )  # fmt: skip
        return [dx if need_input_grads[0] else None]

"""SoftmaxCrossEntropy: the loss head, mean over the batch, fused with softmax.

It is not a node of the graph: the Network applies it to the last node's output (``net.loss``).
Forward keeps the probabilities (ACTIVATIONS of the loss head) for backward, whose gradient
(probs − onehot) / N is the first ACTIVATION_GRAD of the backward pass.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from engine.backend import ComputeBackend
from engine.memory import ArrayType, Tensor, WorkspaceManager


class SoftmaxCrossEntropy:
    name = "loss"

    def __init__(self, backend: ComputeBackend) -> None:
        self.backend = backend
        self.saved: dict[str, Any] = {}
        self.loss_array: Any = None

    def forward(self, mgr: WorkspaceManager, logits: Tensor, labels: Any) -> float:
        shape = tuple(logits.shape)
        if len(shape) != 2:
            raise ValueError(f"SoftmaxCrossEntropy expects logits of shape (N, classes), got {shape}")
        labels_shape = tuple(labels.shape)
        if labels_shape != (shape[0],):
            raise ValueError(f"SoftmaxCrossEntropy expects labels of shape ({shape[0]},), got {labels_shape}")
        if labels.dtype != np.int64:
            raise ValueError(
                f"SoftmaxCrossEntropy expects int64 labels, got {labels.dtype}: use labels.astype(np.int64)"
            )
        # A step being captured as a CUDA graph (engine/cuda_graph.py) may not read the device: its
        # driver checks each batch's labels on the host and reads ``loss_array`` after the replay.
        capturing = bool(getattr(self.backend, "capturing", False))
        if not capturing:
            host = self.backend.to_host(labels)
            if host.size and (host.min() < 0 or host.max() >= shape[1]):
                raise ValueError(
                    f"SoftmaxCrossEntropy: labels must lie in [0, {shape[1]}) for {shape[1]} classes, "
                    f"got values from {host.min()} to {host.max()}"
                )
        probs = mgr.create(ArrayType.ACTIVATIONS, shape, dtype=np.float32)
        loss = mgr.create(ArrayType.ACTIVATIONS, (1,), dtype=np.float32)
        self.backend.kernels.softmax_xent_forward(logits, labels, probs, loss)
        self.saved = {"probs": probs, "labels": labels}
        self.loss_array = loss.array  # the device array this step's loss lands in
        return float("nan") if capturing else float(self.backend.to_host(loss.array)[0])

    def backward(self, mgr: WorkspaceManager) -> Tensor:
        probs = self.saved["probs"]
        dlogits = mgr.create(ArrayType.ACTIVATION_GRAD, tuple(probs.shape), dtype=np.float32)
        self.backend.kernels.softmax_xent_backward(probs, self.saved["labels"], dlogits)
        self.saved = {}
        return dlogits

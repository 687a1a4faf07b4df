"""The CUDA kernel table: numba.cuda kernels and their host-side launchers (see kernels/README.md).

Importing this package compiles nothing: numba-cuda compiles each kernel on its first launch (or,
under NUMBA_ENABLE_CUDASIM=1, runs it in the simulator). Launchers accept NumPy arrays (simulator)
or CuPy arrays (GPU). Every launch is counted in ``LAUNCHES`` (by kernel name); ``count_only()``
counts without running, which is how `engine kernels --backend cudasim --launches` reports a training
step's launches at real batch sizes on a machine without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kernels.cuda import batchnorm, conv, dense, elementwise, loss, optim, pool
from kernels.cuda._launch import LAUNCHES, count_only, record_launches, reset_launches

__all__ = ["LAUNCHES", "TABLE", "count_only", "record_launches", "reset_launches"]

TABLE: dict[str, Callable[..., Any]] = {
    "conv2d_forward": conv.conv2d_forward,
    "conv2d_backward_data": conv.conv2d_backward_data,
    "conv2d_backward_weight": conv.conv2d_backward_weight,
    "conv2d_forward_workspace_size": conv.conv2d_forward_workspace_size,
    "conv2d_backward_data_workspace_size": conv.conv2d_backward_data_workspace_size,
    "conv2d_backward_weight_workspace_size": conv.conv2d_backward_weight_workspace_size,
    "dense_forward": dense.dense_forward,
    "dense_backward": dense.dense_backward,
    "relu_forward": elementwise.relu_forward,
    "relu_backward": elementwise.relu_backward,
    "relu6_forward": elementwise.relu6_forward,
    "relu6_backward": elementwise.relu6_backward,
    "leaky_relu_forward": elementwise.leaky_relu_forward,
    "leaky_relu_backward": elementwise.leaky_relu_backward,
    "add_forward": elementwise.add_forward,
    "dropout_forward": elementwise.dropout_forward,
    "dropout_backward": elementwise.dropout_backward,
    "maxpool2d_forward": pool.maxpool2d_forward,
    "maxpool2d_backward": pool.maxpool2d_backward,
    "avgpool2d_forward": pool.avgpool2d_forward,
    "avgpool2d_backward": pool.avgpool2d_backward,
    "global_avgpool_forward": pool.global_avgpool_forward,
    "global_avgpool_backward": pool.global_avgpool_backward,
    "batchnorm_forward_train": batchnorm.batchnorm_forward_train,
    "batchnorm_forward_infer": batchnorm.batchnorm_forward_infer,
    "batchnorm_backward_from_output": batchnorm.batchnorm_backward_from_output,
    "batchnorm_forward_train_workspace_size": batchnorm.batchnorm_forward_train_workspace_size,
    "batchnorm_backward_from_output_workspace_size": batchnorm.batchnorm_backward_from_output_workspace_size,
    "softmax_xent_forward": loss.softmax_xent_forward,
    "softmax_xent_backward": loss.softmax_xent_backward,
    "sgd_update": optim.sgd_update,
    "adam_update": optim.adam_update,
}

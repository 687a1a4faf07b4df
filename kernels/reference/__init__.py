"""The NumPy reference kernel table: the ground truth every backend is tested against.

``TABLE`` has the names and signatures of kernels/README.md. Each function writes into the arrays
it is given, like the fast kernels, so the same test can call either.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

CONV_NAMES = (
    "conv2d_forward",
    "conv2d_backward_data",
    "conv2d_backward_weight",
    "conv2d_forward_workspace_size",
    "conv2d_backward_data_workspace_size",
    "conv2d_backward_weight_workspace_size",
)

# family module -> the table names it defines; every backend package has modules of these names
FAMILY_NAMES: dict[str, tuple[str, ...]] = {
    "dense": ("dense_forward", "dense_backward"),
    "elementwise": (
        "relu_forward",
        "relu_backward",
        "relu6_forward",
        "relu6_backward",
        "leaky_relu_forward",
        "leaky_relu_backward",
        "add_forward",
        "dropout_forward",
        "dropout_backward",
    ),
    "pool": (
        "maxpool2d_forward",
        "maxpool2d_backward",
        "avgpool2d_forward",
        "avgpool2d_backward",
        "global_avgpool_forward",
        "global_avgpool_backward",
    ),
    # batchnorm_backward (from the input) stays in the reference module only, as what the from-output
    # backward is tested against; no layer calls it since BatchNorm2d keeps its output (In-Place ABN)
    "batchnorm": ("batchnorm_forward_train", "batchnorm_forward_infer", "batchnorm_backward_from_output",
                  "batchnorm_forward_train_workspace_size", "batchnorm_backward_from_output_workspace_size"),
    "loss": ("softmax_xent_forward", "softmax_xent_backward"),
    "optim": ("sgd_update", "adam_update"),
}

OPTIONAL_NAMES: dict[str, tuple[str, ...]] = {
    # batch norm over chunks of images (engine/layers/chunked.py): the CPU and the reference have them; a
    # backend without them runs the separate layers (engine.layers.chunked.fuse_chunkable asks the table)
    "batchnorm": ("batchnorm_chunk_statistics", "batchnorm_chunk_finish", "batchnorm_chunk_apply",
                  "batchnorm_chunk_gradient_sums", "batchnorm_chunk_dx"),
}


def build_table(package: str) -> dict[str, Callable[..., Any]]:
    """Collect the table's functions from ``<package>.<family>``, and conv's once ``<package>.conv`` exists.

    Convolution is written separately; until its module lands the table simply lacks its names
    (a layer asking for one gets the table's "has no kernel" error) instead of failing to import.
    """
    table = {}
    for family, names in FAMILY_NAMES.items():
        module = importlib.import_module(f"{package}.{family}")
        table.update({name: getattr(module, name) for name in names})
        table.update({name: getattr(module, name) for name in OPTIONAL_NAMES.get(family, ()) if hasattr(module, name)})
    try:
        conv = importlib.import_module(f"{package}.conv")
    except ModuleNotFoundError as exc:
        if exc.name != f"{package}.conv":
            raise
    else:
        table.update({name: getattr(conv, name) for name in CONV_NAMES})
    return table


TABLE: dict[str, Callable[..., Any]] = build_table(__name__)

"""The NumPy reference kernel table: the ground truth every backend is tested against.

``TABLE`` has the names and signatures of kernels/README.md. Each function writes into the arrays
it is given, like the fast kernels, so the same test can call either.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from kernels.reference import batchnorm, dense, elementwise, loss, optim, pool

CONV_NAMES = (
    "conv2d_forward",
    "conv2d_backward_data",
    "conv2d_backward_weight",
    "conv2d_forward_workspace_size",
    "conv2d_backward_data_workspace_size",
    "conv2d_backward_weight_workspace_size",
)

FAMILY_NAMES: dict[Any, tuple[str, ...]] = {
    dense: ("dense_forward", "dense_backward"),
    elementwise: (
        "relu_forward",
        "relu_backward",
        "relu6_forward",
        "relu6_backward",
        "add_forward",
        "dropout_forward",
        "dropout_backward",
    ),
    pool: (
        "maxpool2d_forward",
        "maxpool2d_backward",
        "avgpool2d_forward",
        "avgpool2d_backward",
        "global_avgpool_forward",
        "global_avgpool_backward",
    ),
    batchnorm: ("batchnorm_forward_train", "batchnorm_forward_infer", "batchnorm_backward"),
    loss: ("softmax_xent_forward", "softmax_xent_backward"),
    optim: ("sgd_update", "adam_update"),
}


def build_table(package: str, family_names: dict[Any, tuple[str, ...]]) -> dict[str, Callable[..., Any]]:
    """Collect the named functions of each family module, plus conv's once ``<package>.conv`` exists.

    Convolution is written separately; until its module lands the table simply lacks its names
    (a layer asking for one gets the table's "has no kernel" error) instead of failing to import.
    """
    table = {name: getattr(module, name) for module, names in family_names.items() for name in names}
    try:
        conv = importlib.import_module(f"{package}.conv")
    except ModuleNotFoundError as exc:
        if exc.name != f"{package}.conv":
            raise
    else:
        table.update({name: getattr(conv, name) for name in CONV_NAMES})
    return table


TABLE: dict[str, Callable[..., Any]] = build_table(__name__, FAMILY_NAMES)

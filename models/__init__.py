"""Models built from engine layers: ``build_model(name, ...)`` returns a ready Network.

``resnet18`` and ``mobilenetv2`` are torchvision's models with torchvision's parameter names, in two
variants (``variant="cifar"``: the stems for 32×32 images; ``"imagenet"``: torchvision's exact
models); ``cnn`` and ``mlp`` are small nets for quick runs and tests. Options beyond the common ones
go to the model's graph function (``image_size``, ``variant``, ``width``, ``hidden``, ``depth``,
``dropout``, ``in_channels``, ``input_shape``).

Without a ``variant``, images up to ``CIFAR_MAX_SIZE`` pixels get the CIFAR variant and larger ones
the ImageNet variant: the CIFAR stem at 224×224 keeps full-resolution maps through ``layer1`` (7.1
GiB planned for backward at batch 32), which no one trains; the ImageNet stem at 32×32 leaves a 1×1
map after ``layer4``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine.checkpoint import register_models
from engine.graph import Graph
from engine.network import Network
from models.mobilenetv2 import mobilenetv2_graph
from models.resnet18 import resnet18_graph
from models.small import cnn_graph, mlp_graph

GRAPHS: dict[str, Callable[..., Graph]] = {
    "resnet18": resnet18_graph,
    "mobilenetv2": mobilenetv2_graph,
    "cnn": cnn_graph,
    "mlp": mlp_graph,
}
MODEL_NAMES = tuple(GRAPHS)
VARIANT_MODELS = ("resnet18", "mobilenetv2")  # the models with a cifar and an imagenet variant
VARIANTS = ("cifar", "imagenet")
CIFAR_MAX_SIZE = 64


def resolve_variant(name: str, variant: str | None, image_size: int) -> str | None:
    """The variant model ``name`` builds: ``variant`` if given, else by image size; None for models without."""
    if name not in VARIANT_MODELS:
        if variant is not None:
            raise ValueError(f"model {name!r} has no variants; --variant applies to {', '.join(VARIANT_MODELS)}")
        return None
    if variant is None:
        return "cifar" if image_size <= CIFAR_MAX_SIZE else "imagenet"
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}: choose one of {', '.join(VARIANTS)}")
    return variant


def build_model(
    name: str,
    num_classes: int = 10,
    backend: Any = "cpu",
    seed: int = 0,
    workspace_mode: str = "enabled",
    chunkable: bool = True,
    **options: Any,
) -> Network:
    """A Network for model ``name`` on ``backend`` (a Backend or a backend name), weights drawn from ``seed``;
    ``chunkable=False``: every layer its own node, none fused into chunked layers (``Network``)."""
    from engine.backend import get_backend

    if name not in GRAPHS:
        raise ValueError(f"unknown model {name!r}: choose one of {', '.join(MODEL_NAMES)}")
    if num_classes < 1:
        raise ValueError(f"num_classes must be at least 1, got {num_classes}")
    if isinstance(backend, str):
        backend = get_backend(backend)
    variant = resolve_variant(name, options.pop("variant", None), int(options.get("image_size", 32)))
    if variant is not None:
        options["variant"] = variant
    try:
        graph = GRAPHS[name](num_classes=num_classes, **options)
    except TypeError as exc:
        raise ValueError(f"model {name!r}: bad option ({exc})") from None
    net = Network(graph, backend, seed=seed, name=name, workspace_mode=workspace_mode, chunkable=chunkable)
    net.variant = variant  # what ran, for summaries (None for models without variants)
    return net


def build_network(
    model: str,
    data: Any,
    backend: Any,
    seed: int = 0,
    workspace_mode: str = "enabled",
    num_classes: int = 0,
    **model_options: Any,
) -> Network:
    """``build_model`` for ``model``, shaped for ``data``'s images (an ``engine.data.Dataset``: channels,
    size) and classes; ``model_options`` go to the model (``width``, ``hidden``, ...).

    It lives here, not in the trainer: the trainer takes a built network, and nothing under
    ``engine/`` but the benchmark tools imports ``models``.
    """
    channels, height, width = data.image_shape
    if model == "mlp":
        options: dict[str, Any] = {"input_shape": data.image_shape}
    else:
        if height != width:
            raise ValueError(f"model {model!r} takes square images; {data.name} has {height}×{width}")
        options = {"in_channels": channels, "image_size": height}
    return build_model(
        model, num_classes or data.num_classes, backend, seed=seed, workspace_mode=workspace_mode,
        **options, **model_options,
    )


def tensor_names() -> dict[str, set[str]]:
    """Every model's parameter and buffer names (torchvision's), for ``engine.checkpoint``'s mismatch message."""
    names: dict[str, set[str]] = {}
    for model, graph_fn in GRAPHS.items():
        graph = graph_fn(num_classes=10)
        names[model] = {node.layer.tensor_key(node.name, spec.name) for node in graph.nodes
                        for spec in (*node.layer.parameter_specs(), *node.layer.buffer_specs())}
    return names


register_models(tensor_names)

__all__ = [
    "CIFAR_MAX_SIZE", "MODEL_NAMES", "VARIANTS", "VARIANT_MODELS", "build_model", "build_network", "resolve_variant",
]

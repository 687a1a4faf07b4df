"""MobileNetV2 in two variants: ``imagenet`` (torchvision's exact model: stride-2 stem, torchvision's
stage strides) and ``cifar`` (for 32×32 images: stride 1 in the stem and in the second stage).

The structure and node names follow ``torchvision.models.mobilenet_v2`` (width 1.0): ``features.0``
is conv-bn-relu6 (``features.0.0``, ``features.0.1``), ``features.1..17`` are inverted residual
blocks whose layers sit under ``features.N.conv.*``, ``features.18`` is the 1×1 conv to 1280
channels, then global average pooling and ``classifier`` = Dropout(0.2), Linear. Parameter and
buffer names therefore equal torchvision's state_dict keys (``features.1.conv.0.0.weight``,
``classifier.1.weight``). For 32×32 inputs the stem and ``features.2`` (the first t=6, c=24 block)
use stride 1 instead of 2, so the last feature map is 4×4 instead of 1×1; the ImageNet variant keeps
torchvision's strides (a 224×224 image ends as a 7×7 map). Both variants have the same parameters.
"""

from __future__ import annotations

from engine.graph import Graph
from engine.layers import Add, BatchNorm2d, Conv2d, Dense, Dropout, GlobalAvgPool, ReLU6

# (expansion t, output channels c, repeats n, stride s of the first block): torchvision's table
# (the ImageNet variant); the CIFAR variant sets the second row's stride 2 -> 1 for 32×32 inputs.
INVERTED_RESIDUAL_SETTING = (
    (1, 16, 1, 1),
    (6, 24, 2, 2),
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
)
STEM_CHANNELS = 32
LAST_CHANNELS = 1280


def conv_bn_relu6(prefix: str, source: str, cin: int, cout: int, kernel: int, stride: int, groups: int = 1) -> list:
    """torchvision's Conv2dNormActivation: ``prefix.0`` conv (no bias), ``prefix.1`` BN, ``prefix.2`` ReLU6."""
    return [
        (f"{prefix}.0", Conv2d(cin, cout, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False), [source]),
        (f"{prefix}.1", BatchNorm2d(cout), [f"{prefix}.0"]),
        (f"{prefix}.2", ReLU6(), [f"{prefix}.1"]),
    ]


def inverted_residual(prefix: str, source: str, cin: int, cout: int, stride: int, expansion: int) -> tuple[list, str]:
    """Expand (1×1, unless t=1), depthwise 3×3, project (1×1, linear); add the input when shapes allow."""
    hidden = cin * expansion
    nodes, current, index = [], source, 0
    if expansion != 1:
        nodes += conv_bn_relu6(f"{prefix}.conv.{index}", current, cin, hidden, 1, 1)
        current, index = f"{prefix}.conv.{index}.2", index + 1
    nodes += conv_bn_relu6(f"{prefix}.conv.{index}", current, hidden, hidden, 3, stride, groups=hidden)
    current, index = f"{prefix}.conv.{index}.2", index + 1
    nodes += [
        (f"{prefix}.conv.{index}", Conv2d(hidden, cout, 1, 1, 0, bias=False), [current]),
        (f"{prefix}.conv.{index + 1}", BatchNorm2d(cout), [f"{prefix}.conv.{index}"]),
    ]
    current = f"{prefix}.conv.{index + 1}"
    if stride == 1 and cin == cout:
        nodes.append((f"{prefix}.add", Add(), [source, current]))
        current = f"{prefix}.add"
    return nodes, current


def mobilenetv2_graph(
    num_classes: int = 10, in_channels: int = 3, image_size: int = 32, dropout: float = 0.2, variant: str = "cifar"
) -> Graph:
    """The MobileNetV2 graph; ``variant`` is ``cifar`` (strides 1 in the stem and stage 2) or ``imagenet``."""
    if variant not in ("cifar", "imagenet"):
        raise ValueError(f"mobilenetv2: variant must be 'cifar' or 'imagenet', got {variant!r}")
    setting = INVERTED_RESIDUAL_SETTING
    if variant == "cifar":
        setting = tuple((t, c, n, 1 if row == 1 else s) for row, (t, c, n, s) in enumerate(setting))
    nodes = conv_bn_relu6("features.0", "input", in_channels, STEM_CHANNELS, 3, 2 if variant == "imagenet" else 1)
    source, channels, index = "features.0.2", STEM_CHANNELS, 1
    for expansion, out_channels, repeats, stride in setting:
        for repeat in range(repeats):
            block, source = inverted_residual(
                f"features.{index}", source, channels, out_channels, stride if repeat == 0 else 1, expansion
            )
            nodes += block
            channels, index = out_channels, index + 1
    nodes += conv_bn_relu6(f"features.{index}", source, channels, LAST_CHANNELS, 1, 1)
    nodes += [
        ("pool", GlobalAvgPool(), [f"features.{index}.2"]),
        ("classifier.0", Dropout(dropout), ["pool"]),
        ("classifier.1", Dense(LAST_CHANNELS, num_classes), ["classifier.0"]),
    ]
    return Graph(nodes, input_shape=(in_channels, image_size, image_size))

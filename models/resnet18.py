"""ResNet-18 in two variants: ``imagenet`` (torchvision's exact model: 7×7 stride-2 stem, 3×3 stride-2
max-pool) and ``cifar`` (for 32×32 images: a 3×3 stride-1 stem and no max-pool).

Node names are torchvision's module paths, so parameter and buffer names equal the keys of
``torchvision.models.resnet18().state_dict()`` (``conv1.weight``, ``layer1.0.bn1.running_mean``,
``layer2.0.downsample.0.weight``, ``fc.bias``): a PyTorch checkpoint loads one to one. Only the stem
differs between the variants: the CIFAR ``conv1`` is 64×3×3×3 instead of 64×3×7×7, and it has no
``maxpool`` (a node without parameters, so the state_dict keys are the same set). At 32×32 the
ImageNet stem would leave a 1×1 map after ``layer4``; at 224×224 the CIFAR stem would keep 224×224
maps through ``layer1`` (7.1 GiB planned for backward at batch 32 instead of ~1.5 GiB).
"""

from __future__ import annotations

from engine.graph import Graph
from engine.layers import Add, BatchNorm2d, Conv2d, Dense, GlobalAvgPool, MaxPool2d, ReLU

STAGES = ((64, 1), (128, 2), (256, 2), (512, 2))  # (channels, stride of the first block) of layer1..layer4
BLOCKS_PER_STAGE = 2


def basic_block(prefix: str, source: str, in_channels: int, channels: int, stride: int) -> tuple[list, str]:
    """conv3×3-bn-relu-conv3×3-bn, plus the shortcut (1×1 conv + bn when the shape changes), add, relu."""
    nodes = [
        (f"{prefix}.conv1", Conv2d(in_channels, channels, 3, stride, 1, bias=False), [source]),
        (f"{prefix}.bn1", BatchNorm2d(channels), [f"{prefix}.conv1"]),
        (f"{prefix}.relu1", ReLU(), [f"{prefix}.bn1"]),
        (f"{prefix}.conv2", Conv2d(channels, channels, 3, 1, 1, bias=False), [f"{prefix}.relu1"]),
        (f"{prefix}.bn2", BatchNorm2d(channels), [f"{prefix}.conv2"]),
    ]
    shortcut = source
    if stride != 1 or in_channels != channels:
        nodes += [
            (f"{prefix}.downsample.0", Conv2d(in_channels, channels, 1, stride, 0, bias=False), [source]),
            (f"{prefix}.downsample.1", BatchNorm2d(channels), [f"{prefix}.downsample.0"]),
        ]
        shortcut = f"{prefix}.downsample.1"
    nodes += [
        (f"{prefix}.add", Add(), [f"{prefix}.bn2", shortcut]),
        (f"{prefix}.relu2", ReLU(), [f"{prefix}.add"]),
    ]
    return nodes, f"{prefix}.relu2"


def resnet18_graph(
    num_classes: int = 10, in_channels: int = 3, image_size: int = 32, variant: str = "cifar"
) -> Graph:
    """The ResNet-18 graph; ``variant`` is ``cifar`` (3×3 stride-1 stem) or ``imagenet`` (torchvision's)."""
    if variant == "imagenet":
        nodes = [
            ("conv1", Conv2d(in_channels, 64, 7, 2, 3, bias=False), ["input"]),
            ("bn1", BatchNorm2d(64), ["conv1"]),
            ("relu", ReLU(), ["bn1"]),
            ("maxpool", MaxPool2d(3, 2, 1), ["relu"]),
        ]
        source = "maxpool"
    elif variant == "cifar":
        nodes = [
            ("conv1", Conv2d(in_channels, 64, 3, 1, 1, bias=False), ["input"]),
            ("bn1", BatchNorm2d(64), ["conv1"]),
            ("relu", ReLU(), ["bn1"]),
        ]
        source = "relu"
    else:
        raise ValueError(f"resnet18: variant must be 'cifar' or 'imagenet', got {variant!r}")
    channels = 64
    for stage, (stage_channels, stride) in enumerate(STAGES, start=1):
        for block in range(BLOCKS_PER_STAGE):
            block_nodes, source = basic_block(
                f"layer{stage}.{block}", source, channels, stage_channels, stride if block == 0 else 1
            )
            nodes += block_nodes
            channels = stage_channels
    nodes += [
        ("avgpool", GlobalAvgPool(), [source]),
        ("fc", Dense(512, num_classes), ["avgpool"]),
    ]
    return Graph(nodes, input_shape=(in_channels, image_size, image_size))

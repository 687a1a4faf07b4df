"""Small networks for quick runs and tests: ``cnn`` (trains digits in seconds) and ``mlp`` (a deep
stack of dense layers: many equal-sized layers, handy for offload windows)."""

from __future__ import annotations

from engine.graph import Graph
from engine.layers import BatchNorm2d, Conv2d, Dense, Flatten, MaxPool2d, ReLU


def cnn_graph(num_classes: int = 10, in_channels: int = 3, image_size: int = 32, width: int = 16) -> Graph:
    """Two conv-bn-relu-maxpool stages (width, 2·width channels), then a dense classifier."""
    if image_size % 4:
        raise ValueError(f"cnn: image_size must divide by 4 (two 2×2 pools), got {image_size}")
    features = 2 * width * (image_size // 4) ** 2
    nodes = [
        ("conv1", Conv2d(in_channels, width, 3, 1, 1, bias=False), ["input"]),
        ("bn1", BatchNorm2d(width), ["conv1"]),
        ("relu1", ReLU(), ["bn1"]),
        ("pool1", MaxPool2d(2), ["relu1"]),
        ("conv2", Conv2d(width, 2 * width, 3, 1, 1, bias=False), ["pool1"]),
        ("bn2", BatchNorm2d(2 * width), ["conv2"]),
        ("relu2", ReLU(), ["bn2"]),
        ("pool2", MaxPool2d(2), ["relu2"]),
        ("flatten", Flatten(), ["pool2"]),
        ("fc", Dense(features, num_classes), ["flatten"]),
    ]
    return Graph(nodes, input_shape=(in_channels, image_size, image_size))


def mlp_graph(
    num_classes: int = 10, input_shape: tuple[int, ...] = (3, 32, 32), hidden: int = 256, depth: int = 4
) -> Graph:
    """Flatten, ``depth`` × (Dense(hidden) + ReLU), then Dense(num_classes). Names: fc1..fc{depth}, out."""
    if depth < 1:
        raise ValueError(f"mlp: depth must be at least 1, got {depth}")
    features = 1
    for d in input_shape:
        features *= d
    nodes = [("flatten", Flatten(), ["input"])]
    source = "flatten"
    for i in range(1, depth + 1):
        nodes += [
            (f"fc{i}", Dense(features if i == 1 else hidden, hidden), [source]),
            (f"relu{i}", ReLU(), [f"fc{i}"]),
        ]
        source = f"relu{i}"
    nodes.append(("out", Dense(hidden, num_classes), [source]))
    return Graph(nodes, input_shape=tuple(input_shape))

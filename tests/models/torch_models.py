"""PyTorch twins of the engine's models, with the same module paths, for parity tests.

torchvision does not import beside torch 2.13 here, so these are written out by hand: the CIFAR
ResNet-18 (3×3 stride-1 stem, no max-pool) and the CIFAR MobileNetV2 (stride 1 in the stem and in
features.2), whose state_dict keys equal torchvision's, plus the small ``cnn``.

Every activation is its own module named like the engine's node (``layer1.0.relu1``,
``features.3.conv.0.2``), and can be told which side of its kink each element fell on in the engine
(``decided``): ReLU's gradient jumps at 0, so an input within float32 rounding of 0 may legitimately
land on different sides in two float32 implementations, and one such element changes a gradient by
tens of percent. With ``decided`` set, the float64 twin evaluates exactly the piecewise-linear
function the engine chose, and the parity test checks separately that the engine only ever chose a
side differently where the input is within rounding of the kink.
"""

from __future__ import annotations

import torch
from torch import nn


class ReLU(nn.Module):
    """max(x, 0); with ``decided`` (the engine's output) set, follows the engine's choice of side."""

    upper: float | None = None

    def __init__(self):
        super().__init__()
        self.decided: torch.Tensor | None = None
        self.seen_input: torch.Tensor | None = None

    def forward(self, x):
        self.seen_input = x.detach()
        if self.decided is None:
            return torch.clamp(x, 0, self.upper)
        out = torch.where(self.decided > 0, x, torch.zeros_like(x))
        if self.upper is not None:
            out = torch.where(self.decided >= self.upper, torch.full_like(x, self.upper), out)
        return out


class ReLU6(ReLU):
    upper = 6.0


class MaxPool(nn.Module):
    """``nn.MaxPool2d``; with ``decided`` (the engine's argmax: each window's winner as its place r·kernel + s,
    ``kernels/cpu/pool.py``) set, takes the engine's winner in every window, as ``ReLU`` follows its side of 0: a
    float64 twin then routes the gradient where the engine did, even where two values of a window tie within
    float32 rounding."""

    def __init__(self, kernel: int, stride: int, padding: int):
        super().__init__()
        self.kernel, self.stride, self.padding = kernel, stride, padding
        self.decided: torch.Tensor | None = None
        self.seen_input: torch.Tensor | None = None

    def windows(self, x):
        """Every window's values, (n·c, kernel², windows), padding as -inf: column j is window j in row-major order,
        row r·kernel + s its place (r, s)."""
        n, c, h, w = x.shape
        p = self.padding
        padded = nn.functional.pad(x, (p, p, p, p), value=float("-inf")).reshape(n * c, 1, h + 2 * p, w + 2 * p)
        return nn.functional.unfold(padded, self.kernel, stride=self.stride)

    def winners(self, x):
        """The window places this pool's own arithmetic picks on ``x``: the first maximum, row-major (the engine's
        and PyTorch's rule)."""
        n, c, h, w = x.shape
        size = [(side + 2 * self.padding - self.kernel) // self.stride + 1 for side in (h, w)]
        return self.windows(x).argmax(1).reshape(n, c, *size)

    def forward(self, x):
        self.seen_input = x.detach()
        if self.decided is None:
            return nn.functional.max_pool2d(x, self.kernel, self.stride, self.padding)
        n, c = x.shape[:2]
        places = self.decided.reshape(n * c, 1, -1).long()
        return self.windows(x).gather(1, places).reshape(n, c, *self.decided.shape[2:])


class BasicBlock(nn.Module):
    def __init__(self, in_channels: int, channels: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.relu1 = ReLU()
        self.conv2 = nn.Conv2d(channels, channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.downsample = None
        if stride != 1 or in_channels != channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, channels, 1, stride, bias=False), nn.BatchNorm2d(channels)
            )
        self.relu2 = ReLU()

    def forward(self, x):
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        shortcut = x if self.downsample is None else self.downsample(x)
        return self.relu2(out + shortcut)


class ResNet18Cifar(nn.Module):
    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = ReLU()
        channels = 64
        for stage, (out_channels, stride) in enumerate(((64, 1), (128, 2), (256, 2), (512, 2)), start=1):
            blocks = [BasicBlock(channels, out_channels, stride), BasicBlock(out_channels, out_channels, 1)]
            setattr(self, f"layer{stage}", nn.Sequential(*blocks))
            channels = out_channels
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x):
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class ResNet18ImageNet(ResNet18Cifar):
    """torchvision's ResNet-18 (7×7 stride-2 stem, 3×3 stride-2 max-pool) with the activations as modules: the twin of
    the engine's ``variant="imagenet"`` (benchmarks/conv_precision.py --gradients at ImageNet sizes)."""

    def __init__(self, num_classes: int = 10):
        super().__init__(num_classes)
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.maxpool = MaxPool(3, 2, 1)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def conv_bn_relu6(cin: int, cout: int, kernel: int, stride: int, groups: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False),
        nn.BatchNorm2d(cout),
        ReLU6(),
    )


class InvertedResidual(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, expansion: int):
        super().__init__()
        hidden = cin * expansion
        self.use_residual = stride == 1 and cin == cout
        layers = [] if expansion == 1 else [conv_bn_relu6(cin, hidden, 1, 1)]
        layers += [
            conv_bn_relu6(hidden, hidden, 3, stride, groups=hidden),
            nn.Conv2d(hidden, cout, 1, 1, 0, bias=False),
            nn.BatchNorm2d(cout),
        ]
        self.conv = nn.Sequential(*layers)

    def forward(self, x):
        return x + self.conv(x) if self.use_residual else self.conv(x)


class MobileNetV2Cifar(nn.Module):
    SETTING = (
        (1, 16, 1, 1),
        (6, 24, 2, 1),
        (6, 32, 3, 2),
        (6, 64, 4, 2),
        (6, 96, 3, 1),
        (6, 160, 3, 2),
        (6, 320, 1, 1),
    )

    def __init__(self, num_classes: int = 10, dropout: float = 0.2):
        super().__init__()
        features = [conv_bn_relu6(3, 32, 3, 1)]
        channels = 32
        for expansion, out_channels, repeats, stride in self.SETTING:
            for i in range(repeats):
                features.append(InvertedResidual(channels, out_channels, stride if i == 0 else 1, expansion))
                channels = out_channels
        features.append(conv_bn_relu6(channels, 1280, 1, 1))
        self.features = nn.Sequential(*features)
        self.classifier = nn.Sequential(nn.Dropout(dropout), nn.Linear(1280, num_classes))

    def forward(self, x):
        x = self.features(x)
        x = torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1)
        return self.classifier(x)


class SmallCnn(nn.Module):
    def __init__(self, num_classes: int = 10, in_channels: int = 3, image_size: int = 32, width: int = 16):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu1 = ReLU()
        self.conv2 = nn.Conv2d(width, 2 * width, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(2 * width)
        self.relu2 = ReLU()
        self.fc = nn.Linear(2 * width * (image_size // 4) ** 2, num_classes)

    def forward(self, x):
        x = nn.functional.max_pool2d(self.relu1(self.bn1(self.conv1(x))), 2)
        x = nn.functional.max_pool2d(self.relu2(self.bn2(self.conv2(x))), 2)
        return self.fc(torch.flatten(x, 1))


TORCH_MODELS = {"resnet18": ResNet18Cifar, "mobilenetv2": MobileNetV2Cifar, "cnn": SmallCnn}


def load_engine_weights(module: nn.Module, state: dict) -> None:
    """Copy an engine state_dict (host NumPy arrays) into ``module``, strictly."""
    module.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in state.items()}, strict=True)

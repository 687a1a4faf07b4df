"""The ImageNet variants against torchvision's own models at 224×224: weights saved from
``torchvision.models.resnet18()`` / ``mobilenet_v2()`` with ``safetensors.torch.save_file`` load by
name, strictly, and then logits, loss, every gradient and one SGD step (momentum, weight decay)
match torchvision's model run in float64.

As in ``test_model_parity``, the float64 reference follows the engine's side of every ReLU/ReLU6 kink
(an input within float32 rounding of 0 may fall on either side; one such element moves a gradient by
far more than rounding). torchvision's blocks reuse one ReLU module twice, so here every ReLU/ReLU6
module is replaced by one that replays the engine's activations in call order, which is the engine's
node order (checked by shape on every call).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_model_parity import assert_close

from engine.backend import get_backend
from engine.checkpoint import load_weights
from engine.layers.chunked import ChunkedConvBN
from models import build_model

LR, MOMENTUM, WEIGHT_DECAY = 0.1, 0.9, 5e-4
SIZE, CLASSES = 224, 10
BATCH = {"resnet18": 2, "mobilenetv2": 1}  # torch's float64 depthwise conv is slow: one image for MobileNetV2


class Replay(torch.nn.Module):
    """ReLU or ReLU6 that takes the side of each kink from the engine's recorded outputs, in call order."""

    def __init__(self, upper: float | None, decisions: list):
        super().__init__()
        self.upper, self.decisions = upper, decisions

    def forward(self, x):
        decided = self.decisions.pop(0)
        assert tuple(decided.shape) == tuple(x.shape), "the engine ran its activations in another order"
        out = torch.where(decided > 0, x, torch.zeros_like(x))
        if self.upper is not None:
            out = torch.where(decided >= self.upper, torch.full_like(x, self.upper), out)
        return out


def replace_activations(module: torch.nn.Module, decisions: list) -> int:
    count = 0
    for name, child in module.named_children():
        if isinstance(child, (torch.nn.ReLU, torch.nn.ReLU6)):
            setattr(module, name, Replay(6.0 if isinstance(child, torch.nn.ReLU6) else None, decisions))
            count += 1
        else:
            count += replace_activations(child, decisions)
    return count


def torchvision_model(torchvision, name: str):
    torch.manual_seed(0)
    if name == "resnet18":
        model = torchvision.models.resnet18(num_classes=CLASSES)
    else:
        model = torchvision.models.mobilenet_v2(num_classes=CLASSES, dropout=0.0)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # batch norms away from their identity initialization, so their tensors matter
        for module in model.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.weight.uniform_(0.5, 1.5, generator=generator)
                module.bias.uniform_(-0.2, 0.2, generator=generator)
                module.running_mean.uniform_(-0.1, 0.1, generator=generator)
                module.running_var.uniform_(0.5, 1.5, generator=generator)
                module.num_batches_tracked.fill_(7)
    return model


@pytest.mark.parametrize("name", ["resnet18", "mobilenetv2"])
def test_imagenet_variant_matches_torchvision(name, torchvision, tmp_path, one_torch_thread):
    from safetensors.torch import save_file

    backend = get_backend("cpu")
    reference = torchvision_model(torchvision, name)
    path = str(tmp_path / f"{name}.safetensors")
    save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, path)

    options = {"dropout": 0.0} if name == "mobilenetv2" else {}
    net = build_model(name, CLASSES, backend, seed=3, image_size=SIZE, **options)
    assert net.variant == "imagenet"  # chosen from the image size
    assert net.chunked  # the large early layers run in chunks (engine/layers/chunked.py)
    load_weights(path, net)  # strict: every key, every shape

    rng = np.random.default_rng(1)
    x = rng.standard_normal((BATCH[name], 3, SIZE, SIZE)).astype(np.float32)
    labels = rng.integers(0, CLASSES, BATCH[name]).astype(np.int64)
    recorded: list[np.ndarray] = []

    class Recorder:
        def after_forward(self, step, node):
            layer = node.layer
            if type(layer).__name__ in ("ReLU", "ReLU6"):
                recorded.append(np.array(backend.to_host(layer.saved["out"].array)))
            elif isinstance(layer, ChunkedConvBN) and layer.activation is not None:
                # the chunked stem and 112/56-pixel layers: their activation of the batch-norm output they keep
                y = np.array(backend.to_host(layer.saved["y"].array))
                recorded.append(np.clip(y, 0, 6 if layer.activation == "relu6" else None))

    net.hooks.append(Recorder())
    logits = backend.to_host(net.forward(x, training=True).array).copy()
    loss = net.loss(labels)
    net.backward()
    momentum = np.zeros_like(net.parameters.flat)
    backend.kernels.sgd_update(net.parameters.flat, net.gradients.flat, momentum, LR, MOMENTUM, WEIGHT_DECAY, False)

    decisions = [torch.from_numpy(a).double() for a in recorded]
    assert replace_activations(reference, decisions) > 0
    reference = reference.double().train()
    ref_logits = reference(torch.from_numpy(x).double())
    assert not decisions, "torchvision's model ran fewer activations than the engine's"
    ref_loss = torch.nn.functional.cross_entropy(ref_logits, torch.from_numpy(labels))
    ref_loss.backward()

    assert_close("logits", logits, ref_logits, 1e-4)
    assert loss == pytest.approx(ref_loss.item(), rel=1e-5)
    grads = {k: p.grad for k, p in reference.named_parameters()}
    floor = 1e-4 * max(float(g.abs().max()) for g in grads.values())
    assert list(grads) == list(net.gradients.views)
    for key, grad in grads.items():
        assert_close(f"gradient {key}", net.gradients.views[key], grad, 1e-4, floor)

    torch.optim.SGD(reference.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY).step()
    state, ref_state = net.state_dict(), reference.state_dict()
    assert set(state) == set(ref_state)
    for key, value in ref_state.items():
        if key.endswith("num_batches_tracked"):
            assert int(state[key]) == int(value) == 8
        else:
            assert_close(key, state[key], value, 1e-4, LR * floor)
    net.close()


@pytest.mark.parametrize("name", ["resnet18", "mobilenetv2"])
def test_cifar_weights_do_not_load_into_imagenet_variant(name, torchvision, tmp_path):
    """Strict loading names the mismatch: a CIFAR ResNet-18's 3×3 conv1 into the 7×7 ImageNet stem."""
    from engine.checkpoint import CheckpointError
    from engine.checkpoint import save_checkpoint as save

    cifar = build_model(name, CLASSES, "cpu", image_size=32)
    path = str(tmp_path / "cifar.safetensors")
    save(path, cifar)
    imagenet = build_model(name, CLASSES, "cpu", image_size=64, variant="imagenet")
    if name == "resnet18":
        with pytest.raises(CheckpointError, match="conv1.weight"):
            load_weights(path, imagenet)
    else:  # MobileNetV2's variants differ only in strides: the same tensors load
        load_weights(path, imagenet)
    cifar.close()
    imagenet.close()

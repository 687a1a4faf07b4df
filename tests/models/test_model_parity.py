"""ResNet-18 and MobileNetV2 (CIFAR variants) against PyTorch CPU: same weights, same batch, one SGD step.

The reference is the PyTorch twin in **float64**, evaluated on the piecewise-linear function the
engine chose at every ReLU/ReLU6 kink (see ``torch_models``): float64 makes the reference exact to
far below float32 rounding, and following the engine's side of each kink removes the one legitimate
source of large differences (an input within rounding of 0 flips one element's gradient). A separate
assertion checks that the engine picked a different side than exact arithmetic only for inputs within
1e-5 of the tensor's scale of the kink, so a wrong activation cannot hide behind this.

Tolerances: logits, loss, running statistics and updated weights rtol 1e-4 (forward quantities are
accurate to ~1e-6; an updated weight also gets the gradient floor times the learning rate).
Gradients: 1e-4 of the tensor's largest magnitude, with a floor of 1e-4 of the model's largest
gradient (some tensors are exactly zero in exact arithmetic, e.g. the bias of a batch norm followed
by another batch norm, and float32 leaves ~1e-9 there).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch_models import TORCH_MODELS, ReLU

from engine.backend import get_backend
from models import build_model

LR, MOMENTUM, WEIGHT_DECAY = 0.1, 0.9, 5e-4
BATCH = 2


class ReluRecorder:
    """Network hook: a host copy of every ReLU/ReLU6 node's output, taken right after its forward."""

    def __init__(self, backend):
        self.backend = backend
        self.outputs: dict[str, np.ndarray] = {}

    def after_forward(self, step, node):
        if "out" in node.layer.saved and type(node.layer).__name__ in ("ReLU", "ReLU6"):
            self.outputs[node.name] = np.array(self.backend.to_host(node.layer.saved["out"].array))


def assert_close(name, ours, ref, rtol, floor=0.0):
    ref = ref.detach().numpy() if isinstance(ref, torch.Tensor) else np.asarray(ref)
    atol = max(rtol * float(np.abs(ref).max()), floor)
    err = float(np.abs(ours.astype(np.float64) - ref).max())
    assert err <= atol, f"{name}: max error {err:.3g} > {atol:.3g} (largest |ref| {np.abs(ref).max():.3g})"


@pytest.mark.parametrize("model", ["resnet18", "mobilenetv2"])
def test_one_training_step_matches_pytorch(model, one_torch_thread):
    backend = get_backend("cpu")
    options = {"dropout": 0.0} if model == "mobilenetv2" else {}
    net = build_model(model, num_classes=10, backend=backend, seed=0, **options)
    twin = TORCH_MODELS[model](10, **options)
    twin.load_state_dict({k: torch.from_numpy(v) for k, v in net.state_dict().items()}, strict=True)
    twin = twin.double().train()

    rng = np.random.default_rng(1)
    x = rng.standard_normal((BATCH, 3, 32, 32)).astype(np.float32)
    labels = rng.integers(0, 10, BATCH).astype(np.int64)

    recorder = ReluRecorder(backend)
    net.hooks.append(recorder)
    logits = backend.to_host(net.forward(x, training=True).array).copy()
    loss = net.loss(labels)
    net.backward()
    momentum = np.zeros_like(net.parameters.flat)
    backend.kernels.sgd_update(net.parameters.flat, net.gradients.flat, momentum, LR, MOMENTUM, WEIGHT_DECAY, False)

    relus = {name: m for name, m in twin.named_modules() if isinstance(m, ReLU)}
    assert set(relus) == set(recorder.outputs)
    for name, module in relus.items():
        module.decided = torch.from_numpy(recorder.outputs[name]).double()
    twin_logits = twin(torch.from_numpy(x).double())
    twin_loss = torch.nn.functional.cross_entropy(twin_logits, torch.from_numpy(labels))
    twin_loss.backward()

    for name, module in relus.items():  # the engine's side of each kink is exact arithmetic's side ...
        exact, decided = module.seen_input.numpy(), recorder.outputs[name]
        upper = module.upper if module.upper is not None else np.inf
        exact_side = np.where(exact <= 0, 0, np.where(exact >= upper, 2, 1))
        engine_side = np.where(decided <= 0, 0, np.where(decided >= upper, 2, 1))
        differs = exact_side != engine_side
        distance = np.minimum(np.abs(exact), np.abs(exact - upper))[differs]
        scale = np.abs(exact).max()  # ... except within rounding of the kink
        assert distance.size == 0 or distance.max() <= 1e-5 * scale, f"{name}: the activation chose a wrong side"

    assert_close("logits", logits, twin_logits, 1e-4)
    assert loss == pytest.approx(twin_loss.item(), rel=1e-5)
    grads = {name: p.grad for name, p in twin.named_parameters()}
    floor = 1e-4 * max(float(g.abs().max()) for g in grads.values())
    assert list(grads) == list(net.gradients.views)
    for name, grad in grads.items():
        assert_close(f"gradient {name}", net.gradients.views[name], grad, 1e-4, floor)

    torch.optim.SGD(twin.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY).step()
    state = net.state_dict()
    twin_state = twin.state_dict()
    assert set(state) == set(twin_state)
    for name, value in twin_state.items():
        if name.endswith("num_batches_tracked"):
            assert int(state[name]) == int(value) == 1
        else:  # updated weights (a gradient error moves them by LR times it), running_mean, running_var
            assert_close(name, state[name], value, 1e-4, LR * floor)
    net.close()


def test_the_imagenet_resnet18_twin_is_the_engines_model():
    # benchmarks/conv_precision.py --gradients at ImageNet sizes follows the engine's masks node by node through it
    # (not its arithmetic, which a 224 run would have to compile for: that benchmark's runs put the engine's gradients
    # within 6e-6 (relative, all together) of this twin's in float64, kernels/README.md "Rounding per path")
    from torch_models import ResNet18ImageNet

    backend = get_backend("cpu")
    net = build_model("resnet18", num_classes=10, backend=backend, seed=0, image_size=64, variant="imagenet")
    twin = ResNet18ImageNet(10)
    twin.load_state_dict({k: torch.from_numpy(v) for k, v in net.state_dict().items()}, strict=True)
    relus = {name for name, m in twin.named_modules() if isinstance(m, ReLU)}
    assert relus == {node.name for node in net.graph.nodes if type(node.layer).__name__ == "ReLU"}
    # the max pool follows the engine's winners when given them (torch_models.MaxPool), as the ReLUs its masks
    assert [type(m).__name__ for m in (twin.conv1, twin.maxpool)] == ["Conv2d", "MaxPool"]
    assert (twin.conv1.kernel_size, twin.conv1.stride) == ((7, 7), (2, 2))
    assert (twin.maxpool.kernel, twin.maxpool.stride, twin.maxpool.padding) == (3, 2, 1)
    x = torch.randn(2, 64, 16, 16)
    assert torch.equal(twin.maxpool(x), torch.nn.functional.max_pool2d(x, 3, 2, 1))  # without them: nn.MaxPool2d
    net.close()

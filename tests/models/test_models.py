"""Model structure: torchvision's names and shapes, build_model's options and errors, and a training step."""

from __future__ import annotations

import numpy as np
import pytest
from torch_models import TORCH_MODELS

from engine.backend import get_backend
from models import MODEL_NAMES, build_model

PARAMETER_COUNTS = {"resnet18": 11_173_962, "mobilenetv2": 2_236_682}  # torchvision's, with 10 classes


@pytest.fixture(scope="module")
def backend():
    return get_backend("cpu")


@pytest.mark.parametrize("name", ["resnet18", "mobilenetv2", "cnn"])
def test_state_dict_names_and_shapes_equal_the_pytorch_twin(backend, name):
    net = build_model(name, num_classes=7, backend=backend)
    theirs = {k: tuple(v.shape) for k, v in TORCH_MODELS[name](7).state_dict().items()}
    ours = {k: tuple(v.shape) for k, v in net.state_dict().items()}
    assert ours == theirs
    if name in PARAMETER_COUNTS:
        assert build_model(name, backend=backend).num_parameters == PARAMETER_COUNTS[name]
    net.close()


def test_torchvision_key_examples(backend):
    resnet = build_model("resnet18", backend=backend).state_dict()
    for key in ("conv1.weight", "layer1.0.bn1.running_mean", "layer2.0.downsample.0.weight", "fc.bias"):
        assert key in resnet
    assert resnet["conv1.weight"].shape == (64, 3, 3, 3)  # the CIFAR stem
    mobilenet = build_model("mobilenetv2", backend=backend).state_dict()
    for key in (
        "features.0.0.weight",
        "features.1.conv.0.0.weight",
        "features.18.1.running_var",
        "classifier.1.weight",
    ):
        assert key in mobilenet
    assert mobilenet["features.1.conv.0.0.weight"].shape == (32, 1, 3, 3)  # depthwise


@pytest.mark.parametrize(
    "name, options, output_shape",
    [("resnet18", {}, (2, 4)), ("mobilenetv2", {}, (2, 4)), ("cnn", {"image_size": 8}, (2, 4)), ("mlp", {}, (2, 4))],
)
def test_every_model_predicts(backend, name, options, output_shape):
    net = build_model(name, num_classes=4, backend=backend, **options)
    shape = (2, *net.graph.input_shape)
    logits = net.predict(np.random.default_rng(0).standard_normal(shape).astype(np.float32))
    assert logits.shape == output_shape and np.isfinite(logits).all()
    net.close()


def test_mobilenetv2_keeps_cifar_resolution(backend):
    shapes = build_model("mobilenetv2", backend=backend).graph.shapes(batch_size=1)
    net = build_model("mobilenetv2", backend=backend)
    by_name = {n.name: shapes[n.index] for n in net.graph.nodes}
    assert by_name["features.0.2"] == (1, 32, 32, 32)  # stride-1 stem
    assert by_name["features.2.conv.3"] == (1, 24, 32, 32)  # stride-1 second stage
    assert by_name["features.18.2"] == (1, 1280, 4, 4)
    net.close()


def test_mlp_depth_and_width(backend):
    net = build_model("mlp", backend=backend, input_shape=(10,), hidden=8, depth=6)
    names = [n for n in net.state_dict() if n.endswith(".weight")]
    assert names == [f"fc{i}.weight" for i in range(1, 7)] + ["out.weight"]
    assert net.state_dict()["fc1.weight"].shape == (8, 10)
    net.close()


def test_cnn_learns_a_separable_problem(backend):
    net = build_model("cnn", num_classes=2, backend=backend, image_size=8, seed=0)
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 32).astype(np.int64)
    x = (rng.standard_normal((32, 3, 8, 8)) * 0.5 + (2.0 * y - 1)[:, None, None, None]).astype(np.float32)
    losses = []
    for _ in range(10):
        net.forward(x, training=True)
        losses.append(net.loss(y))
        net.backward()
        net.parameters.flat[...] -= 0.05 * net.gradients.flat
    assert losses[-1] < 0.5 * losses[0]
    assert (net.predict(x).argmax(axis=1) == y).mean() == 1.0
    net.close()


def test_build_model_errors(backend):
    assert MODEL_NAMES == ("resnet18", "mobilenetv2", "cnn", "mlp")
    with pytest.raises(ValueError, match="unknown model 'vgg'.*resnet18, mobilenetv2, cnn, mlp"):
        build_model("vgg", backend=backend)
    with pytest.raises(ValueError, match="bad option"):
        build_model("cnn", backend=backend, depth=3)
    with pytest.raises(ValueError, match="num_classes"):
        build_model("cnn", num_classes=0, backend=backend)
    with pytest.raises(ValueError, match="divide by 4"):
        build_model("cnn", backend=backend, image_size=10)

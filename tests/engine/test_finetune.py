"""Fine-tuning: weights with another classifier shape load everything but the classifier, which is drawn fresh."""

from __future__ import annotations

import numpy as np
import pytest

from engine.checkpoint import CheckpointError, load_weights, save_checkpoint
from models import build_model


def test_fresh_classifier_for_another_class_count(tmp_path):
    source = build_model("resnet18", 1000, "cpu", seed=1, image_size=64, variant="imagenet")
    path = str(tmp_path / "imagenet.safetensors")
    save_checkpoint(path, source)
    net = build_model("resnet18", 3, "cpu", seed=2, image_size=64, variant="imagenet")
    drawn = {k: v.copy() for k, v in net.state_dict().items() if k.startswith("fc.")}
    with pytest.raises(CheckpointError, match=r"fc.weight: expected \(3, 512\), got \(1000, 512\)"):
        load_weights(path, net)  # strict by default (engine eval)
    checkpoint = load_weights(path, net, fresh_classifier=True)
    assert checkpoint.redrawn == ["fc.bias", "fc.weight"]
    state, saved = net.state_dict(), source.state_dict()
    for key, value in state.items():
        expected = drawn[key] if key.startswith("fc.") else saved[key]
        np.testing.assert_array_equal(value, expected, err_msg=key)
    # the same class count: nothing is redrawn, the classifier loads
    same = build_model("resnet18", 1000, "cpu", seed=3, image_size=64, variant="imagenet")
    assert load_weights(path, same, fresh_classifier=True).redrawn == []
    np.testing.assert_array_equal(same.state_dict()["fc.weight"], saved["fc.weight"])
    for n in (source, net, same):
        n.close()


def test_other_mismatches_still_refuse(tmp_path):
    cifar = build_model("resnet18", 1000, "cpu", image_size=32)  # 3×3 conv1
    path = str(tmp_path / "cifar.safetensors")
    save_checkpoint(path, cifar)
    net = build_model("resnet18", 3, "cpu", image_size=64, variant="imagenet")
    with pytest.raises(CheckpointError, match="conv1.weight"):
        load_weights(path, net, fresh_classifier=True)
    cifar.close()
    net.close()


def test_train_says_the_classifier_is_drawn_fresh(tmp_path):
    from click.testing import CliRunner

    from cli import main

    source = build_model("cnn", 7, "cpu", image_size=32)
    path = str(tmp_path / "seven.safetensors")
    save_checkpoint(path, source)
    source.close()
    result = CliRunner().invoke(main, ["train", "--model", "cnn", "--weights", path, "--steps", "1", "--no-progress"])
    assert result.exit_code == 0, result.output
    assert f"{path}: classifier fc.bias, fc.weight drawn fresh for 10 classes" in result.output

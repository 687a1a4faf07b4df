"""Which variant runs: by image size unless --variant says; the ImageNet shapes are torchvision's."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from cli import main
from models import build_model, resolve_variant


def test_default_variant_by_image_size():
    assert resolve_variant("resnet18", None, 32) == "cifar"
    assert resolve_variant("resnet18", None, 64) == "cifar"
    assert resolve_variant("mobilenetv2", None, 65) == "imagenet"
    assert resolve_variant("resnet18", "cifar", 224) == "cifar"
    assert resolve_variant("cnn", None, 224) is None
    with pytest.raises(ValueError, match="has no variants"):
        resolve_variant("cnn", "imagenet", 32)
    with pytest.raises(ValueError, match="unknown variant"):
        resolve_variant("resnet18", "tiny", 32)


@pytest.mark.parametrize("name,last_map", [("resnet18", (512, 7, 7)), ("mobilenetv2", (1280, 7, 7))])
def test_imagenet_shapes_at_224(name, last_map):
    net = build_model(name, 1000, "cpu", image_size=224)
    shapes = net.graph.shapes(1)
    pooled = [n for n in net.graph.nodes if type(n.layer).__name__ == "GlobalAvgPool"][0]
    assert shapes[pooled.inputs[0]][1:] == last_map  # torchvision's 7×7 final map
    if name == "resnet18":
        assert net.parameters.views["conv1.weight"].shape == (64, 3, 7, 7)
        maxpool = [n for n in net.graph.nodes if n.name.endswith("maxpool")][0]  # conv1+bn1+relu+maxpool: chunked
        assert shapes[maxpool.index] == (1, 64, 56, 56)
    assert net.num_parameters == {"resnet18": 11_689_512, "mobilenetv2": 3_504_872}[name]  # torchvision's counts
    net.close()


def test_memory_command_says_which_variant_and_what_fits():
    runner = CliRunner()
    result = runner.invoke(main, ["memory", "--model", "resnet18", "--image-size", "224", "--batch-size", "2",
                                  "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["variant"] == "imagenet"
    assert report["fit"]["needed_min_offload_bytes"] <= report["fit"]["needed_no_offload_bytes"]
    result = runner.invoke(main, ["memory", "--model", "resnet18", "--image-size", "224", "--batch-size", "2",
                                  "--variant", "cifar"])
    assert result.exit_code == 0, result.output
    # the smallest limit per plan
    assert "cifar variant at 224x224" in result.output and "--offload-n 1" in result.output

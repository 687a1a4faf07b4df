"""benchmarks/export_torchvision.py: torchvision's weights as safetensors that engine train --weights loads
(with the test extra's torch and torchvision, whose plain `import torchvision` fails)."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "export_torchvision.py"


@pytest.mark.parametrize("model", ["resnet18", "mobilenetv2"])
def test_the_export_loads_one_to_one_into_the_imagenet_variant(tmp_path, model, torchvision):
    out = tmp_path / f"{model}.safetensors"
    done = subprocess.run([sys.executable, str(SCRIPT), model, str(out), "--weights", "none", "--seed", "3"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"wrote {out}: ") and not list(tmp_path.glob("*.part"))
    from engine.backend import get_backend
    from engine.checkpoint import load_weights, read_checkpoint
    from models import build_model

    net = build_model(model, 1000, get_backend("cpu"), variant="imagenet", image_size=224)
    load_weights(str(out), net)  # strict: every tensor of the engine's network, and nothing else
    state = read_checkpoint(str(out)).model_state()
    name = "conv1.weight" if model == "resnet18" else "features.0.0.weight"
    np.testing.assert_array_equal(net.parameters.views[name], state[name])


def test_a_weights_name_torchvision_does_not_know_is_one_line(tmp_path, torchvision, capsys):
    # the script's main() in this process (torchvision's Python parts are imported already: the fixture); the
    # tests above run it as its own process, which a second torch import made 3 s here
    import importlib.util

    spec = importlib.util.spec_from_file_location("export_torchvision_main", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    code = script.main(["resnet18", str(tmp_path / "x.safetensors"), "--weights", "NO_SUCH_WEIGHTS"])
    out, err = capsys.readouterr()
    assert code == 1 and out == "" and err.startswith("error: resnet18: ") and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []

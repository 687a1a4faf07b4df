"""engine train / eval / memory through the command line (click's runner, in process)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import safetensors.numpy
from click.testing import CliRunner

from cli import main
from engine.threads import threads


def engine(*args):
    with threads(1):  # --threads would change the process for the tests after this one
        return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


SMALL = ["train", "--model", "cnn", "--data", "synthetic", "--num-classes", "4", "--batch-size", "16", "--no-progress"]


def test_train_writes_summary_checkpoint_memory_log_and_plot(tmp_path):
    result = engine(
        *SMALL, "--steps", 3, "--save", tmp_path / "c.safetensors", "--summary-json", tmp_path / "s.json",
        "--memory-log", tmp_path / "m.jsonl", "--memory-plot", tmp_path / "m.png", "--optimizer", "adam",
    )
    assert result.exit_code == 0, result.output
    assert "training summary" in result.output and "memory by phase" in result.output
    for name in ("m.jsonl", "m.png", "c.safetensors", "s.json"):  # every written file is named
        assert f"{tmp_path / name}" in result.output, name
    summary = json.loads((tmp_path / "s.json").read_text())
    for key in ("steps", "seconds", "images_per_second", "final_loss", "test_accuracy", "peak_rss_bytes"):
        assert summary[key] > 0, key
    assert summary["steps"] == 3 and summary["peak_bytes"]["PARAMETERS"] > 0
    assert summary["peak_rss_phase"] in ("setup", "training", "evaluation")
    assert summary["phases"][summary["peak_rss_phase"]]["peak_rss_bytes"] <= summary["peak_rss_bytes"]
    lines = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines if line["phase"] == "training"] == [0, 1, 2]
    assert all("rss_bytes" in line and line["rss_peak_bytes"] > 0 for line in lines)
    assert {line["phase"] for line in lines} == {"training", "evaluation"}
    assert (tmp_path / "m.png").read_bytes()[:4] == b"\x89PNG"
    tensors = safetensors.numpy.load_file(str(tmp_path / "c.safetensors"))
    assert "conv1.weight" in tensors and "optimizer.exp_avg" in tensors


def test_resume_from_the_command_line_equals_an_uninterrupted_run(tmp_path):
    common = [*SMALL, "--augment"]
    assert engine(*common, "--steps", 4, "--save", tmp_path / "straight.st").exit_code == 0
    assert engine(*common, "--steps", 2, "--save", tmp_path / "half.st").exit_code == 0
    resumed = engine(*common, "--steps", 4, "--resume", tmp_path / "half.st", "--save", tmp_path / "resumed.st")
    assert resumed.exit_code == 0, resumed.output
    straight = safetensors.numpy.load_file(str(tmp_path / "straight.st"))
    resumed = safetensors.numpy.load_file(str(tmp_path / "resumed.st"))
    assert sorted(straight) == sorted(resumed)
    for name in straight:
        np.testing.assert_array_equal(straight[name], resumed[name], err_msg=name)


def test_resume_with_other_options_is_refused(tmp_path):
    assert engine(*SMALL, "--steps", 1, "--save", tmp_path / "c.st").exit_code == 0
    result = engine(*SMALL, "--steps", 2, "--seed", 1, "--resume", tmp_path / "c.st")
    assert result.exit_code != 0 and "written by a different run: seed was 0, now 1" in result.output


def test_eval_prints_accuracy_and_confusion(tmp_path):
    assert engine(*SMALL, "--steps", 2, "--save", tmp_path / "c.st").exit_code == 0
    evaluate = ["eval", "--model", "cnn", "--data", "synthetic", "--num-classes", 4, "--weights", tmp_path / "c.st"]
    result = engine(*evaluate, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["examples"] == 128 and 0 <= report["accuracy"] <= 1 and report["top5_accuracy"] is None  # 4 classes
    assert np.array(report["confusion_matrix"]).sum() == 128
    table = engine(*evaluate)
    assert "confusion matrix" in table.output and "top-5" not in table.output


def test_memory_prints_the_layer_table_and_the_planned_peak():
    result = engine("memory", "--model", "resnet18", "--batch-size", 8)
    assert result.exit_code == 0, result.output
    for text in ("layer4.1.conv2", "kept for backward", "working memory", "planned peak"):
        assert text in result.output
    report = json.loads(engine("memory", "--model", "cnn", "--batch-size", 4, "--json").output)
    assert report["batch_size"] == 4 and report["planned_peak_bytes"] > report["parameter_bytes"] > 0


def test_memory_program_prints_the_step_program():
    result = engine("memory", "--model", "cnn", "--batch-size", 4, "--program")
    assert result.exit_code == 0, result.output
    # batch norm keeps 1/std and its output (In-Place ABN): the batch mean is working memory, not a buffer
    for text in ("creates", "retires after", "bn1:save_invstd FF_CACHE 16", "loss backward", "over relu2:grad@pool2",
                 "training program of cnn, batch 4: 22 steps, 25 buffers"):
        assert text in result.output, text


@pytest.mark.parametrize(
    "args,message",
    [
        (["--epochs", "1", "--steps", "2"], "give --epochs or --steps, not both"),
        (["--data", "cifar10:/nowhere"], "data directory '/nowhere' does not exist"),
        (["--data", "imagenet"], "unknown data set 'imagenet'"),
        (["--lr-schedule", "linear"], "unknown learning-rate schedule 'linear'"),
        (["--batch-size", "100000"], "--batch-size must be between 1 and the training split's size (512)"),
        (["--weights", "/nowhere.st"], "/nowhere.st: file not found"),
        (["--resume", "/nowhere.st"], "/nowhere.st: file not found"),
    ],
)
def test_bad_options_give_one_line_errors(args, message):
    base = [a for a in SMALL if a not in ("--batch-size", "16")]
    result = engine(*base, *args)
    assert result.exit_code != 0
    assert message in result.output and "Traceback" not in result.output


def test_a_corrupt_checkpoint_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.st"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    result = engine(*SMALL, "--steps", 1, "--resume", bad)
    assert result.exit_code != 0 and "bad.st: not a readable safetensors file" in result.output


def test_backend_cudasim_is_selected_before_anything_imports_numba():
    """A fresh process: importing cli imports no numba, and `train --backend cudasim` gets the simulator
    (an error would say numba was imported without NUMBA_ENABLE_CUDASIM). The run itself stops at the data
    set, after the backend is chosen; the cudasim training path is tested in tests/engine/test_train_cudasim.py."""
    code = (
        "import sys\n"
        "from cli import main\n"
        "assert 'numba' not in sys.modules\n"
        "from click.testing import CliRunner\n"
        "r = CliRunner().invoke(main, ['train', '--model', 'cnn', '--backend', 'cudasim', '--data', 'nothing'])\n"
        "print(r.output)\n"
        "from numba import config\n"
        "print('SIM', config.ENABLE_CUDASIM)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "unknown data set 'nothing'" in result.stdout and "SIM 1" in result.stdout


def test_a_bad_option_fails_before_the_warm_up_workers_start(monkeypatch):
    """The early warm-up workers (two interpreters importing Numba) start only after the checks of the
    options alone: a mistyped command fails at once instead of spawning them and waiting for them at exit."""
    from engine import warmup

    started = []
    monkeypatch.setattr(warmup, "start_workers", lambda label: started.append(label))
    result = CliRunner().invoke(main, ["train", "--model", "cnn", "--checkpoint-every", "1"])
    assert result.exit_code != 0 and "give --save FILE too" in result.output
    assert started == []

"""The newcomer's friction list (issue 33, item 5): what engine train and engine eval print."""

import json

import pytest
from click.testing import CliRunner

from cli import main
from engine.evaluate import Scorer
from engine.summary import evaluation_tables, plural, time_split
from engine.train import LineProgressListener, TrainResult
from tests.test_cli_train import SMALL, engine


def test_progress_is_plain_lines_on_stderr_when_not_on_a_terminal():
    result = CliRunner().invoke(main, [*SMALL[:-1], "--steps", "3", "--progress-interval", "0"])
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stderr.splitlines() if line.startswith("step ")]
    assert [line.split("  ")[0] for line in lines] == ["step 1/3", "step 2/3", "step 3/3"]
    assert "n/a img/s  ETA n/a" in lines[0]  # the first step compiles: no rate from it
    assert " img/s  ETA 0:0" in lines[-1] and "loss " in lines[-1] and "epoch 1/1" in lines[-1]
    assert "step 1/3" not in result.stdout  # stdout keeps the results only


def test_progress_lines_come_every_interval_and_at_the_end():
    class Clock:
        now = 0.0

        def __call__(self):
            return self.now

    class Stub:  # what the listener reads of a trainer
        total_steps, epochs_total = 5, 1

        class source:
            batches_per_epoch = 5

        class score:
            recent_loss, running_accuracy = 0.5, 0.75

    import io

    from engine.train import StepRecord

    out, clock = io.StringIO(), Clock()
    listener = LineProgressListener(out, interval_s=10, clock=clock)
    listener.on_train_start(Stub)
    for step, at in enumerate([1.0, 4.0, 12.0, 15.0, 16.0]):
        clock.now = at
        listener.on_step_end(Stub, StepRecord(step, 0, step, 0.5, 3, 4, 0.01, 2.0))
    assert [line.split("  ")[0] for line in out.getvalue().splitlines()] == ["step 1/5", "step 3/5", "step 5/5"]
    assert "step 3/5  epoch 1/1  loss 0.5000  acc 75.0%  2.0 img/s  ETA 0:04" in out.getvalue()


def test_the_time_is_split_into_compile_training_and_evaluation():
    result = TrainResult(steps=4, final_step=4, epochs=0.1, batch_size=8, seconds=2.0, images_per_second=1.0,
                         steady_images_per_second=1.0, final_loss=1.0, train_accuracy=0.5, test_accuracy=0.5,
                         test_top5_accuracy=None, test_loss=1.0, peak_rss_bytes=1, first_step_seconds=0.5,
                         evaluation_seconds=0.25, compile_seconds=6.0)
    assert time_split(result) == ("8.2 s: compiling kernels 6.0 s (first run only), training 4 steps 2.0 s "
                                  "(the first 0.5 s), evaluation 0.2 s")
    result.compile_seconds, result.steps = None, 1
    assert time_split(result) == "2.2 s: training 1 step 2.0 s, evaluation 0.2 s"


def test_one_step_reads_one_step_and_few_classes_have_no_top5(tmp_path):
    result = engine(*SMALL, "--steps", 1, "--summary-json", tmp_path / "s.json")
    assert result.exit_code == 0, result.output
    assert "1 steps" not in result.output and "mean of the last 1 step)" in result.output
    assert "top-5" not in result.output  # 4 classes: every label is in the top 5
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["test_top5_accuracy"] is None and summary["evaluation_seconds"] is not None
    assert plural(1, "step") == "1 step" and plural(2, "step") == "2 steps" and plural(0, "step") == "0 steps"


def test_top5_is_scored_above_five_classes_only():
    import numpy as np

    logits, labels = np.eye(6, dtype=np.float32)[:4], np.arange(4)
    six = Scorer(6, 4)
    six.add(logits, labels, 4)
    five = Scorer(5, 4)
    five.add(logits[:, :5], labels, 4)
    assert six.result().top5_accuracy == 1.0 and five.result().top5_accuracy is None
    scores, matrix = evaluation_tables(five.result(), ["cat", "dog", "emu", "fox", "gnu"])
    assert "top-5 accuracy" not in [row[0] for row in scores.rows]
    assert [row[0] for row in matrix.rows] == ["0 cat", "1 dog", "2 emu", "3 fox", "4 gnu"]


def test_eval_names_an_image_folders_classes(tmp_path):
    from tests.engine.test_imagefolder import build_folder

    build_folder(tmp_path / "images")
    data = ["--model", "cnn", "--data", f"imagefolder:{tmp_path / 'images'}", "--image-size", "16"]
    assert engine("train", *data, "--batch-size", 4, "--steps", 1, "--no-progress",
                  "--save", tmp_path / "w.st").exit_code == 0
    result = engine("eval", *data, "--weights", tmp_path / "w.st")
    assert result.exit_code == 0, result.output
    assert all(f"{i} {name}" in result.output for i, name in enumerate(("cat", "dog", "emu")))
    report = json.loads(engine("eval", *data, "--weights", tmp_path / "w.st", "--json").output)
    assert report["class_names"] == ["cat", "dog", "emu"] and report["top5_accuracy"] is None


def test_memory_takes_offload_n_auto_refuses_four_with_exit_2_and_names_the_model():
    auto = engine("memory", "--model", "cnn", "--batch-size", 4, "--offload-n", "auto")
    assert auto.exit_code == 0, auto.output
    assert auto.output.startswith("memory per layer of cnn, batch size 4")
    assert "offload auto: planned at N=1, where engine train's auto starts" in auto.output
    four = engine("memory", "--model", "cnn", "--offload-n", "four")
    assert four.exit_code == 2 and "--offload-n must be a positive integer or 'auto', got 'four'" in four.output
    assert "memory per layer of resnet18 (cifar variant), batch size 2" in engine(
        "memory", "--model", "resnet18", "--batch-size", 2).output


def test_auto_with_room_for_everything_allocates_no_full_swap_file(tmp_path):
    result = engine(*SMALL, "--steps", 2, "--offload-n", "auto", "--offload-dir", tmp_path)
    assert result.exit_code == 0, result.output
    line = next(line for line in result.output.splitlines() if line.startswith("offload: "))
    assert " 0 of " in line and "swap file 4.0 KiB" in line, line  # one page: nothing is written
    assert "the largest that fits --offload-budget" not in result.output


def test_the_resident_peak_is_shown_within_the_planned_arena_and_no_false_lower_bound(tmp_path):
    result = engine(*SMALL, "--steps", 3, "--offload-n", 1, "--offload-dir", tmp_path,
                    "--summary-json", tmp_path / "s.json")
    assert result.exit_code == 0, result.output
    offload = json.loads((tmp_path / "s.json").read_text())["offload"]
    assert 0 < offload["resident_peak_bytes"] <= offload["bound_bytes"]  # the arena is a ceiling
    assert "lower bound" not in result.output and "planned arena" in result.output  # the first line: the units'
    assert offload["shared_region"] and "planned region it shares with the step's own tensors" in result.output
    line = next(line for line in result.output.splitlines() if line.startswith("offload: "))
    assert "saved-for-backward arena" in line and "swap file 4.0 KiB" not in line  # N=1 writes: a real file


def test_a_budget_alone_says_it_took_n4_when_a_larger_window_fits():
    from engine.summary import offload_table

    offload = {"requested": "budget", "window": 4, "max_window": 9, "window_history": [], "steps": 3,
               "steps_averaged": 2, "stall_ms_per_step": 0.0, "io_cpu_ms_per_step": 0.0, "written_bytes_per_step": 0,
               "read_bytes_per_step": 0, "resident_peak_bytes": 1, "bound_bytes": 2, "no_offload_bytes": 2,
               "page_cache_bytes": 0}
    rows = dict(offload_table(offload).rows)
    assert rows["window N"] == "4 (--offload-budget alone takes N=4; up to N=9 fits)"
    offload["max_window"] = 4
    assert dict(offload_table(offload).rows)["window N"] == "4 (the largest that fits --offload-budget)"


def test_the_stop_hint_works_on_a_command_that_had_weights(tmp_path):
    """After a stop the hint says "continue with --resume FILE": added to the original command, which had
    --weights, it resumes (the checkpoint wins, a note says so) and ends where an unstopped run ends."""
    start, whole, part = tmp_path / "start.st", tmp_path / "whole.st", tmp_path / "part.st"
    assert engine(*SMALL, "--steps", 1, "--save", start).exit_code == 0
    assert engine(*SMALL, "--weights", start, "--steps", 3, "--save", whole).exit_code == 0
    assert engine(*SMALL, "--weights", start, "--steps", 2, "--save", part).exit_code == 0  # stands for a stop
    resumed = engine(*SMALL, "--weights", start, "--steps", 3, "--save", part, "--resume", part)
    assert resumed.exit_code == 0, resumed.output
    assert f"note: --resume {part} continues from its checkpoint; --weights {start}" in resumed.output
    from engine.checkpoint import read_checkpoint

    a, b = read_checkpoint(str(whole)), read_checkpoint(str(part))
    assert a.step == b.step == 3 and all((a.tensors[k] == b.tensors[k]).all() for k in a.tensors)


@pytest.mark.parametrize("offload", [[], ["--offload-n", "1"]], ids=["no offload", "offload"])
def test_memory_log_in_use_never_exceeds_what_is_reserved_for_it(tmp_path, offload):
    """A type's bytes live in its own workspaces and blocks or in the planned arena its types share; the log
    used to split the arena by the plan's bytes per type, and a type's peak exceeded its share."""
    log = tmp_path / "memory.jsonl"
    result = engine(*SMALL, "--steps", 2, "--memory-log", log, *offload, "--offload-dir", tmp_path)
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert all("SHARED_ARENA" in r["reserved_bytes"] and "ACTIVATION_GRAD" not in r["reserved_bytes"] for r in lines)
    for r in lines:
        reserved, shared = r["reserved_bytes"], r["reserved_bytes"]["SHARED_ARENA"]
        for name, nbytes in r["in_use_bytes"].items():
            assert nbytes <= reserved.get(name, 0) + shared, (r["phase"], r["step"], name, nbytes, reserved)


def test_an_offload_ratio_below_one_is_called_noise():
    from engine.bench.offload import ratio_text

    assert ratio_text(1.046) == "1.046x"
    assert ratio_text(0.873).startswith("0.873x: below 1 is noise between the two runs")


def test_without_numba_cuda_the_cuda_backends_name_the_extra(monkeypatch):
    import importlib.util

    from engine import backend

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "numba_cuda" else real(name, *a))
    assert "pip install -e '.[cudasim]'" in backend.cudasim_unavailable_reason()
    with pytest.raises(backend.BackendUnavailable, match=r"numba-cuda is not installed"):
        backend.get_backend("cudasim")

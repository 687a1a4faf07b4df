"""Signals, disk faults and bad options through the real command line, each in its own process.

Every case asserts the same four things: the exit code, exactly one ``Error:`` line on stderr, no
traceback, and nothing left behind (no swap directory, no temporary checkpoint, no probe file); where
a previous checkpoint exists, that it is untouched or replaced by a good one. Disk faults come from
``tests.faults`` (a stand-in for ``os`` inside the swap storage); signals are real signals.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from engine.checkpoint import CheckpointError, read_checkpoint, save_checkpoint
from engine.signals import StopSignals

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ["train", "--model", "mlp", "--data", "synthetic", "--batch-size", "8", "--no-progress"]


def _default_stop_signals() -> None:
    """A shell without job control starts background jobs with SIGINT and SIGQUIT ignored, and the child
    would inherit that (and rightly keep ignoring them): give every test child the default dispositions."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(signum, signal.SIG_DFL)


def engine(args, fault: str | None = None, stop_at: int | None = None, **popen) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("ENGINE_FAULT", None)
    env.pop("ENGINE_STOP_AT_STEP", None)
    if fault:
        env["ENGINE_FAULT"] = fault
    if stop_at:
        env["ENGINE_STOP_AT_STEP"] = str(stop_at)
    popen.setdefault("preexec_fn", _default_stop_signals)
    popen.setdefault("stdout", subprocess.PIPE)
    popen.setdefault("stderr", subprocess.PIPE)
    return subprocess.Popen([sys.executable, "-m", "tests.faults", *map(str, args)], cwd=ROOT, env=env, text=True,
                            **popen)


def finish(process: subprocess.Popen, timeout: float = 120) -> tuple[int, str, str]:
    """The run's exit code and output; a run still going after ``timeout`` is killed (no orphan keeps
    training after the test failed) and the test fails."""
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        raise AssertionError(f"the run did not end within {timeout} s") from None
    return process.returncode, out, err


def one_error_line(code: int, out: str, err: str, expected_code: int, pattern: str) -> str:
    assert "Traceback" not in out + err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert code == expected_code, (code, err)
    assert lines[0].startswith("Error: ") and re.search(pattern, lines[0]), lines[0]
    return lines[0]


def leftovers(*directories: Path) -> list[str]:
    found = []
    for directory in directories:
        for entry in os.listdir(directory):
            if entry.startswith(("engine-offload-", ".checkpoint-", ".engine-probe-")):
                found.append(str(directory / entry))
    return found


def wait_for_steps(log: Path, process: subprocess.Popen, steps: int, timeout: float = 90) -> None:
    """Until the memory log (one line per step) has ``steps`` lines: the run is inside its loop."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"the run ended early: {process.communicate()}")
        if log.exists() and log.read_text().count("\n") >= steps:
            return
        time.sleep(0.05)
    process.kill()
    raise AssertionError("the run did not reach its training loop in time")


# -- signals ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT],
                         ids=lambda s: signal.Signals(s).name)
def test_a_stop_signal_mid_run_saves_the_last_step_cleans_up_and_exits_128_plus_n(tmp_path, signum):
    save, log = tmp_path / "run.safetensors", tmp_path / "memory.jsonl"
    process = engine([*TRAIN, "--steps", 100000, "--offload-n", 1, "--offload-dir", tmp_path, "--save", save,
                      "--memory-log", log])
    wait_for_steps(log, process, 3)
    process.send_signal(signum)
    line = one_error_line(*finish(process), 128 + signum, rf"stopped by {signal.Signals(signum).name} after step")
    step = int(re.search(r"checkpoint of step (\d+) was written", line).group(1))
    assert step >= 3
    checkpoint = read_checkpoint(str(save))
    assert checkpoint.is_training_checkpoint and checkpoint.step == step
    assert leftovers(tmp_path) == []
    if signum == signal.SIGTERM:  # resumable: two more steps from it, through the command line
        code, out, err = finish(engine([*TRAIN, "--steps", step + 2, "--resume", save, "--save", save]))
        assert code == 0, err
        assert read_checkpoint(str(save)).step == step + 2


def tiny_network():
    from engine.backend import get_backend
    from engine.optim import make_optimizer
    from models import build_model

    backend = get_backend("cpu")
    net = build_model("mlp", num_classes=4, backend=backend, input_shape=(1, 4, 4), hidden=8, depth=1)
    return net, make_optimizer("sgd", net, backend, 0.01, momentum=0.9, manager=net.mgr)


def _ignore_stop_signals() -> None:  # as a shell does for `cmd &` in a script, and nohup for SIGHUP
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)


def test_ignored_signals_stay_ignored(tmp_path):
    save, log = tmp_path / "run.safetensors", tmp_path / "memory.jsonl"
    process = engine([*TRAIN, "--steps", 60, "--offload-n", 1, "--offload-dir", tmp_path, "--save", save,
                      "--memory-log", log], preexec_fn=_ignore_stop_signals)
    wait_for_steps(log, process, 3)
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        process.send_signal(signum)
    code, out, err = finish(process)
    assert code == 0 and "Traceback" not in err, err
    assert read_checkpoint(str(save)).step == 60  # the run went on to the end
    assert leftovers(tmp_path) == []


def test_a_signal_during_a_checkpoint_write_neither_breaks_it_nor_leaves_a_temporary_file(tmp_path, monkeypatch):
    import safetensors.numpy

    net, opt = tiny_network()
    real_save = safetensors.numpy.save_file

    def save_then_signal(tensors, filename, metadata=None):
        real_save(tensors, filename, metadata=metadata)  # the temporary file is complete and not yet renamed
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(safetensors.numpy, "save_file", save_then_signal)
    with StopSignals() as stop:
        save_checkpoint(str(tmp_path / "c.safetensors"), net, opt, step=3)
        assert stop.received == signal.SIGTERM
    assert read_checkpoint(str(tmp_path / "c.safetensors")).step == 3
    assert leftovers(tmp_path) == []


def test_nan_weights_never_replace_a_good_checkpoint(tmp_path):
    net, opt = tiny_network()
    path = tmp_path / "good.safetensors"
    save_checkpoint(str(path), net, opt, step=1)
    before = path.read_bytes()
    state = net.state_dict()
    name = next(iter(state))
    net.load_state_dict({**state, name: np.full_like(state[name], np.nan)}, strict=True)
    with pytest.raises(CheckpointError, match="NaN or infinite"):
        save_checkpoint(str(path), net, opt, step=2)
    assert path.read_bytes() == before and leftovers(tmp_path) == []


def test_a_diverging_loss_stops_with_the_last_finite_weights_saved(tmp_path):
    save = tmp_path / "run.safetensors"
    line = one_error_line(*finish(engine([*TRAIN, "--steps", 20, "--lr", "1e6", "--save", save])), 1,
                          r"the loss became nan at step \d+ .*checkpoint of step \d+ was written")
    checkpoint = read_checkpoint(str(save))  # finite weights: NaN ones would have been refused
    assert str(checkpoint.step) in line and leftovers(tmp_path) == []


# -- disk faults in the offload path ---------------------------------------------------------------


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory) -> Path:
    """A checkpoint of 4 steps without offload: the previous checkpoint, and the reference weights."""
    path = tmp_path_factory.mktemp("plain") / "plain.safetensors"
    code, _, err = finish(engine([*TRAIN, "--steps", 4, "--save", path]))
    assert code == 0, err
    return path


@pytest.mark.parametrize(("fault", "pattern"), [
    ("write:3:ENOSPC", r"no space left writing the swap file"),
    ("write:3:EIO", r"disk failed during a step \(Input/output error\)"),
    ("read:2:corrupt", r"checksum mismatch reading layer"),
    ("write:2:zero", r"write returned 0"),
])
def test_a_disk_fault_during_a_step_is_one_line_and_the_previous_checkpoint_is_untouched(
    tmp_path, plain_run, fault, pattern
):
    save = tmp_path / "run.safetensors"
    save.write_bytes(plain_run.read_bytes())
    before = save.read_bytes()
    line = one_error_line(*finish(engine([*TRAIN, "--steps", 8, "--resume", save, "--save", save, "--offload-n", 1,
                                          "--offload-dir", tmp_path], fault=fault)), 1, pattern)
    assert "is on the failing disk" in line  # same file system as the swap directory: not written
    assert save.read_bytes() == before
    assert leftovers(tmp_path) == []


def test_a_short_write_is_completed_and_changes_nothing(tmp_path, plain_run):
    faulty = tmp_path / "faulty.safetensors"
    code, _, err = finish(engine([*TRAIN, "--steps", 4, "--save", faulty, "--offload-n", 1,
                                  "--offload-dir", tmp_path], fault="write:2:short"))
    assert code == 0, err
    a, b = read_checkpoint(str(plain_run)), read_checkpoint(str(faulty))  # offload on or off: the same bits
    assert all(np.array_equal(a.tensors[k], b.tensors[k]) for k in a.tensors)
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("update", ["after backward", "in backward"])
def test_a_disk_fault_saves_the_last_step_when_the_checkpoint_is_on_another_disk(tmp_path, update):
    """Reads come back in backward: with the update in backward (the default), some layers are then updated
    and the weights are no step's, so nothing is written and the line says which option keeps them whole."""
    swap = Path("/dev/shm")
    if not swap.is_dir() or os.stat(swap).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs a second file system for the swap directory")
    save = tmp_path / "run.safetensors"
    before = set(os.listdir(swap))
    option = ["--update-after-backward"] if update == "after backward" else []
    written = r"disk failed .*checkpoint of step \d+ was written"
    not_written = r"disk failed .*not written \(the fault came inside backward.*--update-after-backward"
    line = one_error_line(*finish(engine([*TRAIN, "--steps", 6, "--save", save, "--offload-n", 1, *option,
                                          "--offload-dir", swap], fault="read:4:EIO")), 1,
                          written if option else not_written)
    if option:
        assert read_checkpoint(str(save)).step == int(re.search(r"step (\d+) was written", line).group(1))
    else:
        assert not save.exists()
    assert {e for e in os.listdir(swap) if e.startswith("engine-offload-")} <= before


# -- outputs checked before the first step ---------------------------------------------------------


@pytest.mark.parametrize("option", ["--save", "--summary-json", "--memory-log", "--memory-plot"])
def test_an_unwritable_output_path_fails_before_the_first_step(tmp_path, option):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    # a witness that any step would leave behind (not a clock: a loaded machine makes any time limit lie)
    witness = (["--memory-log", tmp_path / "steps.jsonl"] if option != "--memory-log"
               else ["--save", tmp_path / "step.safetensors", "--checkpoint-every", 1])
    one_error_line(*finish(engine([*TRAIN, "--steps", 2, *witness, option, blocker / "out"])), 1,
                   rf"{option} .*is a file, not a directory")
    assert sorted(os.listdir(tmp_path)) == ["a-file"]  # no step ran: the witness was never written


def test_checkpoint_every_keeps_a_rolling_checkpoint(tmp_path):
    save, log = tmp_path / "run.safetensors", tmp_path / "memory.jsonl"
    process = engine([*TRAIN, "--steps", 100000, "--save", save, "--checkpoint-every", 5, "--memory-log", log])
    wait_for_steps(log, process, 12)
    first = read_checkpoint(str(save)).step  # written during the run, before any signal
    assert first >= 10 and first % 5 == 0
    process.kill()  # SIGKILL: nothing runs, the rolling checkpoint is what is left
    process.communicate()
    assert read_checkpoint(str(save)).step % 5 == 0  # (SIGKILL mid-write may leave a temporary file: by design)


# -- resume: bit for bit through the command line, and nothing changed silently -------------------


@pytest.mark.parametrize("schedule", ["cosine", "step:3:0.5"])
def test_a_run_stopped_by_a_signal_resumes_bit_for_bit_with_its_schedule(tmp_path, schedule):
    run = [*TRAIN, "--steps", 8, "--lr-schedule", schedule, "--optimizer", "adam", "--augment"]
    whole, parts = tmp_path / "whole.safetensors", tmp_path / "parts.safetensors"
    code, _, err = finish(engine([*run, "--save", whole]))
    assert code == 0, err
    one_error_line(*finish(engine([*run, "--save", parts], stop_at=5)), 128 + signal.SIGTERM,
                   r"stopped by SIGTERM after step 5 of 8; .*checkpoint of step 5")
    code, _, err = finish(engine([*run, "--resume", parts, "--save", parts]))
    assert code == 0, err
    a, b = read_checkpoint(str(whole)), read_checkpoint(str(parts))
    assert a.step == b.step == 8 and sorted(a.tensors) == sorted(b.tensors)
    for name in a.tensors:
        np.testing.assert_array_equal(a.tensors[name], b.tensors[name], err_msg=name)


# -- options: numbers checked before anything starts (in process, fast) ----------------------------

OPTION_CASES = [
    (["--lr", "nan"], 2, "--lr must be a finite number, got nan"),
    (["--lr", "inf"], 2, "--lr must be a finite number"),
    (["--lr", "0"], 2, "--lr must be greater than 0"),
    (["--lr-schedule", "step:1:nan"], 1, "GAMMA must be a finite number, got nan"),
    (["--lr-schedule", "step:1:0"], 1, "GAMMA must be greater than 0"),
    (["--offload-budget", "inf"], 1, "cannot read 'inf' as a size"),
    (["--offload-budget", "nan"], 1, "cannot read 'nan' as a size"),
    (["--num-classes", "1000000000"], 2, "--num-classes must be at least 2 and at most 100,000"),
    (["--batch-size", "0"], 2, "--batch-size must be at least 1"),
    (["--momentum", "1"], 2, "--momentum must be at least 0 and less than 1"),
    (["--seed", "-1"], 2, "--seed must be at least 0"),
    (["--offload-n", "1", "--workspace-mode", "none"], 1, "need --workspace-mode enabled"),
    (["--checkpoint-every", "5"], 1, "--checkpoint-every writes the --save file"),
    (["--summary-json", "/dev/full"], 1, "--summary-json /dev/full: cannot write"),  # trained, saved, then fails
    (["--memory-plot", "plot.xyz"], 1, "give a .png, .pdf or .svg"),
]


@pytest.mark.parametrize(("args", "code", "message"), OPTION_CASES, ids=[" ".join(c[0]) for c in OPTION_CASES])
def test_bad_train_options_are_one_line_and_leave_the_previous_checkpoint_alone(tmp_path, args, code, message):
    from tests.test_cli_train import engine as run_in_process

    save = tmp_path / "good.safetensors"
    net, opt = tiny_network()
    save_checkpoint(str(save), net, opt, step=1)
    before = save.read_bytes()
    with_save = [] if "--checkpoint-every" in args else ["--save", save]
    result = run_in_process(*TRAIN, "--steps", 2, *with_save, *args)
    assert result.exit_code == code, result.output
    assert message in result.output and "Traceback" not in result.output
    if "/dev/full" in args:  # a full disk at the very end: the weights were saved before the summary failed
        assert read_checkpoint(str(save)).step == 2
    else:
        assert save.read_bytes() == before
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize(("args", "message"), [
    (["eval", "--model", "mlp", "--weights", "w.st", "--batch-size", "0"], "--batch-size must be at least 1"),
    (["memory", "--model", "mlp", "--image-size", "0"], "--image-size must be at least 1"),
    (["memory", "--model", "mlp", "--num-classes", "1"], "--num-classes must be at least 2"),
])
def test_bad_eval_and_memory_options_are_one_line(args, message):
    from tests.test_cli_train import engine as run_in_process

    result = run_in_process(*args)
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output

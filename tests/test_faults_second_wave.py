"""The second wave of faults through the real command line (issue 31), each the way it happens to a
user: a real pty whose master is closed, a real pipe closed early, a real full device under stderr, a
real tmpfs that fills under an output file, images deleted under a running job, two runs on one --save.

Each asserts what the first wave's tests assert (tests/test_faults.py): the exit code, the one line,
no traceback, nothing left behind, and the last good step saved where --save was given.
"""

from __future__ import annotations

import os
import pty
import re
import signal
import sys
import time

import numpy as np
import pytest
from PIL import Image

from engine.checkpoint import read_checkpoint
from tests.test_faults import (
    ROOT,
    TRAIN,
    _default_stop_signals,
    engine,
    finish,
    leftovers,
    one_error_line,
    wait_for_steps,
)


def _exit_code(status: int) -> int:
    return os.waitstatus_to_exitcode(status)


@pytest.mark.parametrize("hup", ["default", "ignored"])
def test_a_terminal_that_goes_away_stops_as_sighup_and_keeps_the_weights(tmp_path, hup):
    """The run's terminal is a real pty; closing its master hangs it up: SIGHUP, then EIO on every write.
    Before: exit 120 or 1, "disk I/O failed", no checkpoint. With SIGHUP ignored (nohup's way), the
    progress bar goes quiet (rich sees no terminal any more) and the run trains to its end; the summary's
    first write then meets the EIO: exit 129 all the same, everything written."""
    save, log = tmp_path / "run.safetensors", tmp_path / "memory.jsonl"
    steps = "100000" if hup == "default" else "12"
    args = [sys.executable, "-m", "tests.faults", *TRAIN[:-1], "--steps", steps, "--offload-n", "1",
            "--offload-dir", str(tmp_path), "--save", str(save), "--memory-log", str(log)]  # with the progress bar
    env = dict(os.environ, PYTHONPATH=str(ROOT), TERM="xterm", COLUMNS="100")
    pid, master = pty.fork()
    if pid == 0:  # the child: session leader, the pty its controlling terminal
        try:
            _default_stop_signals()
            if hup == "ignored":
                signal.signal(signal.SIGHUP, signal.SIG_IGN)
            os.chdir(ROOT)
            os.execve(sys.executable, args, env)
        finally:
            os._exit(127)
    try:
        deadline = time.monotonic() + 120
        while not (log.exists() and log.read_text().count("\n") >= 3):
            assert time.monotonic() < deadline, "the run did not reach its loop"
            try:
                os.read(master, 65536)  # keep the terminal drained, as a terminal does
            except OSError:
                break
            time.sleep(0.02)
    finally:
        os.close(master)  # the terminal goes away
    deadline = time.monotonic() + 120
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            raise AssertionError("the run went on after its terminal was gone")
        time.sleep(0.05)
    assert _exit_code(status) == 128 + signal.SIGHUP
    assert read_checkpoint(str(save)).step >= 3 if hup == "default" else read_checkpoint(str(save)).step == 12
    assert leftovers(tmp_path) == [] and not any(e.endswith(".lock") for e in os.listdir(tmp_path))


def test_a_pipe_closed_by_its_reader_stops_as_sigpipe_with_everything_written(tmp_path):
    """`engine train ... | head -1`: the reader exits after the first line. Before: exit 1, no --save."""
    save, summary = tmp_path / "run.safetensors", tmp_path / "summary.json"
    process = engine([*TRAIN, "--steps", 40, "--save", save, "--summary-json", summary])
    first = process.stdout.readline()
    assert first.startswith("mlp on synthetic")
    process.stdout.close()  # head -1 exits
    err = process.stderr.read()
    code = process.wait(timeout=120)
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and len(lines) == 1, err
    assert code == 128 + signal.SIGPIPE, err
    assert re.search(r"stopped by SIGPIPE at the end of the run \(the output pipe was closed", lines[0])
    assert read_checkpoint(str(save)).step == 40 and summary.exists()  # nothing the run wrote was lost
    assert leftovers(tmp_path) == []


def test_a_full_disk_under_stderr_keeps_a_signals_exit_code(tmp_path):
    """stderr on a full device: the Error line cannot be printed, the exit code must still be 143."""
    save, log = tmp_path / "run.safetensors", tmp_path / "memory.jsonl"
    with open("/dev/full", "w") as full:
        process = engine([*TRAIN, "--steps", 100000, "--save", save, "--memory-log", log], stderr=full)
        wait_for_steps(log, process, 3)
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=120)
    assert code == 128 + signal.SIGTERM
    assert read_checkpoint(str(save)).step >= 3 and leftovers(tmp_path) == []


def test_a_memory_log_whose_disk_fills_names_it_and_saves_the_last_step(tmp_path, small_tmpfs):
    """Before: blamed on the swap disk ("disk I/O failed"), the writable --save skipped."""
    save = tmp_path / "run.safetensors"
    (small_tmpfs / "filler").write_bytes(b"\0" * (200 << 10))  # a few steps' lines of room left
    line = one_error_line(*finish(engine([*TRAIN, "--steps", 100000, "--offload-n", 1, "--offload-dir", tmp_path,
                                          "--save", save, "--memory-log", small_tmpfs / "memory.jsonl"])), 1,
                          r"memory log .*memory.jsonl: cannot write \(No space left on device\).*"
                          r"checkpoint of step (\d+) was written")
    assert read_checkpoint(str(save)).step == int(re.search(r"checkpoint of step (\d+)", line).group(1)) > 0
    assert leftovers(tmp_path) == []


def test_a_memory_plot_on_a_full_disk_leaves_no_file_and_the_other_outputs_are_written(tmp_path, small_tmpfs):
    save, summary = tmp_path / "run.safetensors", tmp_path / "summary.json"
    plot = small_tmpfs / "memory.png"
    (small_tmpfs / "filler").write_bytes(b"\0" * (250 << 10))
    one_error_line(*finish(engine([*TRAIN, "--steps", 3, "--save", save, "--summary-json", summary,
                                   "--memory-plot", plot])), 1,
                   r"memory plot .*memory.png: cannot write .*checkpoint .*run.safetensors was written")
    assert sorted(os.listdir(small_tmpfs)) == ["filler"]  # no empty PNG, no temporary file
    assert read_checkpoint(str(save)).step == 3 and summary.exists()


def test_images_deleted_under_a_running_job_save_the_last_completed_step(tmp_path):
    folder = tmp_path / "images"
    rng = np.random.default_rng(0)
    for c in ("a", "b"):
        (folder / c).mkdir(parents=True)
        for k in range(8):
            Image.fromarray(rng.integers(0, 256, (12, 12, 3), dtype=np.uint8)).save(folder / c / f"{k}.png")
    save, log = tmp_path / "run.safetensors", tmp_path / "memory.jsonl"
    process = engine(["train", "--model", "mlp", "--data", f"imagefolder:{folder}", "--image-size", 8,
                      "--batch-size", 2, "--no-progress", "--steps", 100000, "--save", save, "--memory-log", log])
    wait_for_steps(log, process, 3)
    for c in ("a", "b"):
        for image in (folder / c).iterdir():
            image.unlink()
    line = one_error_line(*finish(process), 1, r"the image file is gone .*\(at step (\d+) of 100000\).*"
                                               r"checkpoint of step \d+ was written")
    assert read_checkpoint(str(save)).step == int(re.search(r"checkpoint of step (\d+)", line).group(1)) >= 3


def test_resuming_at_another_image_size_is_refused(tmp_path):
    save = tmp_path / "run.safetensors"
    run = ["train", "--model", "cnn", "--data", "synthetic", "--batch-size", 4, "--no-progress", "--threads", 1]
    code, _, err = finish(engine([*run, "--image-size", 16, "--steps", 1, "--save", save]))
    assert code == 0, err
    one_error_line(*finish(engine([*run, "--image-size", 24, "--steps", 2, "--resume", save])), 1,
                   r"image_size was 16, now 24; .*--override image_size")


def test_a_second_run_on_the_same_save_path_is_refused_before_it_starts(tmp_path):
    save, log = tmp_path / "run.safetensors", tmp_path / "memory.jsonl"
    first = engine([*TRAIN, "--steps", 100000, "--save", save, "--memory-log", log])
    try:
        wait_for_steps(log, first, 2)
        one_error_line(*finish(engine([*TRAIN, "--steps", 5, "--save", save])), 1,
                       rf"--save .*run.safetensors: another engine train \(pid {first.pid}\) is writing")
    finally:
        first.send_signal(signal.SIGTERM)
    code, _, err = finish(first)
    assert code == 128 + signal.SIGTERM, err
    assert sorted(os.listdir(tmp_path)) == ["memory.jsonl", "run.safetensors"]  # the claim is gone with its run

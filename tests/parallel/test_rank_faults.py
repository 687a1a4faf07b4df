"""``engine train --workers 2`` when a rank dies or the launcher is told to stop (issue 31, class 7).

Expected as in one process: every rank stops, one line names what happened, nothing is left behind
(swap directories, the launch directory), the last good step is saved where ``--save`` was given, and
the exit status is 128 + the signal. Real ``mpiexec`` (the mpich wheel's, through ``--workers``), a
rank really killed with SIGKILL (deterministically: ``ENGINE_TEST_KILL_RANK`` makes rank 1 kill itself
in the backward of a given step), and a real SIGTERM sent to the launching process. Smallest model
(mlp), one thread per rank, both ranks offloading to a swap directory under the test's folder.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

import numpy as np

from tests.parallel.test_parallel import TIMEOUT, environment, mpiexec

COMMON = ["train", "--model", "mlp", "--data", "synthetic", "--num-classes", "4", "--batch-size", "8",
          "--workers", "2", "--threads", "1", "--no-progress", "--offload-n", "1"]


def launch_env(tmp_path, **extra: str) -> dict[str, str]:
    (tmp_path / "tmp").mkdir(exist_ok=True)
    return {**environment(), "TMPDIR": str(tmp_path / "tmp"), **extra}  # the launch directory goes there


def left_behind(tmp_path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "swap").iterdir()) + sorted(p.name for p in (tmp_path / "tmp").iterdir())


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("Error:")]


def test_a_rank_killed_mid_step_stops_every_rank_and_saves_the_last_step_all_completed(tmp_path):
    """Rank 1 SIGKILLs itself in the backward of step 4 (index 3): rank 0, waiting in the gradient
    allreduce, is told by Hydra (SIGUSR1 through its supervisor), removes both swap directories (rank
    1's lock died with it), writes the weights of step 3, the last step both completed (they equal a
    straight 3-step run's bit for bit), prints one line naming rank 1 and exits 137."""
    from engine.parallel.comm import mpich_segments

    mpiexec()
    (tmp_path / "swap").mkdir()
    swap = ["--offload-dir", str(tmp_path / "swap")]
    segments = mpich_segments()
    killed = subprocess.run(
        [sys.executable, "-m", "cli", *COMMON, *swap, "--steps", "10", "--save", str(tmp_path / "killed.st")],
        capture_output=True, text=True, cwd=str(tmp_path), env=launch_env(tmp_path, ENGINE_TEST_KILL_RANK="1:3"),
        timeout=TIMEOUT)
    output = killed.stdout + killed.stderr
    assert killed.returncode == 128 + signal.SIGKILL, output
    lines = error_lines(killed.stderr)
    assert len(lines) == 1, output
    expected = "Error: rank 1 of 2 was killed by SIGKILL; every rank stopped during step 4 of 10"
    assert lines[0].startswith(expected), lines
    assert f"the checkpoint of step 3 was written to {tmp_path / 'killed.st'}" in lines[0]
    assert "BAD TERMINATION" not in output and "Traceback" not in output
    assert left_behind(tmp_path) == []
    assert mpich_segments() - segments == set()  # the killed job's shared memory is not left in /dev/shm

    straight = subprocess.run(
        [sys.executable, "-m", "cli", *COMMON, *swap, "--steps", "3", "--save", str(tmp_path / "straight.st")],
        capture_output=True, text=True, cwd=str(tmp_path), env=launch_env(tmp_path), timeout=TIMEOUT)
    assert straight.returncode == 0, straight.stdout + straight.stderr
    import safetensors.numpy

    a = safetensors.numpy.load_file(str(tmp_path / "killed.st"))
    b = safetensors.numpy.load_file(str(tmp_path / "straight.st"))
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert left_behind(tmp_path) == []


def test_with_parameter_averaging_a_lost_rank_leaves_the_survivors_own_weights_and_says_so(tmp_path):
    """Averaging every 3 steps, rank 1 killed in step 5 (index 4): rank 0 trained step 5 alone (the ranks
    meet only at averages and at the stop question before each step), its weights were last averaged
    after step 3: saved, and the line says whose they are, not "the last step every rank completed"."""
    mpiexec()
    (tmp_path / "swap").mkdir()
    killed = subprocess.run(
        [sys.executable, "-m", "cli", *COMMON, "--offload-dir", str(tmp_path / "swap"), "--steps", "10",
         "--averaging", "parameters", "--averaging-frequency", "3", "--save", str(tmp_path / "killed.st")],
        capture_output=True, text=True, cwd=str(tmp_path), env=launch_env(tmp_path, ENGINE_TEST_KILL_RANK="1:4"),
        timeout=TIMEOUT)
    assert killed.returncode == 128 + signal.SIGKILL, killed.stdout + killed.stderr
    lines = error_lines(killed.stderr)
    assert len(lines) == 1, killed.stdout + killed.stderr
    expected = "Error: rank 1 of 2 was killed by SIGKILL; every rank stopped during step 6 of 10"
    assert lines[0].startswith(expected), lines
    assert "rank 0's own weights (the ranks last averaged after step 3; the lost rank's steps since then are gone)" \
        in lines[0] and "the last step every rank completed" not in lines[0]
    from engine.checkpoint import read_checkpoint

    assert "the checkpoint of step 5 was written" in lines[0]  # rank 0 met rank 1 last before step 5
    assert read_checkpoint(str(tmp_path / "killed.st")).step == 5
    assert left_behind(tmp_path) == []


def test_sigterm_to_the_launcher_stops_every_rank_at_one_step_and_saves_it(tmp_path):
    """The launching ``engine train --workers 2`` gets SIGTERM while the ranks train (it used to be
    recorded and ignored: the ranks trained to the end). It passes the stop on; the ranks agree on
    the step to stop after; rank 0 writes it and prints one line; the job exits 143. The ranks are
    training when the signal is sent: --checkpoint-every 1 writes the --save file after each step."""
    mpiexec()
    (tmp_path / "swap").mkdir()
    save = tmp_path / "ck.st"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "cli", *COMMON, "--offload-dir", str(tmp_path / "swap"), "--steps", "100000",
         "--save", str(save), "--checkpoint-every", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(tmp_path), env=launch_env(tmp_path))
    try:
        deadline = time.monotonic() + TIMEOUT
        while not save.exists() and launcher.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert save.exists(), launcher.communicate(timeout=5)
        launcher.send_signal(signal.SIGTERM)
        stdout, stderr = launcher.communicate(timeout=TIMEOUT)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 128 + signal.SIGTERM, stdout + stderr
    lines = error_lines(stderr)
    assert len(lines) == 1, stdout + stderr
    found = re.match(r"Error: stopped by SIGTERM after step (\d+) of 100000; the last completed step: "
                     r"the checkpoint of step (\d+) was written to ", lines[0])
    assert found and found.group(1) == found.group(2) and 0 < int(found.group(1)) < 100000, lines
    from engine.checkpoint import read_checkpoint

    assert read_checkpoint(str(save)).step == int(found.group(1))
    assert "Traceback" not in stderr and "BAD TERMINATION" not in stdout + stderr
    assert left_behind(tmp_path) == []


def test_sigterm_to_the_launcher_while_the_ranks_start_stops_them_before_the_first_step(tmp_path):
    """SIGTERM as soon as the launcher has started mpiexec (its launch directory exists): the ranks
    are still importing; they read the launcher's stop note at their first agreed check, so all stop
    together, rank 0 says so in one line, nothing is left and the job exits 143."""
    mpiexec()
    (tmp_path / "swap").mkdir()
    env = launch_env(tmp_path)
    launcher = subprocess.Popen(
        [sys.executable, "-m", "cli", *COMMON, "--offload-dir", str(tmp_path / "swap"), "--steps", "100000",
         "--save", str(tmp_path / "ck.st")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(tmp_path), env=env)
    try:
        deadline = time.monotonic() + TIMEOUT
        while not list((tmp_path / "tmp").glob("engine-launch-*")) and launcher.poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.02)
        launcher.send_signal(signal.SIGTERM)
        stdout, stderr = launcher.communicate(timeout=TIMEOUT)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 128 + signal.SIGTERM, stdout + stderr
    lines = error_lines(stderr)
    assert len(lines) == 1 and lines[0].startswith("Error: stopped by SIGTERM "), stdout + stderr
    assert "Traceback" not in stderr and "rank" not in lines[0]  # all ranks stopped together: rank 0 speaks
    assert left_behind(tmp_path) == []

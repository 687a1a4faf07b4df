"""tests/run runs every stage and names each one's result before it fails (issue 33: a failing main
stage used to hide that the 102 CUDA-simulator tests never ran). Checked with stand-ins for ruff and
python that record their calls, so the script's logic is tested without running the suite."""

import os
import stat
import subprocess
from pathlib import Path

import pytest

RUN = Path(__file__).resolve().parent / "run"


def stand_in(directory: Path, name: str, body: str) -> None:
    path = directory / name
    record = f'echo "{name} $* cudasim=${{NUMBA_ENABLE_CUDASIM:-0}}" >> "$CALLS"'
    path.write_text(f"#!/usr/bin/env bash\n{record}\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.mark.parametrize(("ruff", "main", "cudasim", "code"), [
    (0, 0, 0, 0), (0, 1, 0, 1), (1, 0, 0, 1), (0, 0, 1, 1), (1, 1, 1, 1),
])
def test_every_stage_runs_and_the_summary_names_each_result(tmp_path, ruff, main, cudasim, code):
    calls = tmp_path / "calls"
    stand_in(tmp_path, "ruff", f"exit {ruff}")
    stand_in(tmp_path, "python", f'[ "${{NUMBA_ENABLE_CUDASIM:-0}}" = 1 ] && exit {cudasim}; exit {main}')
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "CALLS": str(calls)}
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    result = subprocess.run(["bash", str(RUN), "-x"], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == code, result.stdout + result.stderr
    assert calls.read_text().splitlines() == [
        "ruff check . cudasim=0",
        'python -m pytest -q -m not cudasim -x cudasim=0',
        "python -m pytest -q -m cudasim -x cudasim=1",
    ]
    summary = result.stdout.split("== tests/run summary\n")[1].splitlines()
    word = {0: "passed", 1: "FAILED (exit 1)"}
    assert summary == [f"ruff: {word[ruff]}", f"pytest (main): {word[main]}", f"pytest (cudasim): {word[cudasim]}"]

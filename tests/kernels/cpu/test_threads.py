"""Numba's OpenMP pool starts with its workers sleeping when idle, whichever entry point starts it.

Spinning workers took the second core from the conv shares' pool thread: ResNet-18's training step
ran 20% slower (kernels/cpu/threads.py). OpenMP reads OMP_WAIT_POLICY once, at start, so each test
runs in a fresh process and reads back the runtime's own settings (OMP_DISPLAY_ENV=VERBOSE).
"""

import os
import subprocess
import sys

import pytest

STARTS = {
    "engine.threads.set_threads": "from engine.threads import set_threads; set_threads(1)",
    "import kernels.cpu": "import kernels.cpu",
}


def run(code: str, **env: str) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    environment.update(OMP_DISPLAY_ENV="VERBOSE", **env)
    check = "import os; print('left in environ:', os.environ.get('OMP_WAIT_POLICY'))"
    return subprocess.run([sys.executable, "-c", f"{code}; {check}"], env=environment, capture_output=True,
                          text=True, timeout=120, check=True)


@pytest.mark.parametrize("code", STARTS.values(), ids=STARTS.keys())
def test_the_pool_starts_passive_and_the_environment_is_restored(code):
    result = run(code)
    # GNU OpenMP prints PASSIVE for its default too; the spin count tells them apart (default 300000)
    assert "GOMP_SPINCOUNT = '0'" in result.stderr
    assert "left in environ: None" in result.stdout  # a torch loaded later keeps its own default


def test_a_policy_the_user_set_is_kept():
    result = run(STARTS["engine.threads.set_threads"], OMP_WAIT_POLICY="active")
    assert "OMP_WAIT_POLICY = 'ACTIVE'" in result.stderr
    assert "left in environ: active" in result.stdout

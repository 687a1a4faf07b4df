"""Under a real memory cgroup (v1 or v2) that is too small, ``engine train`` refuses before its first step.

Issue 30 item 4 / issue 31 class 4: a fixed ``--offload-n N`` used to be checked against nothing and was
OOM-killed in its first step, leaving its swap directory. The child runs in a fresh child cgroup of this
process's own (``benchmarks/cgroup_proof.Cgroup``); skipped where cgroups are not writable (not root,
no memory controller)."""

from __future__ import annotations

import os
import sys

import pytest

from tests.scripts import load_script

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
LIMIT = 400 << 20  # above what the process holds before it plans (~150 MiB), far below what the step needs


def proof_module():
    return load_script("cgroup_proof")


@pytest.fixture(scope="module")
def proof():
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        pytest.skip("needs Linux and root to make a memory cgroup")
    module = proof_module()
    try:
        module.Cgroup(1 << 40, f"engine-test-check-{os.getpid()}").remove()
    except (RuntimeError, OSError) as exc:
        pytest.skip(f"no writable memory cgroup here: {exc}")
    return module


@pytest.mark.parametrize("options", [["--offload-n", "3"], []], ids=["fixed-n", "no-offload"])  # auto: test_limits
def test_a_too_small_cgroup_limit_is_refused_in_one_line(proof, tmp_path, options):
    swap = tmp_path / "swap"
    swap.mkdir()
    command = [sys.executable, "-m", "cli", "train", "--model", "cnn", "--data", "synthetic", "--image-size", "224",
               "--batch-size", "96", "--steps", "1", "--no-progress", "--threads", "1", "--offload-dir", str(swap),
               *options]
    result = proof.run_in_cgroup(command, LIMIT, f"engine-test-{os.getpid()}-{len(options)}", timeout=300)
    errors = [line for line in (result["stdout"] + result["stderr"]).splitlines() if line.strip()]
    assert result["returncode"] == 1 and not result.get("oom_kills"), result
    assert len(errors) == 1 and errors[0].startswith("Error: ") and "needs a limit of" in errors[0], errors
    assert "the limit is 0.39 GiB (cgroup v" in errors[0]
    assert "--offload-n 1" in errors[0] or "--offload-n auto" in errors[0]  # the option that reaches the limit
    assert os.listdir(swap) == []  # refused before the swap directory was made


def test_a_too_large_batch_under_ulimit_v_is_a_refusal_not_a_traceback(tmp_path):
    """Issue 31 class 4: under ``ulimit -v`` NumPy's MemoryError in the first step used to be a traceback."""
    import resource
    import subprocess

    if not sys.platform.startswith("linux"):
        pytest.skip("RLIMIT_AS and /proc/self/status are Linux's")

    def limit_address_space() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (1536 << 20, resource.RLIM_INFINITY))

    command = [sys.executable, "-m", "cli", "train", "--model", "cnn", "--data", "synthetic", "--image-size", "224",
               "--batch-size", "192", "--steps", "1", "--no-progress", "--threads", "1", "--offload-dir", str(tmp_path),
               "--chunks", "keep"]  # recomputing, the chunked layers would fit it
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, preexec_fn=limit_address_space,
                            timeout=300, env={**os.environ, "PYTHONPATH": ROOT})
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert result.returncode == 1 and len(lines) == 1, lines
    assert lines[0].startswith("Error: needs a limit of") and "(ulimit -v 1572864 KiB" in lines[0]
    assert os.listdir(tmp_path) == []


def test_two_ranks_share_the_limit_and_are_refused_where_one_process_would_fit(proof, tmp_path):
    """``--workers 2`` starts both ranks in this cgroup: each gets half of it. Batch 56 of the cnn at 224 needs
    400 MiB without offload in one process with every chunked layer recomputing (``engine memory``), so 720 MiB
    would hold one run but not two. Both ranks refuse together (``refuse_together``): one line, exit 1, no MPI_Abort."""
    pytest.importorskip("mpi4py")
    from engine.parallel.comm import mpiexec_path

    if mpiexec_path() is None:
        pytest.skip("no mpiexec: pip install 'numba-offload-engine[mpi]'")
    swap = tmp_path / "swap"
    swap.mkdir()
    command = [sys.executable, "-m", "cli", "train", "--model", "cnn", "--data", "synthetic", "--image-size", "224",
               "--batch-size", "56", "--steps", "1", "--no-progress", "--threads", "1", "--offload-dir", str(swap),
               "--workers", "2"]
    env = {k: v for k, v in os.environ.items() if k not in ("PMI_SIZE", "PMI_RANK", "ENGINE_WORKERS_LAUNCHED")}
    result = proof.run_in_cgroup(command, 720 << 20, f"engine-test-{os.getpid()}-ranks", timeout=300, env=env)
    assert result["returncode"] == 1 and not result.get("oom_kills"), result
    lines = [line for line in (result["stdout"] + result["stderr"]).splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: needs a limit of"), lines  # said once, no MPI_Abort
    assert "the limit is 0.35 GiB (cgroup v" in lines[0] and "shared by 2 ranks on this host" in lines[0]
    assert lines[0].endswith("(the 2 ranks on this host share its limit: fewer --workers leave each more)")
    assert os.listdir(swap) == []


def test_auto_at_its_floor_trains_where_only_the_shared_region_fits(proof, tmp_path):
    """``--offload-n auto`` under a real limit between what N=1 needs with its units in the step arena's free bytes
    and what it needs in an arena of their own: it says it takes its floor, and trains, not OOM-killed."""
    import json

    swap = tmp_path / "swap"
    swap.mkdir()
    base = [sys.executable, "-m", "cli", "train", "--model", "cnn", "--data", "synthetic", "--image-size", "224",
            "--batch-size", "56", "--steps", "1", "--no-progress", "--threads", "1", "--offload-dir", str(swap)]
    summary = tmp_path / "needs.json"
    free = proof.run_in_cgroup(base + ["--offload-n", "auto", "--chunks", "recompute", "--prefetch", "0",
                                       "--summary-json", str(summary)], None, "unused", timeout=300)
    assert free["returncode"] == 0, free
    needs = json.loads(summary.read_text())["memory_needs"]
    shared = needs["needed_min_offload_bytes"]  # the floor: N=1 sharing, every chunked layer recomputing, no prefetch
    apart = shared + needs["min_units_arena_bytes"] - needs["min_arena_bytes"]
    limit = shared + (apart - shared) // 2
    assert apart - shared > 16 << 20 and limit > shared + (8 << 20), needs  # room on both sides
    result = proof.run_in_cgroup(base + ["--offload-n", "auto"], limit, f"engine-test-{os.getpid()}-floor",
                                 timeout=300)
    assert result["returncode"] == 0 and not result.get("oom_kills"), result
    assert "--offload-n auto at its floor runs N=1" in result["stdout"], result["stdout"]
    assert result["cgroup_peak_bytes"] <= limit

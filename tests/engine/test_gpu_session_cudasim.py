"""benchmarks/gpu_session.sh --dry: the GPU session's Python parts under the simulator at tiny sizes.

A GPU is lent for minutes; this shows before then that the session's scripts run end to end and write
the report the lead commits (the tile search and its table, eager vs captured steps, the report's JSON
and markdown). The acceptance run and engine train have their own simulator tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cudasim

ROOT = Path(__file__).resolve().parents[2]


def test_dry_session_runs_and_reports(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable)
    done = subprocess.run(["bash", "benchmarks/gpu_session.sh", "--dry", "env", "search", "bench", "profile", "report"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    steps = json.loads((tmp_path / "steps.json").read_text())
    assert {name: step["rc"] for name, step in steps.items()} == {"env": 0, "search": 0, "bench": 0, "profile": 0}
    reports = list(tmp_path.glob("gpu-*.json"))
    assert len(reports) == 1 and reports[0].with_suffix(".md").exists()
    report = json.loads(reports[0].read_text())
    assert report["schema"] == "gpu-session/1" and report["dry"] is True
    assert [(r["model"], r["same_weights"]) for r in report["step"]] == [
        ("residual block (simulator, for resnet18)", True),
        ("residual block with dropout (simulator, for mobilenetv2)", True)]
    assert all(r["graph_launches"] > 10 and r["graph_host_wait_us_per_step"] is not None for r in report["step"])
    assert report["gemm"] and all(g["config"] for g in report["gemm"])
    # the plain GEMM beside the conv shapes: the tile loop alone, checked against NumPy, in the report's table
    assert [(p["size"], p["config"]) for p in report["plain_gemm"]] == [(8, "8x8k8t2x2")]
    assert report["plain_gemm"][0]["tflops"] > 0 and report["plain_gemm"][0]["max_error"] < 1e-5
    assert "plain GEMM (tile loop alone)" in reports[0].with_suffix(".md").read_text()
    assert all(goal["met"] is None for goal in report["goals"])  # a simulator decides no goal
    assert report["profile"][0]["step_kernel_ms"] > 0 and report["profile"][0]["kernels"]
    assert "Kernel profile cnn 4x4 b2" in reports[0].with_suffix(".md").read_text()
    table = json.loads((tmp_path / "gemm_table.json").read_text())
    assert set(table["entries"]) == {g["key"] for g in report["gemm"]}

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


def test_dry_offload_part_reports_both_tiers_the_stall_and_one_loss(tmp_path):
    """The offload part the GPU session runs (``gpu_step_bench.py --parts offload``), at tiny sizes: engine
    train without offload (captured, eager), with it (pinned host memory: the bytes fit), and with it
    through the swap file (``--offload-host-memory 0``); the report gives each run's images/s, swap tier,
    stall per step and bytes moved, the ratio the issue's goal asks for, and whether all ended with one loss."""
    output = tmp_path / "step_offload.json"
    done = subprocess.run([sys.executable, "benchmarks/gpu_step_bench.py", "--dry", "--parts", "offload",
                           "--output", str(output)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, NUMBA_ENABLE_CUDASIM="1"))
    assert output.exists(), done.stdout[-2000:] + done.stderr[-2000:]  # its exit code: every run's (the graph's too)
    runs = json.loads(output.read_text())["offload"]  # captured step, eager step, offload twice
    # the first (the captured step) is the graph's part of the session; these are the eager ones
    assert [r["returncode"] for r in runs[1:]] == [0, 0, 0]
    assert runs[1]["offload"] is None
    assert [r["offload"]["swap_tier"] for r in runs[2:]] == ["pinned host memory", "swap file"]
    assert all(r["offload"]["stall_ms_per_step"] >= 0 and r["offload"]["written_bytes_per_step"] > 0 for r in runs[2:])
    assert len({r["final_loss"] for r in runs[1:]}) == 1  # offload on or off, either tier: the same loss
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_report
    finally:
        sys.path.pop(0)
    text = gpu_report.markdown(gpu_report.build(str(tmp_path), "dry"))
    assert "N=1, pinned host memory, stall" in text and "N=1, swap file, stall" in text
    assert "x the images/s without" in text and "against the eager step without offload" in text

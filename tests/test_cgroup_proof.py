"""benchmarks/cgroup_proof.py: its cgroup really limits a child, and it exits 0 with a reason where it cannot run."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "cgroup_proof.py")


def load_script():
    spec = importlib.util.spec_from_file_location("cgroup_proof", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_without_root_it_says_why_and_exits_0(monkeypatch, capsys):
    proof = load_script()
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(sys, "argv", ["cgroup_proof.py"])
    assert proof.main() == 0
    assert "needs root" in capsys.readouterr().out


def test_a_child_past_the_limit_is_oom_killed():
    proof = load_script()
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        pytest.skip("needs Linux and root")
    try:
        small = proof.run_in_cgroup([sys.executable, "-c", "b = bytearray(300 << 20)"], 96 << 20,
                                    f"t-oom-{os.getpid()}")
    except (RuntimeError, OSError) as exc:
        pytest.skip(f"no writable memory cgroup here: {exc}")
    assert small["returncode"] in (-9, 137) and small["oom_kills"] >= 1
    fine = proof.run_in_cgroup([sys.executable, "-c", "b = bytearray(16 << 20)"], 96 << 20, f"t-ok-{os.getpid()}")
    assert fine["returncode"] == 0 and fine["oom_kills"] == 0


def test_bisect_finds_the_smallest_limit_that_works(monkeypatch):
    """bisect_limit against a stand-in for the cgroup: a run works from 700 MiB up."""
    proof = load_script()
    tried = []

    def fake_run(command, limit, name, timeout=None, env=None):
        tried.append(limit)
        ok = limit >= 700 << 20
        return {"returncode": 0 if ok else -9, "oom_kills": 0 if ok else 1, "cgroup_peak_bytes": min(limit, 690 << 20),
                "seconds": 1.0, "stdout": "", "stderr": ""}

    monkeypatch.setattr(proof, "run_in_cgroup", fake_run)
    best, trials = proof.bisect_limit(["true"], 500 << 20, 900 << 20, 8 << 20)
    assert (700 << 20) <= best < (708 << 20) and tried[0] == 900 << 20 and len(trials) == len(tried)
    assert all(t["ok"] == (t["limit_bytes"] >= 700 << 20) for t in trials)
    assert proof.bisect_limit(["true"], 500 << 20, 600 << 20, 8 << 20)[0] is None  # even the top fails


def test_the_bisect_table_prints_predicted_against_bisected(capsys):
    proof = load_script()
    needs = {"setup_anon_bytes": 170 << 20, "setup_file_bytes": 67 << 20}
    rows = [{"model": "resnet18", "batch_size": 32, "plan": "n1", "predicted_bytes": 698 << 20, "needs": needs,
             "bisected_bytes": 665 << 20, "error": 33 / 665, "unlimited_cgroup_peak_bytes": 659 << 20,
             "auto": {"limit_bytes": 704 << 20, "returncode": 0, "oom_kills": 0, "cgroup_peak_bytes": 662 << 20,
                      "step_s": 1.5, "window": 1, "swap_left": []}}]
    proof.print_bisect_table(rows)
    out = capsys.readouterr().out
    assert "| resnet18 | 32 | `--offload-n 1` | 698 MiB | 665 MiB | +5.0% | 170 MiB + 67 MiB | 659 MiB |" in out
    assert "| resnet18 | 32 | 704 MiB | 1.50 s, 662 MiB (N=1) | not run | not run |" in out


def test_the_goal_mode_alternates_runs_and_reports_the_ratio_of_medians(monkeypatch, capsys, tmp_path):
    """``--goal``: each round runs every model under its limit, then without one; the table's ratio is the median
    step under the limit over the median without, against GOAL_RATIO; a failed run leaves no ratio."""
    proof = load_script()
    steps = {("resnet18", True): iter([1.8, 1.7, 2.0]), ("resnet18", False): iter([1.5, 1.4, 1.6]),
             ("mobilenetv2", True): iter([1.3, 1.2, 1.3]), ("mobilenetv2", False): iter([0.9, 0.9, 0.9])}
    order = []

    def fake_run(model, batch, steps_, limit, swap_dir, name):
        order.append((model, limit))
        return {"limit_bytes": limit, "returncode": 0, "step_s": next(steps[model, limit is not None]),
                "stall_ms": 50.0, "written_bytes": 100 << 20, "cgroup_peak_bytes": 480 << 20}

    monkeypatch.setattr(proof, "auto_run", fake_run)
    args = type("Args", (), {"goal_limits": "mobilenetv2=600MiB", "models": "resnet18,mobilenetv2",
                             "batch_sizes": "32", "rounds": 3, "steps": 6, "json": str(tmp_path / "goal.json")})()
    assert proof.main_goal(args) == 0
    assert order[:4] == [("resnet18", 510 << 20), ("resnet18", None), ("mobilenetv2", 600 << 20), ("mobilenetv2", None)]
    table = capsys.readouterr().out
    assert "| resnet18 | 510 MiB | 1.80, 1.70, 2.00 s | 1.50, 1.40, 1.60 s | 1.20× (met) |" in table
    assert "| mobilenetv2 | 600 MiB | 1.30, 1.20, 1.30 s | 0.90, 0.90, 0.90 s | 1.44× (not met) |" in table
    monkeypatch.setattr(sys, "argv", ["cgroup_proof.py", "--from-json", str(tmp_path / "goal.json")])
    assert proof.main() == 0 and "1.44× (not met)" in capsys.readouterr().out


def test_the_goal_ratio_is_of_true_medians_with_an_even_number_of_rounds(capsys):
    """Two rounds: the median is the mean of the two, on both sides (the upper one of each had read 1.25× for
    1.40, 1.30 s against 0.95, 1.12 s; the true ratio is 1.30×)."""
    proof = load_script()
    row = {"limit_bytes": 610 << 20, "stall_ms": 80.0, "written_bytes": 168 << 20, "cgroup_peak_bytes": 597 << 20}
    runs = {"mobilenetv2": {"limited": [{**row, "step_s": 1.40}, {**row, "step_s": 1.30}],
                            "unlimited": [{**row, "limit_bytes": None, "step_s": 0.95},
                                          {**row, "limit_bytes": None, "step_s": 1.12}]}}
    proof.print_goal_table(runs, 32)
    assert "| 1.30× (not met) |" in capsys.readouterr().out

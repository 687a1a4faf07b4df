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

"""benchmarks/bench_train.py: the alternating runs' medians and their ratio (no training here)."""

import importlib.util
import os

import pytest

_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "bench_train.py")
_spec = importlib.util.spec_from_file_location("bench_train", _PATH)
bench_train = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_train)


def _run(framework: str, step_seconds: float) -> dict:
    return {"framework": framework, "model": "m", "batch_size": 32, "images_per_second": 32 / step_seconds}


def test_median_step_is_the_middle_run_not_the_mean():
    runs = [_run("engine", 1.0), _run("torch", 0.8), _run("engine", 9.0), _run("torch", 0.9), _run("engine", 1.2)]
    assert bench_train.median_step_seconds(runs, "engine") == pytest.approx(1.2)
    assert bench_train.median_step_seconds(runs, "torch") == pytest.approx(0.85)  # even count: mean of the middle two


def test_ratio_line_names_both_medians_and_engine_over_torch():
    runs = [_run("engine", 1.0), _run("torch", 0.8), _run("engine", 1.2), _run("torch", 1.0)]
    line = bench_train.format_ratio("resnet18", runs)
    assert "2 alternating runs" in line and "engine 1.100 s" in line and "torch 0.900 s" in line
    assert line.endswith("engine / torch 1.22")

"""What the training summary says: peaks by phase, offload measured, short runs, the chance hint."""

import io

import pytest
from rich.console import Console

from engine.backend import get_backend
from engine.data.datasets import synthetic
from engine.memory.monitor import MemoryMonitor
from engine.offload import OffloadConfig, OffloadSession
from engine.optim import make_optimizer
from engine.summary import chance_hint, render_training_summary, summary_tables
from engine.train import Trainer, TrainResult
from models import build_network


def run(tmp_path, steps, offload=None, test=8):
    backend = get_backend("cpu")
    data = synthetic(num_classes=4, seed=0, train=16, test=test, shape=(3, 8, 8))
    net = build_network("cnn", data, backend, seed=3)
    optimizer = make_optimizer("sgd", net, backend, 0.1, momentum=0.9, manager=net.mgr)
    monitor = MemoryMonitor(net.mgr)
    trainer = Trainer(net, optimizer, data, batch_size=4, steps=steps, seed=4, prefetch=1, monitor=monitor,
                      offload=offload)
    return trainer.fit(), monitor


def text_of(result) -> str:
    out = io.StringIO()
    render_training_summary(result, Console(file=out, force_terminal=False))
    return out.getvalue()


@pytest.fixture(scope="module")
def offloaded(tmp_path_factory):
    directory = tmp_path_factory.mktemp("swap")
    return run(directory, steps=4, offload=OffloadSession(OffloadConfig(window=1, directory=str(directory)),
                                                          sample_page_cache=True))


def test_peaks_are_reported_per_phase_and_name_the_process_peak(offloaded):
    result, monitor = offloaded
    assert set(result.phases) == {"setup", "training", "evaluation"}
    assert result.phases["training"].samples == 4 and result.phases["evaluation"].samples == 2
    assert result.peak_rss_phase in result.phases
    assert result.peak_rss_bytes >= max(p.peak_rss_bytes for p in result.phases.values())
    assert result.peak_rss_bytes >= result.phases[result.peak_rss_phase].peak_rss_bytes > 0
    # each line's in-step peak is at least the RSS read at its end
    assert all(r["rss_peak_bytes"] >= r["rss_bytes"] - 2**20 for r in monitor.records)
    # evaluation counts the inference manager, not the training step's last peak
    assert "ACTIVATION_GRAD" not in result.phases["evaluation"].peak_bytes
    assert result.phases["evaluation"].peak_bytes["ACTIVATIONS"] > 0
    data = result.as_dict()
    assert data["phases"]["training"]["peak_bytes"] == result.peak_bytes
    assert data["peak_rss_phase"] == result.peak_rss_phase


def test_offload_is_measured_in_the_summary(offloaded):
    result, _ = offloaded
    offload = result.offload
    assert offload["window"] == 1 and offload["requested"] == "1" and offload["steps"] == 4
    assert offload["steps_averaged"] == 3  # the first step aside
    assert offload["written_bytes_per_step"] == offload["read_bytes_per_step"] > 0
    assert 0 < offload["resident_peak_bytes"] <= offload["bound_bytes"]
    assert offload["resident_peak_bytes"] < offload["no_offload_bytes"]
    assert offload["page_cache_bytes"] is not None and offload["stall_ms_per_step"] >= 0
    text = text_of(result)
    assert "(in the offload arena)" in text and "written per step" in text and "saved for backward" in text
    # the offload arena's types are not shown as a meaningless few bytes in the training column
    phase_rows = {row[0]: row for row in summary_tables(result)[1].rows}
    assert phase_rows["ACTIVATIONS"][2] == "(in the offload arena)"
    assert offload["swap_tier"] == "swap file" and "swapped to" not in text  # the cpu backend: the disk


def test_a_gpu_run_swapping_to_pinned_host_memory_says_so(offloaded):
    """A GPU run whose swapped bytes fit the host budget has no swap file (engine.offload.staging): the
    table says where the bytes went and does not call the page-cache figure 'not sampled'."""
    import dataclasses

    result = dataclasses.replace(offloaded[0], offload=dict(offloaded[0].offload, swap_tier="pinned host memory",
                                                            page_cache_bytes=None))
    rows = {row[0]: row[1] for row in summary_tables(result)[-1].rows}
    assert rows["swapped to"] == "pinned host memory"
    assert rows["swap file in the page cache"] == "n/a (no swap file)"


def test_a_short_run_says_n_a_instead_of_zero(tmp_path):
    result, _ = run(tmp_path, steps=2)
    assert result.steady_images_per_second is None and result.loss_window == 2 and result.accuracy_steps == 2
    text = text_of(result)
    assert "n/a (needs more than 2 steps)" in text and "mean of the last 2 steps" in text
    assert "0.0)" not in text
    assert result.as_dict()["steady_images_per_second"] is None


def test_the_chance_hint_appears_only_at_chance():
    result = TrainResult(steps=20, final_step=20, epochs=0.1, batch_size=32, seconds=1.0, images_per_second=1.0,
                         steady_images_per_second=1.0, final_loss=2.3, train_accuracy=0.1, test_accuracy=0.09,
                         test_top5_accuracy=0.5, test_loss=2.3, peak_rss_bytes=1, num_classes=10)
    hint = chance_hint(result)
    assert hint and "at chance for 10 classes" in hint and "--lr" in hint and "more steps" in hint
    assert "hint: test accuracy 9.00%" in text_of(result)
    result.test_accuracy = 0.9
    assert chance_hint(result) is None and result.as_dict()["at_chance"] is False


_HIGH_WATER = """
import numpy as np
from engine.memory.monitor import MemoryMonitor, max_rss_bytes
monitor = MemoryMonitor([])
monitor.begin_phase("training")
before = max_rss_bytes()
block = np.ones((before + 64 * 2**20) // 8)  # more than the process ever held: a new peak, freed again
del block
monitor.begin_phase("evaluation")
monitor.end_phase()
assert monitor.phase_rss_exact["training"] and not monitor.phase_rss_exact["evaluation"]
assert monitor.phase_rss_peaks["training"] == max_rss_bytes() > before + 60 * 2**20
assert monitor.phase_rss_peaks["evaluation"] < monitor.phase_rss_peaks["training"]
assert monitor.process_peak() == (max_rss_bytes(), "training")
print("ok")
"""


def test_a_phase_that_raises_the_high_water_mark_gets_it_exactly():
    # in a fresh process: a new peak of the suite's own process meant writing more than its whole high-water mark
    # (6 s in the suite); a fresh process raises its small mark with a block of ~100 MiB
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _HIGH_WATER], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout == "ok\n", out.stderr[-3000:]


def test_auto_reports_the_window_it_settled_on_with_its_history(tmp_path):
    result, monitor = run(tmp_path, steps=3, offload=OffloadSession(OffloadConfig(window="auto",
                                                                                  directory=str(tmp_path))))
    offload = result.offload
    assert offload["requested"] == "auto" and offload["window_history"][0]["step"] == 0
    assert offload["window"] == offload["window_history"][-1]["window"]
    windows = [r["swap"]["window"] for r in monitor.records if r["phase"] == "training"]  # the memory log
    changes = [{"step": i, "window": w} for i, w in enumerate(windows) if i == 0 or w != windows[i - 1]]
    assert offload["window_history"] == changes and windows[-1] == offload["window"]
    assert "(auto: " in text_of(result) and "per step in --memory-log" in text_of(result)

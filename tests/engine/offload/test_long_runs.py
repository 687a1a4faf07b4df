"""Offload runs longer than the scheduler's per-step history (issue 31: every offload run past 1,024
steps crashed at its end, in the summary, and lost its ``--save``).

The scheduler keeps only its latest steps (``History``, issue 14); the summary's figures are running
totals (``StepTotals``). These tests read every figure at the history's bound and past it, against
sums a listener keeps of every step.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine.backend import get_backend
from engine.data.datasets import Dataset
from engine.offload.scheduler import StepStats, StepTotals
from engine.offload.session import OffloadConfig, OffloadSession
from engine.optim import make_optimizer
from engine.train import Trainer, TrainingListener
from models import build_model


class EveryStep(TrainingListener):
    """The scheduler's latest StepStats after every step: the whole run, which its history does not keep."""

    def __init__(self):
        self.stats: list[StepStats] = []

    def on_step_end(self, trainer, record):
        self.stats.append(trainer.offload.scheduler.stats[-1])


def offload_run(tmp_path, steps, history, window="1"):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 1, 4, 4), dtype=np.float32)
    y = rng.integers(0, 2, 64)
    backend = get_backend("cpu")
    net = build_model("mlp", num_classes=2, backend=backend, input_shape=(1, 4, 4), hidden=8, depth=2)
    opt = make_optimizer("sgd", net, backend, 0.01, momentum=0.9, manager=net.mgr)
    session = OffloadSession(OffloadConfig.from_options(window, None, str(tmp_path), False, "full"), history=history)
    every = EveryStep()
    trainer = Trainer(net, opt, Dataset("tiny", x, y, x[:8], y[:8], 2, channels=1), batch_size=4, steps=steps,
                      prefetch=0, listeners=[every], evaluate_at_end=False, offload=session, gc_every=0)
    result = trainer.fit()
    return result, session, every.stats


def expected_summary(stats):
    steady = stats[1:] if len(stats) > 1 else stats
    return {
        "steps": len(stats),
        "steps_averaged": len(steady),
        "stall_ms_per_step": 1e3 * sum(s.stall_s for s in steady) / len(steady),
        "written_bytes_per_step": int(sum(s.bytes_written for s in steady) / len(steady)),
        "read_bytes_per_step": int(sum(s.bytes_read for s in steady) / len(steady)),
        "resident_peak_bytes": max(s.peak_resident_bytes for s in stats),
        "bound_bytes": max(s.bound_bytes for s in stats),
    }


@pytest.mark.parametrize("steps", [7, 8, 9, 20])  # below, at, one past and far past a history of 8
def test_the_summary_covers_every_step_at_and_past_the_history_bound(tmp_path, steps):
    result, session, stats = offload_run(tmp_path, steps, history=8)
    scheduler = session.scheduler
    assert len(scheduler.stats) == steps and len(list(scheduler.stats)) == min(steps, 8)
    summary = result.offload
    expected = expected_summary(stats)
    assert {k: summary[k] for k in expected} == pytest.approx(expected)
    assert summary["window_history"] == [{"step": 0, "window": 1}]


def test_an_offload_run_of_one_cifar10_epoch_ends_with_its_summary(tmp_path):
    """The default history (1,024 steps) and a run length users have: one CIFAR-10 epoch at batch 32 is
    1,562 steps (the issue's reproduction ran 1,030). The swap file on a RAM-backed directory where there is one:
    what is tested is the summary's arithmetic, not the disk, and a disk took a third more CPU time per step."""
    import os
    import shutil
    import tempfile
    from pathlib import Path

    directory = Path(tempfile.mkdtemp(dir="/dev/shm")) if os.path.isdir("/dev/shm") else tmp_path
    try:
        result, session, stats = offload_run(directory, 1563, history=1024)
    finally:
        if directory != tmp_path:
            shutil.rmtree(directory)
    assert session.scheduler.stats.first_kept == 1563 - 1024
    assert result.steps == 1563 and result.offload["steps"] == 1563 and result.offload["steps_averaged"] == 1562
    expected = expected_summary(stats)
    assert {k: result.offload[k] for k in expected} == pytest.approx(expected)


def test_window_changes_are_bounded_and_keep_the_first_and_the_last():
    totals = StepTotals()
    for step in range(200):
        totals.add(StepStats(step=step, window=1 + step % 3))  # a change every step
    assert totals.window_changes_total == 200 and len(totals.window_changes) == StepTotals.WINDOW_CHANGES_KEPT
    changes = totals.changes()
    assert changes[0] == (0, 1) and changes[-1] == (199, 1 + 199 % 3) and len(changes) == totals.WINDOW_CHANGES_KEPT + 1
    exactly = StepTotals()
    for step in range(StepTotals.WINDOW_CHANGES_KEPT):
        exactly.add(StepStats(step=step, window=step + 1))
    assert exactly.changes() == [(s, s + 1) for s in range(StepTotals.WINDOW_CHANGES_KEPT)]  # at the bound: all

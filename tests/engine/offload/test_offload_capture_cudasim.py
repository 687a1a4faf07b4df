"""Offload on the pinned tier inside a captured step (engine/cuda_graph.py), in the CUDA simulator.

The stand-in graph records the offload copies, the executor's waits for them and the end-of-step join with
the kernel launches, in order (``staging._CapturedCopy``); a replay queues the copies again on the simulated
copy streams, which run a copy only when something waits for it. So a replay that skipped a save, a load or
a wait would train to other bits than the eager step: these tests show it does not, and that it would.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine.backend import get_backend
from engine.cuda_graph import StepRunner, residual_graph
from engine.network import Network
from engine.offload import OffloadScheduler
from engine.offload.staging import PinnedStorage, _CapturedCopy, _CapturedWait
from engine.optim import make_optimizer

pytestmark = pytest.mark.cudasim

IMAGE = 2
SIZES = [2, 2, 2, 2, 2]  # one eager step, the capture, three replays: each with its own batch


def _batches(sizes=SIZES):
    rng = np.random.default_rng(1)
    return [(rng.standard_normal((n, 3, IMAGE, IMAGE)).astype(np.float32), rng.integers(0, 3, n).astype(np.int64))
            for n in sizes]


def _run(window, capture, directory, host_swap_bytes="auto", edit=None):
    """Weights after the batches; ``capture`` False: eager steps through the runner (the device scalars)."""
    backend = get_backend("cudasim")
    net = Network(residual_graph(image=IMAGE), backend, seed=0)
    opt = make_optimizer("sgd", net, backend, lambda step: 0.05 / (1 + step), manager=net.mgr, momentum=0.9)
    scheduler = None
    if window:
        scheduler = OffloadScheduler(backend, window, directory=str(directory),
                                     host_swap_bytes=host_swap_bytes).attach(net)
    runner = StepRunner(net, opt, capture=capture, warmup=1)
    try:
        for x, y in _batches():
            runner.step(x, y)
            shape = runner.shapes[x.shape]
            if edit is not None and shape.graph is not None and not getattr(shape.graph, "edited", False):
                edit(shape.graph)
                shape.graph.edited = True
        return np.array(net.parameters.flat), runner, scheduler
    finally:
        runner.close()
        if scheduler is not None:
            scheduler.close()
        net.close()


_REFERENCE: dict = {}


def _reference(tmp_path):
    if "plain" not in _REFERENCE:
        _REFERENCE["plain"] = _run(None, False, tmp_path)[0]
    return _REFERENCE["plain"]


@pytest.mark.parametrize("window", [1, 2, 4])
def test_offload_captured_on_the_pinned_tier_gives_the_eager_and_no_offload_weights(tmp_path, window):
    expected = _reference(tmp_path)
    eager, _, eager_scheduler = _run(window, False, tmp_path)
    captured, runner, scheduler = _run(window, "record", tmp_path)
    np.testing.assert_array_equal(eager, expected)
    np.testing.assert_array_equal(captured, expected)
    assert runner.eager_reason is None
    shape = next(iter(runner.shapes.values()))
    assert (shape.eager_steps, shape.captures, shape.replays) == (1, 1, len(SIZES) - 1)
    assert isinstance(scheduler.storage, PinnedStorage)
    assert shape.graph.operations > 0  # the offload copies and waits are in the graph
    # the per-step figures stay true on replays: the same bytes moved every step as in the eager run
    assert len(scheduler.stats) == scheduler.totals.steps == len(SIZES)
    assert [s.bytes_written for s in scheduler.stats] == [s.bytes_written for s in eager_scheduler.stats]
    assert [s.bytes_read for s in scheduler.stats] == [s.bytes_read for s in eager_scheduler.stats]
    assert scheduler.stats[-1].bytes_written > 0
    assert scheduler.totals.bytes_written == eager_scheduler.totals.bytes_written
    assert scheduler.storage.bytes_read == eager_scheduler.storage.bytes_read
    assert scheduler._transfer.staged_bytes == eager_scheduler._transfer.staged_bytes
    assert scheduler.totals.peak_resident_bytes == eager_scheduler.totals.peak_resident_bytes


def _drop_work(kind):
    """An edit of the captured graph: the first save (kind "save") does nothing, or the last load's wait
    (kind "load") is left out."""

    def edit(graph):
        copies = [entry[1] for entry in graph.launches if isinstance(entry[1], _CapturedCopy)]
        if kind == "save":
            save = next(c for c in copies if c.stream is copies[0].stream)
            save.work = lambda: None
        else:
            waits = [i for i, entry in enumerate(graph.launches) if isinstance(entry[1], _CapturedWait)
                     and entry[1].copy.stream is not copies[0].stream]
            del graph.launches[waits[-1]]

    return edit


@pytest.mark.parametrize("kind", ["save", "load"])
def test_a_replay_that_skips_a_save_or_a_loads_wait_changes_the_weights(tmp_path, kind):
    """What the two tests above rely on: the simulated replay runs the copies it recorded, when waited for."""
    expected = _reference(tmp_path)
    weights, runner, _ = _run(2, "record", tmp_path, edit=_drop_work(kind))
    assert next(iter(runner.shapes.values())).replays == len(SIZES) - 1
    assert not np.array_equal(weights, expected)


def test_the_disk_tier_stays_eager_with_its_reason(tmp_path):
    weights, runner, scheduler = _run(2, "record", tmp_path, host_swap_bytes=0)
    np.testing.assert_array_equal(weights, _reference(tmp_path))
    assert runner.eager_reason == "offload swaps to the swap file, which needs the IO threads (pinned host memory only)"
    assert all(s.captures == 0 for s in runner.shapes.values())


def _trainer_run(cuda_graph, directory, host_swap):
    """engine train's set-up (the CLI's): eager updates inside backward, the graph the whole block; offload N=2."""
    from engine.data.datasets import Dataset
    from engine.offload.session import session_from_options
    from engine.optim import update_in_backward
    from engine.train import Trainer

    rng = np.random.default_rng(5)
    x = rng.standard_normal((8, 3, IMAGE, IMAGE)).astype(np.float32)
    data = Dataset("tiny", x, rng.integers(0, 3, 8).astype(np.int64), x[:2].copy(), np.array([0, 1]), 3,
                   mean=np.zeros(3, np.float32), std=np.ones(3, np.float32))
    backend = get_backend("cudasim")
    net = Network(residual_graph(image=IMAGE, dropout=0.5), backend, seed=0)
    opt = make_optimizer("sgd", net, backend, lambda step: 0.05 / (1 + step), momentum=0.9, manager=net.mgr)
    if cuda_graph is None:
        update_in_backward(net, opt)
    session = session_from_options(net, 2, "2", None, str(directory), host_swap=host_swap)
    trainer = Trainer(net, opt, data, batch_size=2, steps=4, shuffle=False, prefetch=0, evaluate_at_end=False,
                      offload=session, cuda_graph=cuda_graph)
    try:
        result = trainer.fit()
        return net.state_dict(), trainer, result.offload
    finally:
        net.close()


def test_engine_train_captures_offload_on_the_pinned_tier_and_names_why_not_on_the_disk(tmp_path):
    """Through the Trainer (dropout, a new learning rate each step): the pinned tier captured and the disk tier
    (eager, its reason kept for the summary JSON) train to the eager offload run's weights, and the offload
    summary counts every step, with the same bytes per step."""
    eager, _, eager_summary = _trainer_run(None, tmp_path, "auto")
    for host_swap in ("auto", 0):
        weights, trainer, summary = _trainer_run("record", tmp_path, host_swap)
        for name, value in eager.items():
            np.testing.assert_array_equal(weights[name], value, err_msg=name)
        assert trainer.cuda_graph_error is None
        assert summary["steps"] == eager_summary["steps"] == 4
        assert summary["written_bytes_per_step"] == eager_summary["written_bytes_per_step"] > 0
        if host_swap == "auto":
            assert trainer.cuda_graph_eager_reason is None and summary["swap_tier"] == "pinned host memory"
        else:
            assert "needs the IO threads" in trainer.cuda_graph_eager_reason


def test_a_capture_that_fails_goes_on_eagerly_and_counts_each_step_once(tmp_path, monkeypatch):
    """A capture that fails after running the step's Python (as a GPU's end_capture can): offload's per-step
    figures it added go back, the step and every later one run eagerly, the weights are eager's."""
    import engine.cuda_graph as cuda_graph
    from engine.backend import CaptureError

    real = cuda_graph.record_capture

    def failing_capture(body, stream=None):
        real(body, stream)
        raise CaptureError("stand-in failure at the end of the capture")

    monkeypatch.setattr(cuda_graph, "record_capture", failing_capture)
    backend = get_backend("cudasim")
    net = Network(residual_graph(image=IMAGE), backend, seed=0)
    opt = make_optimizer("sgd", net, backend, lambda step: 0.05 / (1 + step), manager=net.mgr, momentum=0.9)
    scheduler = OffloadScheduler(backend, 2, directory=str(tmp_path), host_swap_bytes="auto").attach(net)
    runner = StepRunner(net, opt, capture="record", warmup=1, fallback=True)
    try:
        for x, y in _batches():
            runner.step(x, y)
        np.testing.assert_array_equal(np.array(net.parameters.flat), _reference(tmp_path))
        assert runner.capture_error == "CaptureError: stand-in failure at the end of the capture"
        assert len(scheduler.stats) == scheduler.totals.steps == len(SIZES)
        assert [s.step for s in scheduler.stats] == list(range(len(SIZES)))
    finally:
        runner.close()
        scheduler.close()
        net.close()

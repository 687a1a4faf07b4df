"""The GPU offload path (device -> pinned host memory [-> disk], on copy streams) under the CUDA simulator.

Runs only in the process started with NUMBA_ENABLE_CUDASIM=1 (tests/run does that). A tiny mlp keeps
the simulated kernels cheap. The simulator's copy streams run a queued copy only when something waits
for it (``staging._SimStream``: the latest moment a GPU could), so a save whose device bytes are
overwritten before its copy was waited for, or a load nobody waited for, changes the weights here.
"""

import threading
import time

import numpy as np
import pytest

from engine.offload import LayerState, OffloadScheduler
from engine.offload.staging import DeviceStaging, PinnedStorage
from engine.offload.storage import SwapStorage
from engine.optim import SGD
from models import build_model

pytestmark = pytest.mark.cudasim

MLP = dict(input_shape=(3, 4, 4), hidden=8, depth=4)
PINNED, DISK = "auto", 0  # host_swap_bytes: the pinned host tier (it fits), or the disk for everything


def train(window, directory, steps=1, host_swap_bytes=PINNED, delay=None, on_attach=None):
    from engine.backend import get_backend

    backend = get_backend("cudasim")
    net = build_model("mlp", num_classes=4, backend=backend, seed=3, **MLP)
    optimizer = SGD(net.parameters, net.gradients, backend, lr=0.1, momentum=0.9)
    scheduler = None
    if window:
        scheduler = OffloadScheduler(backend, window, directory=str(directory), host_swap_bytes=host_swap_bytes,
                                     delay=delay).attach(net)
        if on_attach is not None:
            on_attach(scheduler)
    rng = np.random.default_rng(0)
    try:
        for _ in range(steps):
            x = backend.to_device(rng.standard_normal((2, 3, 4, 4)).astype(np.float32))
            y = backend.to_device(rng.integers(0, 4, 2).astype(np.int64))
            net.forward(x, training=True)
            net.loss(y)
            net.backward()
            optimizer.step()
        return net.state_dict(), scheduler
    finally:
        if scheduler is not None:
            scheduler.close()
        net.close()


_REFERENCE = {}


def reference(tmp_path, steps):
    if steps not in _REFERENCE:
        _REFERENCE[steps] = train(None, tmp_path, steps)[0]
    return _REFERENCE[steps]


def assert_same(expected, weights):
    for key in expected:
        assert np.array_equal(expected[key], weights[key]), key


def test_cudasim_offload_stages_through_pinned_buffers_and_keeps_the_bits(tmp_path):
    weights, scheduler = train(1, tmp_path, host_swap_bytes=DISK)
    assert_same(reference(tmp_path, 1), weights)
    assert isinstance(scheduler._transfer, DeviceStaging) and isinstance(scheduler.storage, SwapStorage)
    assert sum(s.bytes_written for s in scheduler.stats) > 0
    spans = sum(unit.nbytes for unit in scheduler._plan.offloaded)
    assert scheduler._transfer.staged_bytes == 2 * spans  # every unit went through a pinned buffer, both ways


@pytest.mark.parametrize("window", [1, 2])
@pytest.mark.parametrize("tier", [PINNED, DISK], ids=["pinned", "disk"])
def test_both_tiers_keep_the_bits_over_steps(tmp_path, tier, window):
    """Offload on or off, any N, either swap tier: the same weights after 2 steps (momentum carries them)."""
    weights, scheduler = train(window, tmp_path, 2, tier)
    assert_same(reference(tmp_path, 2), weights)
    stats = list(scheduler.stats)
    assert all(s.bytes_written == s.bytes_read > 0 for s in stats)
    assert isinstance(scheduler.storage, PinnedStorage if tier == PINNED else SwapStorage)


def test_the_pinned_tier_needs_no_disk_and_the_executor_never_waits(tmp_path):
    """Swapped bytes that fit the host budget stay in pinned host memory: no swap file, no IO thread at
    work, and the executor queues every copy itself (an inline wait would be an error, not a stall)."""
    seen = []
    weights, scheduler = train(1, tmp_path, 2, PINNED,
                               on_attach=lambda s: seen.append(sorted(p.name for p in tmp_path.iterdir())))
    assert_same(reference(tmp_path, 2), weights)
    assert seen == [[]]  # planned and attached: nothing under --offload-dir
    assert scheduler._inline and scheduler.storage.file_path is None
    stats = list(scheduler.stats)
    assert all(s.stall_s == 0 and s.offload_cpu_s == 0 and s.onload_cpu_s == 0 for s in stats)
    assert scheduler.storage.bytes_written == sum(s.bytes_written for s in stats) > 0
    # the host budget decides the tier: one byte short of the swapped bytes, and the disk takes them
    _, small = train(1, tmp_path, 1, scheduler.storage.capacity_bytes - 1)
    assert isinstance(small.storage, SwapStorage) and not small._inline


@pytest.mark.parametrize("tier", [PINNED, DISK], ids=["pinned", "disk"])
def test_a_save_frees_its_device_bytes_only_behind_its_copy(tmp_path, monkeypatch, tier):
    """The bytes a save vacated are reused by later units at once (the copy is only queued), and the
    executor's stream waits for that copy before it overwrites them: without the wait the simulated
    copy runs later and takes the new occupant's values, and the weights change. (The disk tier's saver
    waits for its copy itself, to write it: its first wait is held until a forward has written into
    bytes a save freed, so the saver cannot win the race by chance.)"""
    waits = []
    overwritten = threading.Event()
    original_wait, original_finish = DeviceStaging.wait_copies, DeviceStaging.finish_save

    def recording(self, events):
        waits.append(list(events))
        original_wait(self, events)

    def finish_late(self, *args, **kwargs):
        overwritten.wait(timeout=30)
        original_finish(self, *args, **kwargs)

    def watch(scheduler):
        move_in, after_forward = scheduler._move_in_for_forward, scheduler.after_forward
        moved = []

        def watched_move_in(unit):
            move_in(unit)
            if unit.copy_waits[0]:
                moved.append(unit)

        def watched_after_forward(step, node=None):
            after_forward(step, node)
            if moved:  # a forward (its kernel has run: the simulator) wrote into bytes a save freed
                overwritten.set()

        scheduler._move_in_for_forward, scheduler.after_forward = watched_move_in, watched_after_forward

    monkeypatch.setattr(DeviceStaging, "finish_save", finish_late)
    monkeypatch.setattr(DeviceStaging, "wait_copies", recording)
    weights, _ = train(1, tmp_path, 2, tier, on_attach=watch)
    assert_same(reference(tmp_path, 2), weights)
    assert waits and all(events for events in waits)  # units were created in bytes a save had just vacated

    overwritten.clear()
    monkeypatch.setattr(DeviceStaging, "wait_copies", lambda self, events: None)  # the wait forgotten
    broken, _ = train(1, tmp_path, 2, tier, on_attach=watch)
    assert any(not np.array_equal(broken[key], weights[key]) for key in weights)


def test_a_load_from_pinned_memory_waits_for_its_save_copy(tmp_path, monkeypatch):
    """A load's copy stream waits for the save's copy of the same unit (and the executor's stream for the
    load): without it the simulated load reads the pinned slot before the save filled it."""
    loads = []
    original = DeviceStaging.load

    def recording(self, storage, records, span, file_offset, step=0, after=()):
        loads.append(list(after))
        return original(self, storage, records, span, file_offset, step, after)

    monkeypatch.setattr(DeviceStaging, "load", recording)
    train(1, tmp_path, 1, PINNED)
    assert loads and all(after for after in loads)

    monkeypatch.setattr(DeviceStaging, "wait_loaded", lambda self, event: None)  # the executor does not wait
    monkeypatch.setattr(DeviceStaging, "load", original)
    broken, _ = train(1, tmp_path, 1, PINNED)
    assert any(not np.array_equal(broken[key], reference(tmp_path, 1)[key]) for key in broken)


def test_the_saver_frees_device_bytes_before_it_waits_for_the_disk(tmp_path):
    """The disk tier: the saver queues a unit's copy, frees its device bytes, and only then waits for the
    copy and writes. The first write is held until the executor has created a unit in bytes a save
    freed; a saver that waited for its copy and its write before freeing the bytes (the synchronous
    save measured on the H200) would hold the executor, and the write would give up waiting."""
    moved_in = threading.Event()
    held = []

    def hold_first_write(operation, nbytes):
        if operation == "write" and not held:
            held.append(moved_in.wait(timeout=30))

    def watch(scheduler):
        original = scheduler._move_in_for_forward

        def move_in(unit):
            original(unit)
            if unit.copy_waits[0]:
                moved_in.set()

        scheduler._move_in_for_forward = move_in

    weights, scheduler = train(1, tmp_path, 1, DISK, delay=hold_first_write, on_attach=watch)
    assert held == [True]
    assert_same(reference(tmp_path, 1), weights)
    assert all(unit.state is LayerState.RELEASED for unit in scheduler._units.values())


def test_the_saver_stages_several_saves_while_the_gpu_is_behind(tmp_path, monkeypatch):
    """The disk tier's staging ring: while the oldest save's copy has not run (a GPU runs behind the host),
    the saver keeps queuing the next saves' copies and freeing their device bytes instead of waiting, and
    the writes still go out in order from the right buffers. Here no copy counts as run until the
    executor has created units in the bytes of two different saves; with one staging buffer (the saver
    waiting for each copy before the next) that never happens and the copies are let go after 30 s."""
    deadline, let_go = [], []
    both = threading.Event()

    def copy_done(self, copied):
        if not deadline:
            deadline.append(time.monotonic() + 30)
        if both.is_set():
            return True
        if time.monotonic() > deadline[0]:
            let_go.append(True)
            return True
        return False

    def watch(scheduler):
        move_in = scheduler._move_in_for_forward
        freed_by: set[int] = set()

        def watched_move_in(unit):
            move_in(unit)
            freed_by.update(id(event) for event in unit.copy_waits[0])
            if len(freed_by) >= 2:
                both.set()

        scheduler._move_in_for_forward = watched_move_in

    original_finish = DeviceStaging.finish_save

    def finish_when_run(self, *args, **kwargs):  # a GPU's event.synchronize(): blocks until the copy has run
        while not copy_done(self, None):
            time.sleep(0.001)
        original_finish(self, *args, **kwargs)

    monkeypatch.setattr(DeviceStaging, "copy_done", copy_done)
    monkeypatch.setattr(DeviceStaging, "finish_save", finish_when_run)
    weights, scheduler = train(1, tmp_path, 2, DISK, on_attach=watch)
    assert both.is_set() and not let_go
    assert_same(reference(tmp_path, 2), weights)

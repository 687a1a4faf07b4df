"""The staging ring's bookkeeping (engine/host_staging.py), with a stand-in GPU whose copies run late.

A real copy from pinned memory reads the host buffer when the GPU gets to it, not when it is issued. The
stand-in below does the same: ``copy`` only queues, and the queue runs when the test lets the "GPU"
progress or when the ring waits on an event. So a ring that refilled a buffer before its copy ran would
deliver the newer values twice, and the device would never see the older ones.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine.host_staging import DEPTH, HostTransport, StagingRing


class _Event:
    fired = False


class LateGPU:
    """Copies and events in one queue (a stream), run only by ``run`` or by a wait on an event."""

    def __init__(self):
        self.queue: list[tuple[str, object, object]] = []
        self.received: dict[int, list[np.ndarray]] = {}  # device target id -> every value it was given, in order
        self.allocations = 0

    def empty(self, shape, dtype):
        self.allocations += 1
        return np.full(shape, -1, dtype)

    def copy(self, target, host):
        self.queue.append(("copy", target, host))  # the host buffer itself: read when the copy runs

    def record(self, event):
        event = event or _Event()
        event.fired = False
        self.queue.append(("event", event, None))
        return event

    def done(self, event):
        return event.fired

    def wait(self, event):
        while not event.fired:
            self.run(1)

    def run(self, operations=None):
        count = len(self.queue) if operations is None else operations
        for _ in range(count):
            kind, a, b = self.queue.pop(0)
            if kind == "copy":
                a[...] = b
                self.received.setdefault(id(a), []).append(np.array(b))
            else:
                a.fired = True


def _steps(count):
    return [(np.full((2, 3), step, np.float32), np.full(2, 10 + step, np.int64)) for step in range(count)]


def _stage_all(ring, gpu, targets, steps, progress_every=None):
    for i, (x, y) in enumerate(steps):
        ring.stage([(targets[0], x), (targets[1], y)])
        x[...] = -7  # the caller reuses its arrays at once: the ring copied them
        if progress_every and i % progress_every == 0:
            gpu.run()
    gpu.run()


def test_the_host_waits_only_past_the_rings_depth_and_every_value_arrives():
    gpu = LateGPU()
    ring = StagingRing(gpu, depth=DEPTH)
    targets = [np.zeros((2, 3), np.float32), np.zeros(2, np.int64)]
    steps = _steps(DEPTH)
    for x, y in steps:  # a stalled GPU: the first DEPTH steps find free buffers
        ring.stage([(targets[0], x), (targets[1], y)])
    assert ring.waits == 0 and ring.staged == DEPTH and len(gpu.queue) == 3 * DEPTH
    x, y = np.full((2, 3), 99, np.float32), np.full(2, 99, np.int64)
    ring.stage([(targets[0], x), (targets[1], y)])  # step DEPTH reuses step 0's set: it waits for its copy
    assert ring.waits == 1
    assert [v[0, 0] for v in gpu.received[id(targets[0])]] == [0]  # only step 0's copies ran for that
    gpu.run()
    assert [v[0, 0] for v in gpu.received[id(targets[0])]] == [0, 1, 99]
    assert [v[0] for v in gpu.received[id(targets[1])]] == [10, 11, 99]
    assert gpu.allocations == 2 * DEPTH  # each set's buffers made once, reused after


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_many_steps_arrive_in_order_whatever_the_gpus_pace(depth):
    for progress_every in (None, 1, 3):
        gpu = LateGPU()
        ring = StagingRing(gpu, depth=depth)
        targets = [np.zeros((2, 3), np.float32), np.zeros(2, np.int64)]
        _stage_all(ring, gpu, targets, _steps(10), progress_every)
        assert [v[0, 0] for v in gpu.received[id(targets[0])]] == list(range(10))
        assert [v[0] for v in gpu.received[id(targets[1])]] == [10 + s for s in range(10)]
        if progress_every is None:
            assert ring.waits == 10 - depth  # a stalled GPU: every step past the depth waits


def test_a_ring_that_does_not_wait_delivers_overwritten_values():
    """The check above can fail: a transport that says every copy has run lets the ring refill a set whose
    copy is still queued, and the device receives the newer values in place of the older."""

    class Lying(LateGPU):
        def done(self, event):
            return True

    gpu = Lying()
    ring = StagingRing(gpu, depth=2)
    targets = [np.zeros((2, 3), np.float32), np.zeros(2, np.int64)]
    _stage_all(ring, gpu, targets, _steps(4))
    assert [v[0, 0] for v in gpu.received[id(targets[0])]] == [2, 3, 2, 3]


def test_shapes_and_dtypes_are_checked_and_new_shapes_get_their_own_buffers():
    ring = StagingRing(HostTransport())
    target = np.zeros(3, np.float32)
    with pytest.raises(ValueError, match=r"staging item 0: float64\(3,\) for a device array of float32\(3,\)"):
        ring.stage([(target, np.zeros(3))])
    ring.stage([(target, np.arange(3, dtype=np.float32))])
    np.testing.assert_array_equal(target, [0, 1, 2])
    small = np.zeros(2, np.float32)
    ring.stage([(small, np.ones(2, np.float32))])
    assert sorted(k[1] for k in ring.sets[0].buffers) == [(3,)] and sorted(k[1] for k in ring.sets[1].buffers) == [(2,)]
    with pytest.raises(ValueError, match="at least one buffer set"):
        StagingRing(HostTransport(), depth=0)

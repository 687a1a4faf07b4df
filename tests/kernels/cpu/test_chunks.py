"""The conv drivers' work is taken by whichever thread is free (kernels/cpu/threads.py ``run_chunks``).

With offload on, the IO threads take a core now and then; a share the pool's thread has not started
(it is still waking up, or its core is taken) runs on the calling thread instead of being waited for.
Which thread runs a chunk must not change a bit of the result.
"""

import threading

import numpy as np
import pytest
from numba import get_num_threads, set_num_threads

from kernels.cpu import conv, spin, threads


@pytest.fixture
def two_threads():
    previous = get_num_threads()
    set_num_threads(2)
    yield
    set_num_threads(previous)


class _Hold:
    """A hand-out that keeps the pool's thread (slot 1) until released."""

    slots = 2
    cpu = -1  # (the caller's CPU at hand-out: none)

    def __init__(self) -> None:
        self.started, self.release, self.finished = threading.Event(), threading.Event(), threading.Event()

    def run(self, slot: int) -> None:
        self.started.set()
        self.release.wait(60)
        self.finished.set()


@pytest.fixture
def busy_pool():
    """The pool's only thread is held by another job until the test ends: every chunk runs on the caller."""
    hold = _Hold()
    threads._get_pool(1).hand_out(hold)
    assert hold.started.wait(10)
    yield
    hold.release.set()
    assert hold.finished.wait(10)


def test_chunks_run_once_each_with_the_slot_of_the_thread_that_took_them():
    seen: list[tuple[int, int]] = []
    lock = threading.Lock()

    def work(chunk: int, slot: int) -> None:
        assert threading.current_thread() is threading.main_thread() or slot > 0
        with lock:
            seen.append((chunk, slot))

    threads.run_chunks(work, 9, 2)
    assert sorted(chunk for chunk, _ in seen) == list(range(9))
    assert {slot for _, slot in seen} <= {0, 1}


def test_a_share_the_pool_has_not_started_runs_on_the_calling_thread(busy_pool):
    """Before, the caller waited for the pool's thread to run share 1: with that thread busy, forever."""
    ran: list[tuple[int, str]] = []
    done = threading.Event()

    def call() -> None:
        threads.run_shares(lambda t: ran.append((t, threading.current_thread().name)), 2)
        done.set()

    caller = threading.Thread(target=call, name="caller")
    caller.start()
    assert done.wait(10), "run_shares waited for a pool thread that was busy elsewhere"
    assert sorted(ran) == [(0, "caller"), (1, "caller")]


def test_an_error_in_a_chunk_is_raised_after_every_chunk_finished():
    finished: list[int] = []

    def work(chunk: int, slot: int) -> None:
        if chunk == 1:
            raise ValueError("chunk 1 failed")
        finished.append(chunk)

    with pytest.raises(ValueError, match="chunk 1 failed"):
        threads.run_chunks(work, 6, 2)
    assert sorted(finished) == [0, 2, 3, 4, 5]


@pytest.mark.parametrize("items, per_chunk, count",
                         [(32, 16, 2), (32, 4, 8), (32, 1, 8), (128, 16, 8), (3, 1, 3), (1, 1, 1)])
def test_chunk_count(items, per_chunk, count):
    assert threads.chunk_count(items, per_chunk, 2) == count


SHAPES = [  # (x, w, stride, pad): the chunked paths' forward, backward-data and weight gradient
    ((12, 24, 8, 8), (40, 24, 1, 1), 1, 0),  # 1×1 on 8×8 planes: v27's row blocks; the weight gradient v16's split
    ((10, 16, 16, 16), (24, 16, 1, 1), 1, 0),  # 1×1 on 16×16: row blocks; the weight gradient split over dW (v27)
    ((9, 3, 20, 20), (8, 3, 7, 7), 2, 3),  # a 7×7 stride-2 stem: conv_stem's chunks (v39, forward since v42), im2col
]


@pytest.mark.parametrize("x_shape, w_shape, stride, pad", SHAPES)
def test_the_same_bits_whichever_thread_runs_the_chunks(two_threads, request, x_shape, w_shape, stride, pad):
    rng = np.random.default_rng(0)
    x = rng.standard_normal(x_shape).astype(np.float32)
    w = rng.standard_normal(w_shape).astype(np.float32)
    out_shape = (x_shape[0], w_shape[0], *conv.check_conv2d_shapes(x_shape, w_shape, stride, pad, 1))
    dout = rng.standard_normal(out_shape).astype(np.float32)
    pointwise = w_shape[2] == 1
    assert conv.path(x_shape, w_shape, stride, pad, 1, "forward") == ("pointwise" if pointwise else "stem-strided")
    assert conv.path(x_shape, w_shape, stride, pad, 1, "data") == ("pointwise" if pointwise else "gemm")

    def run() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        out, dx, dw = np.empty(out_shape, np.float32), np.empty_like(x), np.empty_like(w)
        size = max(conv.conv2d_forward_workspace_size(x_shape, w_shape, stride, pad, 1),
                   conv.conv2d_backward_data_workspace_size(x_shape, w_shape, stride, pad, 1),
                   conv.conv2d_backward_weight_workspace_size(x_shape, w_shape, stride, pad, 1))
        scratch = np.full(size, np.nan, np.float32)
        conv.conv2d_forward(x, w, None, out, stride, pad, 1, scratch)
        conv.conv2d_backward_data(dout, w, dx, stride, pad, 1, scratch)
        conv.conv2d_backward_weight(x, dout, dw, None, stride, pad, 1, scratch)
        return out, dx, dw

    shared = [run() for _ in range(3)]  # chunks spread over both threads, as the pool wakes
    request.getfixturevalue("busy_pool")
    alone = run()  # every chunk on the calling thread, in slot 0's scratch
    for result in shared:
        for a, b in zip(result, alone):
            assert np.array_equal(a, b)


needs_spin = pytest.mark.skipif(not spin.SUPPORTED, reason="the awake wait is x86-64 Linux only")


@needs_spin
def test_the_awake_wait_sees_another_threads_store_and_gives_up_after_its_time():
    counter = spin.counter()
    per_us = spin.ticks_per_microsecond()
    assert per_us > 0
    assert spin.wait_for_change(counter, 0, int(200 * per_us)) == 0  # nothing changed: gives up
    counter[0] = 3
    assert spin.wait_for_change(counter, 0, int(200 * per_us)) == 3  # already changed: at once
    timer = threading.Timer(0.05, lambda: counter.__setitem__(0, 7))
    timer.start()
    assert spin.wait_for_change(counter, 3, int(5_000_000 * per_us)) == 7  # a store from another thread ends it
    timer.join()


@needs_spin
def test_an_awake_pool_thread_takes_the_next_hand_out_without_being_woken(monkeypatch):
    """A pool thread waits awake for SPIN_MICROSECONDS after a job (threads.py, "Pool threads wait
    awake"): with a long wait, back-to-back calls find it awake, and it never sleeps between them."""
    pool = threads._Pool(1, spin_microseconds=2_000_000)  # awake for up to 2 s between hand-outs
    try:
        ran: list[str] = []
        for _ in range(20):
            job = threads._Chunks(lambda c, slot: ran.append(threading.current_thread().name), 2, 2)
            pool.hand_out(job)
            job.run(0)
            job.done.wait(10)
        assert len(ran) == 40
        assert set(ran) <= {threading.current_thread().name, "conv_1"}
        assert pool.sleeps <= 1  # asleep before the first hand-out at most, never between two
    finally:
        pool.close()
    assert not any(thread.is_alive() for thread in pool.threads)


def test_a_sleeping_pool_thread_is_woken_by_a_hand_out():
    pool = threads._Pool(1, spin_microseconds=0)
    try:
        hold = _Hold()
        pool.hand_out(hold)
        assert hold.started.wait(10)
        hold.release.set()
        assert hold.finished.wait(10)
        for _ in range(50):  # until the thread is asleep again
            if pool.asleep[1]:
                break
            threading.Event().wait(0.01)
        assert pool.asleep[1]
        again = _Hold()
        pool.hand_out(again)
        assert again.started.wait(10)
        again.release.set()
    finally:
        pool.close()

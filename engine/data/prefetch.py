"""Batch streams: the training loop's batches, prepared ahead by a background thread into a ring.

In the spirit of DL4J's AsyncDataSetIterator: a producer thread gathers, normalizes and augments the
next ``depth`` batches while the network computes on the current one. The batches live in one
INPUT workspace with CIRCULAR reset: a ring of ``depth + 1`` batch slots, so preparing a batch
allocates nothing, and the memory a stream holds is fixed at its creation.

The rule that keeps this safe: a batch is valid until the next ``next()``. The consumer holds one
slot, the producer may fill the other ``depth``; it waits for the consumer to hand a slot back
before the ring comes round to it. Each batch is checked (``Tensor.check``) when it is handed out,
so a ring that ever overwrote a batch in use would raise, not train on garbage.

``depth=0`` turns the thread off: batches are filled in the caller's thread, into a ring of one
slot. Because batch contents are a function of (seed, epoch, index) alone, both give the same
batches in the same order, bit for bit.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.data.batches import BatchSource, step_position


@dataclass
class Batch:
    """One batch: ``x`` and ``y`` are backend arrays in the ring (valid until the next batch);
    ``y_host`` is the labels as a NumPy array (the same array on cpu)."""

    step: int
    epoch: int
    index: int
    x: Any
    y: Any
    y_host: np.ndarray
    valid_rows: int


def ring_bytes(batch_shape: tuple[int, ...], slots: int) -> int:
    """Bytes of a ring holding ``slots`` batches of images (float32) and labels (int64)."""
    from engine.memory import ALIGNMENT

    def aligned(n: int) -> int:  # the workspace places every tensor on an ALIGNMENT boundary
        return -(-n // ALIGNMENT) * ALIGNMENT

    x_bytes = int(np.prod(batch_shape)) * 4
    y_bytes = int(batch_shape[0]) * 8
    return slots * (aligned(x_bytes) + aligned(y_bytes))


_DONE = object()


class BatchStream:
    """Batches for global steps ``start`` .. ``stop - 1`` of ``source``; iterate it, then ``close()``.

    Step s is batch ``s % batches_per_epoch`` of epoch ``s // batches_per_epoch``, so a stream that
    starts at a resumed step serves exactly what an uninterrupted run would have served there.
    """

    def __init__(self, source: BatchSource, backend: Any, start: int, stop: int, depth: int = 2, name: str = "input"):
        from engine.memory import ArrayType, LearningPolicy, ResetPolicy, SpillPolicy, Workspace, WorkspaceConfig

        if depth < 0:
            raise ValueError(f"prefetch depth must be >= 0, got {depth}")
        self.source, self.backend = source, backend
        self.start, self.stop, self.depth = start, stop, depth
        self._next_step = start
        slots = depth + 1
        config = WorkspaceConfig(
            initial_size=ring_bytes(source.batch_shape, slots),
            learning=LearningPolicy.NONE,
            reset=ResetPolicy.CIRCULAR,
            spill=SpillPolicy.FAIL,  # the ring is sized exactly: needing more is a bug, not a reason to allocate
        )
        self.workspace = Workspace(backend, f"{name}-ring", config)
        self._input = ArrayType.INPUT
        self._ring_lock = threading.Lock()  # the producer allocates, the consumer checks: one at a time
        self._host_staging: np.ndarray | None = None
        self._held: tuple[Any, Any] | None = None
        self._closed = False
        self.workspace.enter()  # a ring is opened once and never reset: it wraps
        self._thread: threading.Thread | None = None
        if depth > 0:
            self._free_slots = threading.Semaphore(slots)  # taken by the producer, given back by the consumer
            self._ready: queue.Queue = queue.Queue()
            self._stop_event = threading.Event()
            self._thread = threading.Thread(target=self._produce, name=f"{name}-prefetch", daemon=True)
            self._thread.start()

    # --- producing ---------------------------------------------------------------------------------

    def _fill(self, step: int) -> tuple[int, Any, Any, np.ndarray]:
        epoch, index = step_position(step, self.source.batches_per_epoch)
        with self._ring_lock:
            x = self.workspace.create(self.source.batch_shape, np.float32, self._input)
            y = self.workspace.create((self.source.batch_size,), np.int64, self._input)
        if self.backend.is_device:  # fill on the host, then one copy per array into the device ring
            if self._host_staging is None:  # one filler at a time (the producer, or the caller at depth 0)
                self._host_staging = np.empty(self.source.batch_shape, np.float32)
            host_y = np.empty(self.source.batch_size, np.int64)  # handed out with the batch: its own
            self.source.fill(epoch, index, self._host_staging, host_y)
            x.array.set(self._host_staging)  # CuPy's host-to-device copy into existing memory
            y.array.set(host_y)
            return step, x, y, host_y
        self.source.fill(epoch, index, x.array, y.array)
        return step, x, y, y.array

    def _produce(self) -> None:
        try:
            for step in range(self.start, self.stop):
                while not self._free_slots.acquire(timeout=0.1):
                    if self._stop_event.is_set():
                        return
                if self._stop_event.is_set():
                    return
                self._ready.put(self._fill(step))
            self._ready.put(_DONE)
        except BaseException as exc:  # hand the error to the consumer instead of dying silently
            self._ready.put(exc)

    # --- consuming ---------------------------------------------------------------------------------

    def __iter__(self) -> BatchStream:
        return self

    def __next__(self) -> Batch:
        if self._closed or self._next_step >= self.stop:
            raise StopIteration
        if self._thread is None:
            item = self._fill(self._next_step)
        else:
            if self._held is not None:
                self._free_slots.release()  # the previous batch is done with: its slot may be refilled
            item = self._ready.get()
            if item is _DONE:
                raise StopIteration
            if isinstance(item, BaseException):
                raise item
        step, x, y, y_host = item
        with self._ring_lock:
            x.check("BatchStream", "batch images")
            y.check("BatchStream", "batch labels")
        self._held = (x, y)
        self._next_step = step + 1
        epoch, index = step_position(step, self.source.batches_per_epoch)
        return Batch(step, epoch, index, x.array, y.array, y_host, self.source.valid_rows(index))

    def close(self) -> None:
        """Stop the producer and release the ring."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self._stop_event.set()
            self._thread.join()
        release = getattr(self.source, "close", None)  # a source decoding on threads (image folders) stops them
        if release is not None:
            release()
        self.workspace.destroy(released_by="BatchStream.close()")

    def __enter__(self) -> BatchStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

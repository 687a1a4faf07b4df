"""``--offload-params``: the optimizer's state goes to disk while forward and backward run.

The optimizer updates every parameter in one pass over the contiguous blocks, so at the update all
parameters, gradients and optimizer state must be in memory. Between two updates the optimizer
state (SGD's momentum, Adam's two moments: one to two times the parameters' bytes) is read by
nobody: for the whole forward and backward it is "far from the executing layer". So after each
update it is written once (only when an update changed it: ``optimizer.steps_taken`` moved), its
pages are handed back to the OS (``madvise(MADV_DONTNEED)`` on the page-aligned part of the block),
and it is read back ``lookahead`` steps before the backward ends, in time for the next update.

Parameters themselves stay resident: every forward and every backward reads them, and the update
writes all of them at once.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from engine.offload.storage import PAGE, DelayHook, SwapRecord, SwapStorage, format_bytes

log = logging.getLogger("engine.offload")

MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", 4)


def page_interior(array: np.ndarray) -> tuple[int, int]:
    """The byte range [start, stop) of ``array`` that covers whole pages of memory (may be empty)."""
    address = array.ctypes.data
    first = (address + PAGE - 1) // PAGE * PAGE
    last = (address + array.nbytes) // PAGE * PAGE
    return (first - address, max(first, last) - address)


class OptimizerStateOffload:
    """A network hook that keeps the optimizer state on disk during forward and backward."""

    def __init__(self, optimizer: Any, directory: str | None = None, lookahead: int = 4,
                 delay: DelayHook | None = None):
        backend = optimizer.backend
        if backend.is_device:
            raise ValueError("--offload-params works on the cpu and cudasim backends: on a GPU the optimizer "
                             "state lives in device memory")
        self.optimizer = optimizer
        self.lookahead = max(1, int(lookahead))
        state = optimizer.state
        self.flat = None if state is None else np.asarray(state.flat).reshape(-1).view(np.uint8)
        start, stop = page_interior(self.flat) if self.flat is not None else (0, 0)
        self.region = None if stop <= start else self.flat[start:stop]
        self.storage = None
        self.pool: ThreadPoolExecutor | None = None
        self._pending: list[Future] = []
        self._load_submitted = False
        self._written_at: int | None = None  # optimizer.steps_taken when the disk copy was made
        self._evicted = False
        self._load_step: int | None = None
        self._steps_total = 0
        self.bytes_written = 0
        self.bytes_read = 0
        if self.region is not None:
            self.storage = SwapStorage(self.region.nbytes, directory, delay=delay)
            self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-offload-state")
            self._records = [SwapRecord(0, self.region.nbytes, "optimizer", f"{optimizer.name} state")]
            log.info("offload params: optimizer state %s goes to disk between updates",
                     format_bytes(self.region.nbytes))

    @property
    def active(self) -> bool:
        return self.region is not None

    # -- hooks -----------------------------------------------------------------------------------

    def on_iteration_start(self, net: Any) -> None:
        if not self.active:
            return
        self._finish()
        self._make_resident()  # a step that failed half-way may have left it on disk
        self._steps_total = 2 * len(net.graph.nodes)
        self._load_step = max(self._steps_total // 2, self._steps_total - 1 - self.lookahead)
        self._load_submitted = False
        self._pending.append(self.pool.submit(self._save_and_evict))

    def before_backward(self, step: int, node: Any) -> None:
        if self.active and step == self._load_step:
            self._load_later()

    def on_iteration_end(self, net: Any) -> None:
        if not self.active:
            return
        self._load_later()
        self._finish()  # the update runs next: the state must be back

    # -- work ------------------------------------------------------------------------------------

    def _save_and_evict(self) -> None:
        steps = self.optimizer.steps_taken
        if self._written_at != steps:  # an update changed it since the last write
            self.storage.write(self._records, self.region, 0)
            self.bytes_written += self.region.nbytes
            self._written_at = steps
        _madvise(self.region, MADV_DONTNEED)
        self._evicted = True

    def _load(self) -> None:
        if self._evicted:
            self.storage.read(self._records, self.region, 0)
            self.bytes_read += self.region.nbytes
            self._evicted = False

    def _load_later(self) -> None:
        """Queue the read (the one worker runs it after a save still in progress); never waits."""
        if not self._load_submitted:
            self._load_submitted = True
            self._pending.append(self.pool.submit(self._load))

    def _finish(self) -> None:
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()  # raises what the worker raised (a checksum mismatch, a full disk)

    def _make_resident(self) -> None:
        if self._evicted:
            self._load()

    def close(self) -> None:
        """Bring the state back (an interrupted step may have left it on disk) and remove the swap file."""
        if not self.active:
            return
        try:
            self._finish()
            self._make_resident()
        finally:
            self.pool.shutdown(wait=True)
            self.storage.close()


def _madvise(array: np.ndarray, advice: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.madvise(ctypes.c_void_p(array.ctypes.data), array.nbytes, advice) != 0:
        raise OSError(ctypes.get_errno(), "madvise failed on the optimizer state")

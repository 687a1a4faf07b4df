"""ParallelInference: many threads call ``predict(x)``; K worker threads answer them (after DL4J's class).

    with ParallelInference(lambda: load_my_net(), workers=2, mode="batched", max_batch=32) as pi:
        logits = pi.predict(images)          # from any number of threads at once

Requests go into one queue (at most ``queue_limit`` waiting: ``predict`` blocks beyond that, the
back-pressure of DL4J's ``queueLimit``). A worker takes the oldest request and, in ``"batched"``
mode, keeps taking more until the rows reach ``max_batch`` or ``max_wait_ms`` have passed since it
took the first (DL4J's BATCHED mode); ``"sequential"`` runs each request alone (SEQUENTIAL). It
runs the batch through its own replica of the network in inference mode and hands every caller its
own rows. A request that would overflow ``max_batch`` waits for the next batch; a request larger
than ``max_batch`` runs alone.

**One parameter block.** ``net_factory`` is called once per worker (a Network has its own workspaces
and per-iteration state, so one per thread); every replica's layers are then re-pointed at the first
network's PARAMETERS and buffers blocks, so all workers read one read-only copy of the weights, and
weights loaded into the first network are what every worker uses. (Each replica's own blocks, made
by the factory, stay allocated but unread: the engine's Network has no way to be built without them.)

**Threads and the GIL.** Two workers are only faster than one if kernels run while another thread
holds the GIL: every CPU kernel is compiled ``nogil=True`` (kernels/cpu), and the GEMMs inside them
call OpenBLAS, which does not take the GIL either. Numba's thread count is per calling thread, so
each worker runs its kernels on ``threads_per_worker`` threads (default: cores / workers). BLAS's
pool is one per process and a multithreaded OpenBLAS called from two threads at once serializes
them and spins: two threads predicting a cnn concurrently took 13× the CPU of one thread doing both
in turn until BLAS was held to one thread (measured, 2 cores). So with more than one worker BLAS
runs single-threaded (the kernels' parallelism is Numba's) while the ParallelInference is open, and
``close()`` restores it. The warm-up predict in the constructor matters for this: the kernel table
loads SciPy's OpenBLAS on first use, and ``threadpool_limits`` only limits libraries already loaded.
Each batch's logits do not depend on what runs beside it, but a row's
logits can differ in the last bits from ``net.predict`` on that row alone when its batch has other
rows (BLAS blocks the GEMM by the batch's row count): ``tests/parallel/test_inference.py`` measures it.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

MODES = ("batched", "sequential")
_STOP = object()


@dataclass
class _Request:
    x: np.ndarray
    future: Future = field(default_factory=Future)

    @property
    def rows(self) -> int:
        return int(self.x.shape[0])


@dataclass
class InferenceStats:
    """What the workers did: requests answered, batches run, rows in them."""

    requests: int = 0
    batches: int = 0
    rows: int = 0

    @property
    def mean_batch_rows(self) -> float:
        return self.rows / self.batches if self.batches else 0.0


def share_parameters(master: Any, replica: Any) -> None:
    """Point every layer of ``replica`` at ``master``'s parameter and buffer views (same graph required)."""
    if [n.name for n in master.graph.nodes] != [n.name for n in replica.graph.nodes]:
        raise ValueError("net_factory must build the same network every time (the layer names differ)")
    if master.parameters.offsets != replica.parameters.offsets:
        raise ValueError("net_factory must build the same network every time (the parameter shapes differ)")
    for node in replica.graph.nodes:
        layer = node.layer
        params = {spec.name: master.parameters.views[layer.tensor_key(node.name, spec.name)]
                  for spec in layer.parameter_specs()}
        buffers = {spec.name: master.buffers.views[layer.tensor_key(node.name, spec.name)]
                   for spec in layer.buffer_specs()}
        layer.bind(replica.backend, replica.inference_mgr, params, layer.grads, buffers)
    replica.parameters, replica.buffers = master.parameters, master.buffers


class ParallelInference:
    """Concurrent ``predict`` over ``workers`` threads; see the module docstring."""

    def __init__(
        self,
        net_factory: Callable[[], Any],
        workers: int = 2,
        mode: str = "batched",
        max_batch: int = 32,
        max_wait_ms: float = 2.0,
        queue_limit: int = 64,
        threads_per_worker: int | None = None,
    ):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if workers < 1 or max_batch < 1 or queue_limit < 1 or max_wait_ms < 0:
            raise ValueError(
                f"need workers >= 1, max_batch >= 1, queue_limit >= 1 and max_wait_ms >= 0; got {workers}, "
                f"{max_batch}, {queue_limit}, {max_wait_ms}"
            )
        from threadpoolctl import threadpool_limits

        self.mode, self.max_batch, self.max_wait = mode, max_batch, max_wait_ms / 1000.0
        self.threads_per_worker = threads_per_worker or max(1, (os.cpu_count() or 1) // workers)
        self.nets = [net_factory() for _ in range(workers)]
        for replica in self.nets[1:]:
            share_parameters(self.nets[0], replica)
        self.input_shape = tuple(self.nets[0].graph.input_shape)
        # One image through every replica first: it loads the kernel modules (and the BLAS they call,
        # which threadpool_limits can only limit once loaded), compiles or loads the kernels and sizes
        # the workspaces, so the first callers do not pay for it.
        warm = np.zeros((1, *self.input_shape), dtype=np.float32)
        for net in self.nets:
            net.predict(warm)
        self.stats = InferenceStats()
        self._stats_lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue(maxsize=queue_limit)
        self._closed = False
        self._blas = threadpool_limits(limits=1 if workers > 1 else self.threads_per_worker, user_api="blas")
        self._threads = [
            threading.Thread(target=self._work, args=(net,), name=f"inference-{i}", daemon=True)
            for i, net in enumerate(self.nets)
        ]
        for thread in self._threads:
            thread.start()

    @property
    def workers(self) -> int:
        return len(self.nets)

    # --- callers -----------------------------------------------------------------------------------

    def submit(self, x: np.ndarray) -> Future:
        """Queue ``x`` (N×C×H×W, or one C×H×W image) and return a Future of its N×classes logits."""
        if self._closed:
            raise RuntimeError("ParallelInference is closed")
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.shape == self.input_shape:
            x = x[None]
        if tuple(x.shape[1:]) != self.input_shape or x.shape[0] < 1:
            raise ValueError(f"expected input of shape (N, {', '.join(map(str, self.input_shape))}), got {x.shape}")
        request = _Request(x)
        self._queue.put(request)  # blocks while queue_limit requests wait: back-pressure
        return request.future

    def predict(self, x: np.ndarray, timeout: float | None = None) -> np.ndarray:
        """The logits of ``x`` (its own rows only), computed by whichever worker takes it."""
        return self.submit(x).result(timeout)

    def close(self) -> None:
        """Answer what is queued, stop the workers, restore BLAS's thread count."""
        if self._closed:
            return
        self._closed = True
        for _ in self._threads:
            self._queue.put(_STOP)
        for thread in self._threads:
            thread.join()
        self._blas.restore_original_limits()

    def __enter__(self) -> ParallelInference:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- workers -----------------------------------------------------------------------------------

    def _work(self, net: Any) -> None:
        import numba

        numba.set_num_threads(min(self.threads_per_worker, numba.config.NUMBA_NUM_THREADS))  # this thread only
        staging = np.empty((self.max_batch, *self.input_shape), dtype=np.float32)
        carry: Any = None
        stopping = False
        while not stopping:
            first = carry if carry is not None else self._queue.get()
            carry = None
            if first is _STOP:
                break
            batch, rows = [first], first.rows
            if self.mode == "batched":
                deadline = time.perf_counter() + self.max_wait
                while rows < self.max_batch:
                    remaining = deadline - time.perf_counter()
                    if remaining <= 0:
                        break
                    try:
                        item = self._queue.get(timeout=remaining)
                    except queue.Empty:
                        break
                    if item is _STOP:
                        stopping = True  # answer this batch, then end (this worker's one STOP)
                        break
                    if rows + item.rows > self.max_batch:
                        carry = item  # first of the next batch
                        break
                    batch.append(item)
                    rows += item.rows
            self._run(net, batch, rows, staging)
            if stopping and carry is not None:
                self._run(net, [carry], carry.rows, staging)

    def _run(self, net: Any, batch: list[_Request], rows: int, staging: np.ndarray) -> None:
        try:
            if len(batch) == 1:
                logits = net.predict(batch[0].x)
            else:
                x = staging[:rows]
                np.concatenate([r.x for r in batch], axis=0, out=x)
                logits = net.predict(x)
        except BaseException as exc:  # every caller of this batch gets the error; the worker goes on
            for request in batch:
                request.future.set_exception(exc)
            return
        with self._stats_lock:
            self.stats.requests += len(batch)
            self.stats.batches += 1
            self.stats.rows += rows
        start = 0
        for request in batch:
            request.future.set_result(logits[start : start + request.rows].copy())
            start += request.rows

"""One call per thread for the conv kernels: share 0 on the calling thread, the others on a small pool.

Why not Numba's ``prange``. A ``parallel=True`` function costs 2.5–6 s of compilation on a cold
cache (parfor passes), on top of the serial code it runs: in a cold ``engine train --model resnet18``
the five parallel conv drivers took 31 of the 37 s of compile CPU time, 4.8 s of
``gemm_forward``'s 10.9 s being its one-line ``prange`` wrapper. The per-thread work functions are
serial ``@njit(nogil=True)`` kernels; Python threads run them side by side (the GIL is released
inside), so the drivers need no parfor at all. A call costs a few tens of microseconds of
submission, against conv calls of milliseconds.

Each share is a fixed slice of the work, so results do not depend on which thread finishes first.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pool_size = 0


def _get_pool(workers: int) -> ThreadPoolExecutor:
    global _pool, _pool_size
    with _lock:
        if _pool is None or _pool_size < workers:
            if _pool is not None:
                _pool.shutdown(wait=True)
            _pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="conv")
            _pool_size = workers
        return _pool


def run_shares(work: Callable[[int], object], threads: int) -> None:
    """``work(t)`` for every ``t`` in ``range(threads)`` at the same time; returns when all are done.

    An exception in any share is raised here, after every share has finished."""
    if threads <= 1:
        work(0)
        return
    pool = _get_pool(threads - 1)
    futures = [pool.submit(work, t) for t in range(1, threads)]
    try:
        work(0)
    finally:
        for future in futures:
            future.result()

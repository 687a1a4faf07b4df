"""One call per thread for the conv kernels: share 0 on the calling thread, the others on a small pool.

Why not Numba's ``prange``. A ``parallel=True`` function costs 2.5–6 s of compilation on a cold
cache (parfor passes), on top of the serial code it runs: in a cold ``engine train --model resnet18``
the five parallel conv drivers took 31 of the 37 s of compile CPU time, 4.8 s of
``gemm_forward``'s 10.9 s being its one-line ``prange`` wrapper. The per-thread work functions are
serial ``@njit(nogil=True)`` kernels; Python threads run them side by side (the GIL is released
inside), so the drivers need no parfor at all. A call costs a few tens of microseconds of
submission, against conv calls of milliseconds.

Each share is a fixed slice of the work, so results do not depend on which thread finishes first.

**Numba's own pool sleeps when idle** (``start_numba_pool``). The other parallel kernels (batch
norm, element-wise, pooling, depthwise) still use ``prange`` on Numba's OpenMP pool, whose workers
spin after every parallel loop (GNU OpenMP: ~300,000 spins, about 5 ms here). On two cores that
spinning worker holds the core the conv share on this module's pool thread needs: ResNet-18's
training step (batch 32, 2 threads, `benchmarks/bench_train.py`) ran at 41–43 images/s with the
default and 51–53 with ``OMP_WAIT_POLICY=PASSIVE`` (GOMP_SPINCOUNT=3000: 52–52.5, within noise of
passive; 30,000: 51–52; the default 300,000: 42). That was the whole "regression" of the
Python-thread drivers: the last all-``prange`` tree ran at 53–58 on the same day, the thread drivers
alone at 42–43. The setting used to sit in ``kernels/cpu/__init__.py`` as an environment default,
but ``engine.threads.set_threads`` starts Numba's pool before that import, after which OpenMP never
reads the variable again; so the pool is now started here, on purpose, with the variable set.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_numba_pool_started = False


def start_numba_pool() -> None:
    """Start Numba's thread pool with its OpenMP workers sleeping when idle (``OMP_WAIT_POLICY``).

    OpenMP reads the variable once, when Numba's pool loads it, so this must run before anything
    else calls into Numba's threading (``numba.set_num_threads``, a ``prange`` kernel): both
    ``kernels.cpu`` (at import) and ``engine.threads`` call it first. The variable is set only for
    that moment and restored after (a value the user set is left alone), but the runtime it
    configured is the process's only one: a PyTorch imported later in the same process loads no
    ``libgomp.so.1`` of its own (the soname is already loaded) and runs on this passive one, and a
    PyTorch imported *before* this call makes Numba's pool run on torch's spinning runtime. So
    ``engine kernels --compare torch`` times torch in a process of its own
    (``engine.bench.kernels.TorchProcess``, with the figures). Idempotent; does nothing once the
    pool runs.
    """
    global _numba_pool_started
    if _numba_pool_started:
        return
    import numba

    with _lock:
        previous = os.environ.get("OMP_WAIT_POLICY")
        if previous is None:
            os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
        if "NUMBA_THREADING_LAYER" not in os.environ and "NUMBA_THREADING_LAYER_PRIORITY" not in os.environ:
            # OpenMP first: this module's tuning is OpenMP's (the wait policy above), and Numba's
            # default order puts TBB first, which the mkl dependency installs beside it.
            numba.config.THREADING_LAYER_PRIORITY = ["omp", "tbb", "workqueue"]
        try:
            numba.get_num_threads()  # launches the pool: the OpenMP runtime loads and reads the variable
        finally:
            if previous is None:
                del os.environ["OMP_WAIT_POLICY"]
        _numba_pool_started = True


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

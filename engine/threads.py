"""Thread counts: Numba's parallel kernels and the BLAS under them, set together.

The CPU kernels run ``prange`` loops on Numba's thread pool and call BLAS for their GEMMs; both
pools default to every core. The thread count decides how reductions are split, so the same seed
gives the same bits only with the same count: ``--threads`` pins both. On a busy machine, fewer
threads than cores is often faster (threads that spin waiting for a descheduled sibling waste it).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


def set_threads(count: int) -> None:
    """Use ``count`` threads for Numba kernels and for BLAS, from now on, in this process."""
    import numba
    from threadpoolctl import threadpool_limits

    from kernels.cpu.threads import start_numba_pool

    start_numba_pool()  # first: Numba's OpenMP workers sleep when idle only if started that way
    if count < 1:
        raise ValueError(f"thread count must be at least 1, got {count}")
    count = min(count, numba.config.NUMBA_NUM_THREADS)  # Numba cannot go past the pool it started with
    numba.set_num_threads(count)
    threadpool_limits(limits=count, user_api="blas")


@contextmanager
def threads(count: int) -> Iterator[None]:
    """Run a block with ``count`` threads for Numba and BLAS, then restore the previous counts."""
    import numba
    from threadpoolctl import threadpool_limits

    from kernels.cpu.threads import start_numba_pool

    start_numba_pool()
    previous = numba.get_num_threads()
    with threadpool_limits(limits=count, user_api="blas"):
        numba.set_num_threads(min(count, numba.config.NUMBA_NUM_THREADS))
        try:
            yield
        finally:
            numba.set_num_threads(previous)

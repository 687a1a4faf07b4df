"""A bounded wait, outside the GIL, for a counter to change: how ``threads``' pool threads wait for the
next hand-out before they fall asleep (why: ``threads``' docstring, "Pool threads wait awake").

``wait_for_change(counter, seen, ticks)`` polls ``counter[0]`` (an atomic acquire load, so the compiler
keeps it in the loop and sees a store made by another thread) until it differs from ``seen`` or
``ticks`` cycles of the CPU's time-stamp counter have passed, calling ``sched_yield`` between polls:
a thread that the scheduler placed on this CPU (Numba's OpenMP worker of a batch-norm kernel, an IO
thread) gets it at once instead of waiting for the spin to end. x86-64 Linux only (``SUPPORTED``);
elsewhere the pool threads sleep as before.
"""

from __future__ import annotations

import platform
import sys
import time

import numpy as np
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

SUPPORTED = sys.platform.startswith("linux") and platform.machine().lower() in ("x86_64", "amd64")


@intrinsic
def _load_acquire(typingctx, counter):
    """counter[0] as an atomic acquire load (never hoisted out of a loop)."""
    if not (isinstance(counter, types.Array) and counter.dtype == types.int64):
        return None

    def codegen(context, builder, signature, args):
        array = context.make_array(signature.args[0])(context, builder, args[0])
        return builder.load_atomic(array.data, "acquire", 8)

    return types.int64(counter), codegen


@intrinsic
def _cycles(typingctx):
    """The time-stamp counter (``llvm.readcyclecounter``: rdtsc on x86-64)."""

    def codegen(context, builder, signature, args):
        from llvmlite import ir

        function = builder.module.declare_intrinsic("llvm.readcyclecounter", fnty=ir.FunctionType(ir.IntType(64), []))
        return builder.call(function, [])

    return types.int64(), codegen


@intrinsic
def _sched_yield(typingctx):
    """libc's ``sched_yield()``, declared by name (a ctypes pointer would keep the kernel out of the cache)."""

    def codegen(context, builder, signature, args):
        from llvmlite import ir

        function = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(32), []), "sched_yield")
        return builder.call(function, [])

    return types.int32(), codegen


if SUPPORTED:

    @njit(cache=True, nogil=True)
    def wait_for_change(counter, seen, ticks):
        """counter[0] once it differs from ``seen``, or ``seen`` after ``ticks`` TSC cycles."""
        start = _cycles()
        while True:
            value = _load_acquire(counter)
            if value != seen:
                return value
            if _cycles() - start > ticks:
                return seen
            _sched_yield()

    @njit(cache=True, nogil=True)
    def cycles():
        return _cycles()

    @njit(cache=True, nogil=True)
    def yield_cpu():
        """One ``sched_yield()`` outside the GIL: a thread queued on this CPU runs now (``threads.run_chunks``)."""
        return _sched_yield()

else:  # pragma: no cover - other platforms

    def wait_for_change(counter, seen, ticks):
        return int(counter[0])

    def yield_cpu():
        return 0

    def cycles():
        return 0


_ticks_per_us: float | None = None


def ticks_per_microsecond() -> float:
    """The time-stamp counter's rate, measured once (20 ms against ``time.perf_counter``)."""
    global _ticks_per_us
    if _ticks_per_us is None:
        if not SUPPORTED:
            _ticks_per_us = 0.0
        else:
            cycles()  # compiled (or loaded) before the measurement
            t0, c0 = time.perf_counter(), cycles()
            time.sleep(0.02)
            t1, c1 = time.perf_counter(), cycles()
            _ticks_per_us = max(0.0, (c1 - c0) / ((t1 - t0) * 1e6))
    return _ticks_per_us


def counter() -> np.ndarray:
    """A fresh counter for ``wait_for_change``."""
    return np.zeros(1, np.int64)

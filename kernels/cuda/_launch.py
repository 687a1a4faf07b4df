"""What every CUDA launcher needs: grid sizes, float32 scalars, CuPy's stream, and argument checks.

Launchers take NumPy arrays (the simulator runs them in place) or CuPy arrays (real GPU: numba-cuda
reads them through ``__cuda_array_interface__``, no copy). CuPy is never imported at module level;
when an argument is a CuPy array the kernel runs on CuPy's current stream, so kernels and CuPy's own
work stay ordered.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
from numba import config, cuda

try:  # numba-cuda warns on every launch of fewer than 128 blocks: by design here (a 4x4 layer's grid is
    # small, the batch is folded into one launch), so on a real GPU the user's screen filled with it
    from numba.cuda.core import config as _cuda_config

    _cuda_config.CUDA_LOW_OCCUPANCY_WARNINGS = 0
    # A CuPy array's __cuda_array_interface__ names CuPy's current stream, and numba-cuda (0.30,
    # cudadrv/devicearray.py: _to_strided_memory_view) *synchronizes* that stream for every such array
    # argument of every launch unless this is off: each launch waited for the GPU to drain, so host and
    # GPU never overlapped, and a stream being captured into a CUDA graph may not be synchronized at all
    # (the capture fails). Every launch below runs on that very stream (``launch``), so stream order
    # already puts it after the work that wrote its arguments; work on other streams (offload's copies)
    # is ordered with events (engine/offload/staging.py).
    _cuda_config.CUDA_ARRAY_INTERFACE_SYNC = 0
except ImportError:  # the simulator or another numba-cuda layout: it does not warn
    pass

SIMULATOR_SWITCH_INTERVAL_S = 1e-4
"""Python's GIL switch interval under the simulator (the default is 5 ms; a real GPU leaves it alone).
The simulator runs each CUDA thread as a Python thread, and its block manager busy-polls them holding the
GIL: at every ``syncthreads`` each woken thread waited up to a whole interval for the GIL, so a launch cost
~(threads × barriers × 5 ms). Same launches, same results (no kernel may depend on thread scheduling);
measured on this 2-core machine under load ~7: batchnorm_train at 2×8×4×4 (8 blocks of 32 threads) 1.2–1.6 s
at 5 ms, 0.5–0.9 s at 1e-4 s; the cuda-graph test's 8 residual-block steps 34 s → 17 s. It needs
``_lock_simulator_shared_arrays`` below: threads now switch inside the simulator's own code."""


def _lock_simulator_shared_arrays() -> None:
    """Make the simulator's ``cuda.shared.array`` one allocation per block, whatever the thread switches.

    numba-cuda 0.30's ``FakeCUDAShared.array`` looks the block's array up by the caller's file and line and
    creates it when missing, without a lock: a thread switched out between the lookup and the store lets a
    second thread of the block create its own "shared" array, and the block's reduction then reads slots
    nobody wrote (seen as a conv gradient of 344.9 for 9.36 and a wrong batch-norm result: 3 of 16 runs of
    kernel test files failed with the switch interval forced to 2 µs, 0 of 37 with this lock; possible,
    rarely, at the default 5 ms too). Same key (file, line), same dynamic shared memory path, under one lock;
    the caller's frame is read directly instead of through ``traceback.extract_stack``, which read the
    source lines of the whole stack on every call.
    """
    import threading

    from numba.cuda.simulator import kernelapi

    shared = kernelapi.FakeCUDAShared
    unlocked = shared.array
    if getattr(unlocked, "engine_locked", False):
        return
    lock = threading.Lock()

    def array(self: Any, shape: Any, dtype: Any, alignment: Any = None) -> Any:
        if alignment is not None or shape == 0:  # the refusal and dynamic shared memory: no per-line lookup
            return unlocked(self, shape, dtype, alignment)
        if isinstance(dtype, kernelapi.types.Type):
            dtype = kernelapi.numpy_support.as_dtype(dtype)
        caller = sys._getframe(1)
        key = (caller.f_code.co_filename, caller.f_lineno)
        with lock:
            result = self._allocations.get(key)
            if result is None:
                result = self._allocations[key] = np.empty(shape, dtype)
        return result

    array.engine_locked = True  # type: ignore[attr-defined]
    shared.array = array


SIMULATOR_POLL_S = 5e-5
"""How long the simulator's block manager sleeps between two looks at its threads while some still run."""


def _poll_simulator_blocks_politely() -> None:
    """The simulator's block manager without its busy loop.

    numba-cuda 0.30's ``BlockManager.run`` starts one Python thread per CUDA thread of a block and then loops
    over them without pause until all are blocked at ``syncthreads`` (it releases them) or finished: that loop
    takes the GIL from the very threads it waits for. This one does the same checks in the same order of
    events (release when every live thread is blocked; re-raise a thread's exception, aborting the others)
    and sleeps ``SIMULATOR_POLL_S`` when nothing is to be done. Measured on this 2-core machine, quiet, a
    simulated conv forward at 2×8×4×4: 0.27–0.38 → 0.15–0.16 s a call, CPU 0.30–0.43 → 0.18–0.19 s; the
    suite's simulator stage runs beside the main one, so both gain."""
    import numpy as np
    from numba.cuda.simulator import kernel as simulator

    def run(self: Any, grid_point: Any, *args: Any) -> None:
        threads = []
        for block_point in np.ndindex(*self._block_dim):
            def target() -> None:
                self._f(*args)

            thread = simulator.BlockThread(target, self, grid_point, block_point, self._debug)
            thread.start()
            threads.append(thread)
        live = list(threads)
        while live:
            blocked = 0
            for thread in live:
                if thread.exception:  # abort the others, as numba-cuda does, and raise it here
                    for other in threads:
                        other.abort = True
                        other.syncthreads_blocked = False
                        other.syncthreads_event.set()
                    raise thread.exception[0].with_traceback(thread.exception[1])
                blocked += bool(thread.syncthreads_blocked)
            if blocked == len(live):  # every live thread waits at the barrier: release them
                for thread in live:
                    thread.syncthreads_blocked = False
                    thread.syncthreads_event.set()
            else:
                time.sleep(SIMULATOR_POLL_S)
            live = [thread for thread in live if thread.is_alive()]
        for thread in threads:
            if thread.exception:
                raise thread.exception[0].with_traceback(thread.exception[1])

    simulator.BlockManager.run = run


if config.ENABLE_CUDASIM:
    _lock_simulator_shared_arrays()
    _poll_simulator_blocks_politely()
    sys.setswitchinterval(SIMULATOR_SWITCH_INTERVAL_S)

# The integer casts the GEMM and conv kernels index with (``from kernels.cuda._launch import uint32``). On a
# GPU they are numba's types. In the simulator each would make a NumPy scalar, and every later operation on it
# is NumPy's scalar arithmetic: the rewritten tile loop (uint32 offsets, multiply-and-shift divisions) made a
# simulated conv forward 3.6× slower than v4's first form (0.25 → 0.90 s at 2×8×4×4), which took the
# simulator stage of the suite from 2 to 5 minutes. Here they are Python ints reduced to the type's range
# (two's complement for int64): the same values as the casts for every input, and Python's exact arithmetic
# after them, as numba's typing (uint32 with int64 → int64) has for the ranges the kernels use
# (``tests/kernels/cuda/test_casts.py``). 0.97 → 0.27 s on that conv.
def _wrap_unsigned(bits: int) -> Any:
    mask = (1 << bits) - 1

    def cast(value: Any) -> int:
        return int(value) & mask

    return cast


def _wrap_int64(value: Any) -> int:
    value = int(value) & 0xFFFFFFFFFFFFFFFF
    return value - (1 << 64) if value >> 63 else value


if config.ENABLE_CUDASIM:
    uint32, uint64, int64 = _wrap_unsigned(32), _wrap_unsigned(64), _wrap_int64
else:
    from numba import int64, uint32, uint64  # noqa: F401  (re-exported: the kernels' integer casts)



THREADS_PER_BLOCK = 256
"""Threads of a 1-D element-wise launch: a multiple of the 32-thread warp, enough to hide latency."""

MAX_REDUCTION_THREADS = 256
"""Size of every shared-memory reduction buffer; a block reducing fewer elements uses fewer threads."""

_external_streams: dict[int, Any] = {}

LAUNCHES: Counter[str] = Counter()
"""Kernel launches since the last ``reset_launches()``, by kernel name: every launch goes through
``launch`` below, so this is the exact count a GPU would see (the engine reports it per training step)."""

_count_only: list[bool] = [False]
_recorders: list[list[tuple[str, Any, Any, Any, tuple[Any, ...]]]] = []


def kernel_name(kernel: Any) -> str:
    """The Python name of a numba.cuda kernel (real dispatcher or simulator kernel)."""
    function = getattr(kernel, "py_func", None) or getattr(kernel, "fn", None) or kernel
    return getattr(function, "__name__", type(kernel).__name__)


def reset_launches() -> None:
    LAUNCHES.clear()


@contextmanager
def count_only() -> Iterator[Counter[str]]:
    """Count launches without running them (outputs stay unwritten): how a step's launch count is
    taken at batch 32 and 128 without a GPU. The count depends on shapes, never on values."""
    previous = _count_only[0]
    _count_only[0] = True
    try:
        yield LAUNCHES
    finally:
        _count_only[0] = previous


def blocks_for(count: int, threads: int = THREADS_PER_BLOCK) -> int:
    """Blocks needed so that one thread covers each of ``count`` items (at least one block)."""
    return max(1, (int(count) + threads - 1) // threads)


def reduction_threads(count: int) -> int:
    """Threads of a block that tree-reduces ``count`` numbers: a power of two, at most the buffer.

    The tree halves the active threads each step, so the count must be a power of two. A fixed
    count for a given problem size is what makes the sum's rounding identical on every run.
    """
    threads = 1
    while threads < count and threads < MAX_REDUCTION_THREADS:
        threads *= 2
    return threads


def f32(value: float) -> np.float32:
    """Scalars go to kernels as float32, so the kernel computes in float32 and compiles once."""
    return np.float32(value)


@contextmanager
def record_launches() -> Iterator[list[tuple[str, Any, Any, Any, tuple[Any, ...]]]]:
    """Collect (kernel name, kernel, blocks, threads, arguments) of every launch inside the block, in order.

    With ``count_only()`` this is how the roofline (engine/bench/roofline.py) learns every kernel a
    training step runs, with its real shapes, on a machine without a GPU.
    """
    calls: list[tuple[str, Any, Any, Any, tuple[Any, ...]]] = []
    _recorders.append(calls)
    try:
        yield calls
    finally:
        _recorders.remove(calls)


def _is_cupy(array: Any) -> bool:
    return type(array).__module__.split(".")[0] == "cupy"


_op_recorders: list[list[Any]] = []


@contextmanager
def record_operations(calls: list[Any]) -> Iterator[list[Any]]:
    """Inside the block, work that is not a kernel launch but that a captured graph holds (the simulator's
    offload copies and event waits, ``engine/offload/staging.py``) is recorded into ``calls`` too, in order
    with the launches, as ``(name, op, None, None, ())``: a replay calls ``op(state)`` with one dict per replay.
    Separate from ``record_launches`` so that its other readers (the roofline) see kernel launches only."""
    _op_recorders.append(calls)
    try:
        yield calls
    finally:
        _op_recorders.remove(calls)


def operation_recorder() -> list[Any] | None:
    """The list a non-launch operation is recorded into (``record_operations``), or None when not recording."""
    return _op_recorders[-1] if _op_recorders else None


def launch(kernel: Any, blocks: Any, threads: Any, *args: Any) -> None:
    """Run ``kernel[blocks, threads](*args)`` on CuPy's current stream when the arrays are CuPy's; count it."""
    name = kernel_name(kernel)
    LAUNCHES[name] += 1
    for calls in _recorders:
        calls.append((name, kernel, blocks, threads, args))
    if _count_only[0]:
        return
    if any(_is_cupy(a) for a in args):
        import cupy

        pointer = cupy.cuda.get_current_stream().ptr
        if pointer:
            stream = _external_streams.get(pointer)
            if stream is None:
                stream = _external_streams[pointer] = cuda.external_stream(pointer)
            kernel[blocks, threads, stream](*args)
            return
    kernel[blocks, threads](*args)


def pair_shape(value: Any, name: str) -> int:
    """Windows and strides are square: one int. Reject a pair with different sides clearly."""
    if isinstance(value, (tuple, list)):
        if len(value) != 2 or value[0] != value[1]:
            raise ValueError(f"{name}={value!r}: the CUDA kernels take one int for both sides (square windows)")
        value = value[0]
    return int(value)


def check_scratch(scratch: Any, needed: int, op: str) -> Any:
    """The first ``needed`` elements of the caller's 1-D float32 scratch buffer, or a clear error."""
    if needed == 0:
        return None
    if scratch is None or scratch.size < needed:
        have = 0 if scratch is None else scratch.size
        raise ValueError(
            f"{op}: scratch holds {have} float32 elements but this call needs {needed}; "
            f"size it with {op}_workspace_size(...)"
        )
    if scratch.dtype != np.float32 or scratch.ndim != 1:
        raise ValueError(f"{op}: scratch must be a 1-D float32 array, got {scratch.dtype} with shape {scratch.shape}")
    return scratch[:needed]

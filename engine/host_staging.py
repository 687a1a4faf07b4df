"""Per-step host values (a batch, its labels, the step's scalars, dropout masks) to fixed device arrays,
without the host waiting for the GPU.

A captured training step (``engine/cuda_graph.py``) is one graph launch plus the copies of what
changes every step into the device arrays the graph reads. CuPy's ``ndarray.set(values)`` from pageable
NumPy memory is a synchronous copy: it returned only when the stream's earlier work (the previous
replay) had run. On the H200 (2026-11-27, ResNet-18 CIFAR batch 32) that made "host µs per captured
step" read 25,347 µs of a 28.2 ms step: the host was waiting, not working, and could never queue the
next step while the GPU ran this one.

``StagingRing`` copies through pinned host buffers with asynchronous copies on the runner's stream,
so the host returns at once. A pinned buffer may be refilled only when the copy that reads it has
run, so each of the ``depth`` buffer sets carries an event recorded after its copies, and the host
waits on that event before writing the set again (PyTorch issue #106360 is this bug: a pinned buffer
reused before its copy ran). Stream order already serializes each copy after the step before it, so
the device arrays themselves need no second copy.

**Depth 2.** The stream runs, per step k, the copies C_k then the replay R_k; the event of a set is
recorded after its copies. With depth d, staging step k+d waits for C_k, which runs right after
R_{k-1}: the host waits until the GPU has finished step k-1, then queues step k+d. Depth 1 already lets
the host queue step k+1 while the GPU runs step k (one step ahead: the GPU never idles while the host's
step is shorter than the GPU's). Depth 2 (double buffering) adds one step of slack, so a host hiccup
shorter than a GPU step (Python's GC, a slow batch) does not leave the GPU idle; deeper rings only queue
more steps whose losses the host has not seen and pin more memory for no more overlap. A set is a
batch, its labels, three floats and the masks: 0.4 MB at ResNet-18 CIFAR batch 32.

Where the host waits is counted apart (``waits``, ``wait_seconds``): a GPU-bound run waits here every
step once the ring is full, which is the GPU's time, not the host's work.

The transports: ``CupyTransport`` (pinned memory from ``cupyx.empty_pinned``, ``ndarray.set(host,
stream=...)``: an asynchronous copy from pinned memory, events per set; the same calls offload's
staging makes, engine/offload/staging.py), ``HostTransport`` (the simulator: NumPy arrays, copies that
run when called). The tests drive the ring's bookkeeping with a transport whose copies run only when
the test's stand-in GPU gets to them, and read the host buffer then, as a DMA engine does.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

DEPTH = 2
"""Buffer sets of a ring: the host queues at most two steps past the one the GPU runs (module docstring)."""


class Transport(Protocol):
    """How a ring allocates host buffers, copies them to the device and knows when a copy has run."""

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray: ...
    def copy(self, target: Any, host: np.ndarray) -> None: ...
    def record(self, event: Any) -> Any: ...
    def done(self, event: Any) -> bool: ...
    def wait(self, event: Any) -> None: ...


class HostTransport:
    """The simulator's device arrays are NumPy arrays: a copy runs when it is issued, nothing to wait for."""

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        return np.empty(shape, dtype)

    def copy(self, target: Any, host: np.ndarray) -> None:
        target[...] = host

    def record(self, event: Any) -> Any:
        return None

    def done(self, event: Any) -> bool:
        return True

    def wait(self, event: Any) -> None:
        return None


class CupyTransport:
    """A GPU: pinned host buffers, asynchronous copies on ``stream`` (CuPy's current stream when None)."""

    def __init__(self, stream: Any = None):
        import cupy
        import cupyx

        self._cupy, self._cupyx = cupy, cupyx
        self.stream = stream

    def _stream(self) -> Any:
        return self.stream if self.stream is not None else self._cupy.cuda.get_current_stream()

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        return self._cupyx.empty_pinned(shape, dtype=dtype)

    def copy(self, target: Any, host: np.ndarray) -> None:
        target.set(host, stream=self._stream())  # pinned source + a stream: cudaMemcpyAsync, no host wait

    def record(self, event: Any) -> Any:
        if event is None:
            event = self._cupy.cuda.Event(block=False, disable_timing=True)
        event.record(self._stream())
        return event

    def done(self, event: Any) -> bool:
        return bool(event.done)

    def wait(self, event: Any) -> None:
        event.synchronize()


@dataclass
class _Set:
    buffers: dict[tuple[int, tuple[int, ...], str], np.ndarray] = field(default_factory=dict)
    event: Any = None  # recorded after this set's last copies; None before its first use
    pending: bool = False  # copies issued from this set that the host has not seen complete


@dataclass
class StagingRing:
    """``depth`` sets of host buffers in turn; ``stage`` writes one step's values into the next set and
    copies them to their device arrays, first waiting (only) for that set's previous copies."""

    transport: Transport
    depth: int = DEPTH
    sets: list[_Set] = field(default_factory=list)
    next: int = 0
    staged: int = 0  # stage() calls
    waits: int = 0  # of them, those where the set's previous copies had not run yet
    wait_seconds: float = 0.0  # host time spent in those waits

    def __post_init__(self) -> None:
        if self.depth < 1:
            raise ValueError(f"a staging ring needs at least one buffer set, got depth {self.depth}")
        self.sets = [_Set() for _ in range(self.depth)]

    def stage(self, items: Sequence[tuple[Any, np.ndarray]]) -> None:
        """Copy each ``(device target, host values)`` through this step's set. ``values`` may be any array
        the host owns; it is read before this returns (copied into the set's buffer), so the caller may
        reuse it at once."""
        current = self.sets[self.next]
        if current.pending:
            if not self.transport.done(current.event):
                start = time.perf_counter()
                self.transport.wait(current.event)
                self.wait_seconds += time.perf_counter() - start
                self.waits += 1
            current.pending = False
        for index, (target, values) in enumerate(items):
            values = np.asarray(values)
            if tuple(values.shape) != tuple(target.shape) or values.dtype != target.dtype:
                raise ValueError(f"staging item {index}: {values.dtype}{tuple(values.shape)} for a device array "
                                 f"of {target.dtype}{tuple(target.shape)}")
            key = (index, tuple(values.shape), values.dtype.str)
            host = current.buffers.get(key)
            if host is None:
                host = current.buffers[key] = self.transport.empty(tuple(values.shape), values.dtype)
            host[...] = values
            self.transport.copy(target, host)
        current.event = self.transport.record(current.event)
        current.pending = True
        self.next = (self.next + 1) % self.depth
        self.staged += 1

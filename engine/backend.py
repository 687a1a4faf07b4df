"""Backends: which array module holds the bytes, which kernel table runs on them, how to wait.

Layers never ask "which backend am I on?". They call ``backend.kernels.<op>(...)`` and the table
they get already points at the right implementation: Numba ``@njit`` kernels on ``cpu``,
``numba.cuda`` kernels on ``cuda`` (CuPy arrays) and on ``cudasim`` (NumPy arrays, the same CUDA
kernels run by Numba's simulator). ``auto`` picks ``cuda`` when CuPy sees a usable GPU, else ``cpu``.

Importing this module imports neither CuPy nor numba: both are loaded on first use, so
``import engine`` works on any machine, and ``cudasim`` can still set ``NUMBA_ENABLE_CUDASIM``
before numba is imported.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Protocol

import numpy as np

from engine.errors import UserError

BACKEND_NAMES = ("cpu", "cuda", "cudasim", "auto")


class BackendUnavailable(UserError, RuntimeError):
    """The backend asked for cannot run here; the message says why and what to do."""


class CaptureError(RuntimeError):
    """Something a captured CUDA graph cannot hold happened inside the capture (see ``Backend.capturing``)."""


class KernelTable:
    """The ops a backend offers, by name; every call validates and unwraps workspace tensors.

    An argument that knows how to hand itself to a kernel (an ``engine.memory.Tensor``) is asked
    for its array through ``kernel_array(op, argument)``, which raises a clear error when the tensor
    lives in a closed or reset workspace. Everything else (arrays, numbers, None) passes as it is.
    """

    def __init__(
        self, backend_name: str, functions: dict[str, Callable[..., Any]], launches: Counter[str] | None = None
    ):
        self.backend_name = backend_name
        self._functions = dict(functions)
        self._callers: dict[str, Callable[..., Any]] = {}
        self.launches = launches
        self._hook: Callable[..., Any] | None = None
        """GPU kernel launches by kernel name (the CUDA tables count every launch); None on the CPU."""

    def launch_count(self) -> int | None:
        """Total GPU kernel launches counted so far (None where the table launches no GPU kernels)."""
        return None if self.launches is None else sum(self.launches.values())

    def names(self) -> list[str]:
        return sorted(self._functions)

    def raw(self, op: str) -> Callable[..., Any]:
        """The kernel itself, without argument checks (for benchmarks)."""
        return self._functions[op]

    def __contains__(self, op: str) -> bool:
        return op in self._functions

    def __getattr__(self, op: str) -> Callable[..., Any]:
        if op.startswith("_"):
            raise AttributeError(op)
        caller = self._callers.get(op)
        if caller is None:
            try:
                function = self._functions[op]
            except KeyError:
                raise AttributeError(
                    f"backend {self.backend_name!r} has no kernel {op!r}; it has: {', '.join(self.names())}"
                ) from None
            caller = _checked_caller(op, function, self)
            self._callers[op] = caller
        return caller

    @contextmanager
    def intercept(self, hook: Callable[..., Any]) -> Iterator[None]:
        """Route every kernel call through ``hook(op, function, args, kwargs)`` inside the block.

        The hook must call ``function(*args, **kwargs)`` itself (and return its result); it sees the
        unwrapped arrays. The GPU acceptance run uses it to check each kernel of a real training
        step against the NumPy reference on the very same inputs (engine/bench/gpu_acceptance.py).
        """
        previous = self._hook
        self._hook = hook
        try:
            yield
        finally:
            self._hook = previous


def _checked_caller(op: str, function: Callable[..., Any], table: KernelTable) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        args = tuple(
            a.kernel_array(op, f"argument {i}") if hasattr(a, "kernel_array") else a
            for i, a in enumerate(args)
        )
        if kwargs:
            kwargs = {
                k: (v.kernel_array(op, k) if hasattr(v, "kernel_array") else v) for k, v in kwargs.items()
            }
        if table._hook is not None:
            return table._hook(op, function, args, kwargs)
        return function(*args, **kwargs)

    call.__name__ = op
    call.__doc__ = function.__doc__
    return call


class ComputeBackend(Protocol):
    """What the layers, the memory and offload need from a backend (``Backend`` is the one we ship; the
    tests wrap it to record kernel calls): the array module, the kernel table, blocks of bytes, host
    and device copies, and a way to wait for queued work."""

    name: str
    xp: Any

    @property
    def kernels(self) -> Any: ...
    @property
    def is_device(self) -> bool: ...
    def alloc_block(self, nbytes: int) -> Any: ...
    def synchronize(self) -> None: ...
    def to_host(self, array: Any) -> np.ndarray: ...
    def to_device(self, array: np.ndarray) -> Any: ...


@dataclass
class Backend:
    """What a layer needs from the hardware: arrays, blocks of bytes, kernels and a way to wait."""

    name: str
    xp: ModuleType
    _kernel_module: str
    _table: KernelTable | None = field(default=None, repr=False)
    capturing: bool = False
    """True while a step is being captured as a CUDA graph (engine/cuda_graph.py): nothing may then
    read the device or wait for it (a capturing stream cannot be synchronized, a device-to-host copy
    would be captured, not run) or allocate (the graph keeps the addresses it saw). Callers that would
    (the loss head) check this; the methods below refuse, so the simulator shows such a call."""

    @property
    def kernels(self) -> KernelTable:
        if self._table is None:
            module = importlib.import_module(self._kernel_module)
            self._table = KernelTable(self.name, module.TABLE, getattr(module, "LAUNCHES", None))
        return self._table

    @property
    def is_device(self) -> bool:
        """True when arrays live in GPU memory (copies to the host are needed to read them)."""
        return self.name == "cuda"

    def _not_capturing(self, what: str) -> None:
        if self.capturing:
            raise CaptureError(
                f"{what} while a step is being captured as a CUDA graph: a captured step may not allocate, copy "
                "between host and device or wait for the GPU; run this step eagerly (StepRunner(capture=False))"
            )

    def alloc_block(self, nbytes: int) -> Any:
        """One raw block of bytes; workspaces carve typed views out of it."""
        self._not_capturing(f"allocating {int(nbytes)} bytes")
        return self.xp.empty(int(nbytes), dtype=np.uint8)

    def synchronize(self) -> None:
        self._not_capturing("synchronize()")
        if self.name == "cuda":
            self.xp.cuda.get_current_stream().synchronize()

    def to_host(self, array: Any) -> np.ndarray:
        self._not_capturing("a copy to the host")
        if self.name == "cuda":
            return self.xp.asnumpy(array)
        return np.asarray(array)

    def to_device(self, array: np.ndarray) -> Any:
        self._not_capturing("a copy to the device")
        return self.xp.asarray(array)


def cuda_unavailable_reason() -> str | None:
    """Why the real CUDA backend cannot run here, or None when it can."""
    try:
        import cupy
    except ImportError:
        return "CuPy not installed (pip install 'numba-offload-engine[cuda]')"
    except Exception as exc:  # a broken CuPy install must not break the engine
        return f"CuPy failed to import: {exc}"
    if numba_cuda_missing():
        return NUMBA_CUDA_MISSING
    try:
        if not cupy.is_available():
            return "no GPU driver or no usable GPU (cupy.is_available() is False)"
    except Exception as exc:
        return f"no usable GPU: {exc}"
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return "NUMBA_ENABLE_CUDASIM=1 is set: numba.cuda is the simulator in this process"
    return None


NUMBA_CUDA_MISSING = ("numba-cuda is not installed (pip install -e '.[cudasim]' for the simulator, "
                      "'.[cuda]' for a GPU)")


def numba_cuda_missing() -> bool:
    """numba-cuda, the CUDA kernels' compiler and simulator, is an extra (issue 33: with its CUDA bindings it
    was 72 MiB of the base install, which trains on the cpu backend and never imports it)."""
    import importlib.util

    return importlib.util.find_spec("numba_cuda") is None


def cudasim_unavailable_reason() -> str | None:
    """Why the simulator cannot run in this process, or None when it can."""
    if numba_cuda_missing():
        return NUMBA_CUDA_MISSING
    if "numba" in sys.modules:
        from numba import config

        if not config.ENABLE_CUDASIM:
            return (
                "numba was already imported without NUMBA_ENABLE_CUDASIM=1; the variable is read once per "
                "process: start the process with NUMBA_ENABLE_CUDASIM=1 (for example "
                "'NUMBA_ENABLE_CUDASIM=1 python ...'), or use 'engine --backend cudasim ...', which sets it"
            )
    return None


def enable_cudasim() -> None:
    """Switch numba.cuda to the simulator for this process; must run before numba is imported."""
    reason = cudasim_unavailable_reason()
    if reason is not None:
        raise BackendUnavailable(f"cudasim: {reason}")
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"


def get_backend(name: str = "auto") -> Backend:
    """The backend called ``name``; raises BackendUnavailable with the reason when it cannot run."""
    if name not in BACKEND_NAMES:
        raise BackendUnavailable(f"unknown backend {name!r}: choose one of {', '.join(BACKEND_NAMES)}")
    if name == "auto":
        name = auto_choice()
    if name == "cpu":
        return Backend("cpu", np, "kernels.cpu")
    if name == "cudasim":
        enable_cudasim()
        return Backend("cudasim", np, "kernels.cuda")
    reason = cuda_unavailable_reason()
    if reason is not None:
        raise BackendUnavailable(f"cuda: {reason}. Use --backend cpu, or --backend cudasim to simulate.")
    import cupy

    return Backend("cuda", cupy, "kernels.cuda")


def counting_backend() -> Backend:
    """The CUDA kernel table on NumPy arrays, for counting and recording launches without running them.

    Only for use inside ``kernels.cuda.count_only()`` (engine/bench/cuda_launches.py, roofline.py):
    the launchers check shapes and count, nothing executes, so it needs neither a GPU nor the
    simulator, and the counts are those a GPU would see.
    """
    return Backend("cuda-count", np, "kernels.cuda")


def backend_report() -> dict[str, str | None]:
    """Each backend name → None when available, else the reason it is not."""
    cuda = cuda_unavailable_reason()
    return {
        "cpu": None,
        "cuda": cuda,
        "cudasim": cudasim_unavailable_reason(),
    }


def auto_choice() -> str:
    """The backend ``auto`` resolves to on this machine."""
    return "cuda" if cuda_unavailable_reason() is None else "cpu"

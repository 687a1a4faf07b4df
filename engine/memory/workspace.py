"""Workspace: one block of memory reused every cycle, handed out by bumping an offset.

A training step allocates the same tensors in the same order every time. Asking the allocator for
each of them again is wasted work (and on a GPU, fragmentation); a workspace instead owns one block,
hands out 64-byte aligned views into it, and on the next cycle starts again at offset 0. What it
needs is learned: the first cycle (``FIRST_LOOP``) or the first few (``OVER_TIME``) allocate
outside the block ("spill") and record their size, and at the end of learning one block of
``max × (1 + overallocation)`` bytes is allocated. From then on a cycle of the same shape makes no
allocation at all.

Scopes: ``with workspace:`` opens it and starts a new cycle (offset 0, generation + 1); leaving
closes it. Re-entering an open workspace only nests (no reset). ``borrow()`` opens it without a
reset, so tensors of the last cycle are usable again. ``reset()`` starts a new cycle while open.
Every tensor records the generation it was made in; using it after a reset or close raises
(see ``engine.memory.tensor``).

``ResetPolicy.CIRCULAR`` makes the block a ring for prefetch and offload windows: it is never reset,
an allocation that does not fit before the end wraps to offset 0 and the generation counts laps; a
tensor is stale only once the ring has come round and written over it.

Workspaces belong to one thread at a time. The per-thread registry (``get_or_create_workspace``)
finds workspaces by id, so two threads asking for "prefetch" get two workspaces.
"""

from __future__ import annotations

import enum
import math
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.memory.array_type import ArrayType
from engine.memory.tensor import ALWAYS_CHECK, CLOSED, RELEASED, Tensor, WorkspaceError

ALIGNMENT = 64  # bytes: a cache line, and what SIMD loads and GPU coalescing like


class LearningPolicy(enum.Enum):
    FIRST_LOOP = "first_loop"  # learn the size from the first cycle
    OVER_TIME = "over_time"  # learn the largest of the first `learning_cycles` cycles
    NONE = "none"  # never learn: the block is `initial_size`


class SpillPolicy(enum.Enum):
    EXTERNAL = "external"  # what does not fit is allocated outside the block
    REALLOCATE = "reallocate"  # ... and the block grows at the end of a cycle that outgrew it
    FAIL = "fail"  # what does not fit (after learning) raises WorkspaceFullError


class ResetPolicy(enum.Enum):
    BLOCK_LEFT = "block_left"  # every cycle starts at offset 0
    CIRCULAR = "circular"  # a ring: never reset, wraps to 0 when the end is reached


class DebugMode(enum.Enum):
    DISABLED = "disabled"
    SPILL_EVERYTHING = "spill_everything"  # every allocation outside the block; nothing learned
    BYPASS_EVERYTHING = "bypass_everything"  # workspace off: plain unmanaged arrays


class WorkspaceFullError(WorkspaceError):
    """An allocation did not fit and the spill policy is FAIL."""


class WorkspaceClosedError(WorkspaceError):
    """An allocation was asked of a workspace that is not open."""


@dataclass(frozen=True)
class WorkspaceConfig:
    """How a workspace sizes, grows and resets its block (sizes in bytes)."""

    initial_size: int = 0
    min_size: int = 0
    max_size: int | None = None
    overallocation: float = 0.3
    learning: LearningPolicy = LearningPolicy.FIRST_LOOP
    learning_cycles: int = 1  # OVER_TIME: how many cycles to observe before allocating
    spill: SpillPolicy = SpillPolicy.EXTERNAL
    reset: ResetPolicy = ResetPolicy.BLOCK_LEFT
    debug: DebugMode = DebugMode.DISABLED

    def __post_init__(self) -> None:
        if self.initial_size < 0 or self.min_size < 0:
            raise ValueError("WorkspaceConfig: initial_size and min_size must be >= 0")
        if self.max_size is not None and self.max_size < max(self.min_size, self.initial_size):
            raise ValueError(
                f"WorkspaceConfig: max_size ({self.max_size}) is below min_size ({self.min_size}) or "
                f"initial_size ({self.initial_size})"
            )
        if self.overallocation < 0:
            raise ValueError("WorkspaceConfig: overallocation is a fraction >= 0 (0.3 means 30% extra)")
        if self.learning_cycles < 1:
            raise ValueError("WorkspaceConfig: learning_cycles must be >= 1")
        if self.reset is ResetPolicy.CIRCULAR:
            if self.initial_size <= 0 or self.learning is not LearningPolicy.NONE:
                raise ValueError(
                    "WorkspaceConfig: a CIRCULAR workspace is a fixed ring: give it initial_size > 0 and "
                    "learning=LearningPolicy.NONE"
                )
            if self.spill is SpillPolicy.REALLOCATE:
                raise ValueError("WorkspaceConfig: a CIRCULAR ring cannot grow: use spill EXTERNAL or FAIL")

    @property
    def cycles_to_learn(self) -> int:
        if self.debug is not DebugMode.DISABLED or self.learning is LearningPolicy.NONE:
            return 0
        return 1 if self.learning is LearningPolicy.FIRST_LOOP else self.learning_cycles


@dataclass(frozen=True)
class WorkspaceStatistics:
    """A snapshot of one workspace's counters (bytes unless named otherwise)."""

    name: str
    capacity: int  # the block's size: what the workspace reserves
    in_use: int  # bytes handed out in the current cycle (0 when closed)
    this_cycle_bytes: int
    last_cycle_bytes: int
    max_cycle_bytes: int
    spilled_bytes: int  # cumulative, over the workspace's life
    spilled_count: int  # cumulative
    block_allocations: int  # cumulative: the first block and every reallocation
    peak_bytes: int  # the most bytes one cycle ever held (block and spills)
    generation: int
    cycles: int


_ALL_WORKSPACES: weakref.WeakSet[Workspace] = weakref.WeakSet()


def _align_up(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


_DTYPES: dict[Any, np.dtype] = {}


def _as_dtype(dtype: Any) -> np.dtype:
    """np.dtype(dtype), remembered: the lookup is most of the cost of a small allocation."""
    resolved = np.dtype(dtype)
    try:
        _DTYPES[dtype] = resolved
    except TypeError:  # an unhashable dtype description: resolve it every time
        pass
    return resolved


def _address(array: Any) -> int:
    interface = getattr(array, "__cuda_array_interface__", None) or array.__array_interface__
    return int(interface["data"][0])


class Workspace:
    """One block of bytes, a bump pointer, scopes with a generation counter, learning and spill policies."""

    def __init__(self, backend: Any, name: str, config: WorkspaceConfig | None = None):
        self.backend = backend
        self.name = name
        self.config = config if config is not None else WorkspaceConfig()
        self._circular = self.config.reset is ResetPolicy.CIRCULAR
        self._debug = self.config.debug
        self._block: Any = None  # aligned uint8 view of `capacity` bytes
        self._numpy_block = False
        # the fast path of create(): a plain (not circular, not debug) workspace that has a block
        self._fast = False
        self.capacity = 0
        self._offset = 0  # the bump pointer, a multiple of ALIGNMENT
        self._need = 0  # bytes this cycle would take inside a block (spills included)
        self.generation = 0
        self.live_generation = CLOSED  # the generation tensors must carry to be current
        self._depth = 0
        self._cycle_open = False
        self._borrowed = False
        self._cycles_done = 0
        self._learned = self.config.cycles_to_learn == 0
        self.last_cycle_bytes = 0
        self.max_cycle_bytes = 0
        self.spilled_bytes = 0
        self.spilled_count = 0
        self.block_allocations = 0
        self.peak_bytes = 0
        self._tag_live: dict[ArrayType | None, int] = {}
        self._tag_peak: dict[ArrayType | None, int] = {}
        self.released_by: str | None = None
        if self.config.initial_size > 0 and self._debug is DebugMode.DISABLED:
            self._allocate_block(self._clamp(_align_up(self.config.initial_size)))
        _ALL_WORKSPACES.add(self)

    # --- scopes -------------------------------------------------------------------------------------

    @property
    def is_open(self) -> bool:
        return self._depth > 0

    @property
    def is_released(self) -> bool:
        return self.live_generation == RELEASED

    def __enter__(self) -> Workspace:
        self.enter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.leave()

    def enter(self) -> None:
        """Open the workspace and start a new cycle; on an open workspace, only nest."""
        self.check_not_released()
        if self._depth > 0:
            self._depth += 1
            return
        self._depth = 1
        self._borrowed = False
        self._start_cycle()

    def leave(self) -> None:
        """Leave one scope; the outermost leave ends the cycle (learning happens here) and closes."""
        if self._depth == 0:
            raise WorkspaceError(f"workspace [{self.name}] left more often than entered")
        self._depth -= 1
        if self._depth == 0:
            if self._borrowed:
                self.last_cycle_bytes = self._need
                self.max_cycle_bytes = max(self.max_cycle_bytes, self._need)
                self._borrowed = False
            else:
                self._finish_cycle()
            self.live_generation = CLOSED

    def borrow(self) -> _Borrow:
        """Open without a reset: tensors of the current generation stay valid, new ones bump on from there."""
        return _Borrow(self)

    def reset(self) -> None:
        """End the current cycle and start the next one without closing (offset 0, generation + 1)."""
        if self._depth == 0:
            raise WorkspaceClosedError(f"workspace [{self.name}] is not open: reset() needs an open scope")
        if self._circular:
            return  # a ring is never reset; it wraps
        if self._borrowed:
            self._borrowed = False
        else:
            self._finish_cycle()
        self._start_cycle()

    def _start_cycle(self) -> None:
        self._cycle_open = True
        self._need = 0
        self._tag_live = {}
        if self._circular:
            self.live_generation = ALWAYS_CHECK
            return
        self.generation += 1
        self.live_generation = self.generation
        self._offset = 0

    def _finish_cycle(self) -> None:
        if not self._cycle_open:
            return
        self._cycle_open = False
        self.last_cycle_bytes = self._need
        self.max_cycle_bytes = max(self.max_cycle_bytes, self._need)
        self._cycles_done += 1
        if self._circular or self._debug is not DebugMode.DISABLED:
            return
        if not self._learned:
            if self._cycles_done >= self.config.cycles_to_learn:
                self._learned = True
                self._grow_to(self.max_cycle_bytes)
        elif self.config.spill is SpillPolicy.REALLOCATE and self._need > self.capacity:
            self._grow_to(self._need)

    def _grow_to(self, needed: int) -> None:
        size = self._clamp(_align_up(math.ceil(needed * (1.0 + self.config.overallocation))))
        if size > self.capacity:
            self._allocate_block(size)

    def _clamp(self, size: int) -> int:
        size = max(size, self.config.min_size)
        if self.config.max_size is not None:
            size = min(size, self.config.max_size)
        return size

    def _allocate_block(self, size: int) -> None:
        raw = self.backend.alloc_block(size + ALIGNMENT)
        shift = (-_address(raw)) % ALIGNMENT
        self._block = raw[shift : shift + size]
        self._numpy_block = isinstance(self._block, np.ndarray)
        self._fast = not self._circular and self._debug is DebugMode.DISABLED
        self.capacity = size
        self.block_allocations += 1
        self._offset = 0  # live tensors (if any) keep the old block alive; nothing here overlaps them

    def check_not_released(self) -> None:
        if self.live_generation == RELEASED:
            raise WorkspaceError(
                f"workspace [{self.name}] was destroyed ({self.released_by or 'released'}); create a new one"
            )

    def _ring_still_holds(self, tensor: Tensor) -> bool:
        """Circular only: has the ring come round and written over this tensor yet?"""
        if tensor.offset is None or tensor.generation == self.generation:
            return True
        return tensor.generation == self.generation - 1 and tensor.offset >= self._offset

    # --- allocation ---------------------------------------------------------------------------------

    def create(
        self, shape: tuple[int, ...] | int, dtype: Any = np.float32, array_type: ArrayType | None = None
    ) -> Tensor:
        """A tensor of ``shape`` and ``dtype`` from this cycle's memory (a view into the block, or a spill)."""
        if type(shape) is not tuple:  # tuples pass as they are: numpy checks their entries
            shape = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(map(int, shape))
        try:
            dtype = _DTYPES[dtype]
        except (KeyError, TypeError):  # first time for this dtype, or an unhashable description
            dtype = _as_dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        if self._depth == 0:
            self.check_not_released()
            raise WorkspaceClosedError(
                f"workspace [{self.name}] is not open: allocate inside `with workspace:` "
                f"(for a WorkspaceManager, inside `with mgr.iteration():`)"
            )
        start = self._offset
        if self._fast and start + nbytes <= self.capacity:
            # The common case, kept short: bump the pointer, account, and make one typed view.
            aligned = (nbytes + ALIGNMENT - 1) & -ALIGNMENT
            self._offset = start + aligned
            need = self._need = self._need + aligned
            if need > self.peak_bytes:
                self.peak_bytes = need
            live = self._tag_live[array_type] = self._tag_live.get(array_type, 0) + aligned
            if live > self._tag_peak.get(array_type, 0):
                self._tag_peak[array_type] = live
            if self._numpy_block:
                array = np.ndarray(shape, dtype, self._block, start)
            else:
                array = self._block[start : start + nbytes].view(dtype).reshape(shape)
            return Tensor(array, array_type, self, self.generation, start)
        if self._debug is DebugMode.BYPASS_EVERYTHING:
            return Tensor(self.backend.xp.empty(shape, dtype=dtype), array_type, None, 0, None)
        raw, offset = self._allocate(nbytes, array_type)
        return Tensor(raw.view(dtype).reshape(shape), array_type, self, self.generation, offset)

    def _allocate(self, nbytes: int, tag: ArrayType | None) -> tuple[Any, int | None]:
        aligned = _align_up(nbytes)
        self._need += aligned
        if self._need > self.peak_bytes:
            self.peak_bytes = self._need
        live = self._tag_live.get(tag, 0) + aligned
        self._tag_live[tag] = live
        if live > self._tag_peak.get(tag, 0):
            self._tag_peak[tag] = live
        if self._debug is DebugMode.SPILL_EVERYTHING:
            return self._spill(nbytes), None
        start = self._offset
        if self._circular:
            if nbytes > self.capacity:
                if self.config.spill is SpillPolicy.FAIL:
                    raise self._full_error(nbytes)
                return self._spill(nbytes), None
            if start + nbytes > self.capacity:  # wrap: a new lap over the ring
                self.generation += 1
                self._tag_live = {tag: aligned}
                start = 0
            self._offset = start + aligned
            return self._block[start : start + nbytes], start
        if self._block is not None and start + nbytes <= self.capacity:
            self._offset = start + aligned
            return self._block[start : start + nbytes], start
        if self._learned and self.config.spill is SpillPolicy.FAIL:
            raise self._full_error(nbytes)
        return self._spill(nbytes), None

    def _spill(self, nbytes: int) -> Any:
        self.spilled_bytes += nbytes
        self.spilled_count += 1
        return self.backend.alloc_block(nbytes)

    def _full_error(self, nbytes: int) -> WorkspaceFullError:
        return WorkspaceFullError(
            f"Workspace [{self.name}] is full: an allocation of {nbytes} bytes does not fit ({self._offset} of "
            f"{self.capacity} bytes in use) and its spill policy is FAIL. Raise initial_size or max_size, or use "
            f"SpillPolicy.EXTERNAL or SpillPolicy.REALLOCATE."
        )

    # --- accounting ---------------------------------------------------------------------------------

    def start_window(self) -> None:
        """Forget the per-ArrayType peaks; the manager opens one window per iteration."""
        self._tag_peak = dict(self._tag_live)

    def peak_by_tag(self) -> dict[ArrayType | None, int]:
        """The most bytes each ArrayType held at once since the last ``start_window()``."""
        return dict(self._tag_peak)

    def statistics(self) -> WorkspaceStatistics:
        return WorkspaceStatistics(
            name=self.name,
            capacity=self.capacity,
            in_use=self._need if self._depth > 0 else 0,
            this_cycle_bytes=self._need,
            last_cycle_bytes=self.last_cycle_bytes,
            max_cycle_bytes=self.max_cycle_bytes,
            spilled_bytes=self.spilled_bytes,
            spilled_count=self.spilled_count,
            block_allocations=self.block_allocations,
            peak_bytes=self.peak_bytes,
            generation=self.generation,
            cycles=self._cycles_done,
        )

    def destroy(self, released_by: str | None = None) -> None:
        """Drop the block; every tensor of this workspace now raises ReleasedTensorError."""
        if self.live_generation == RELEASED:
            return
        if self._depth > 0 and not self._borrowed:
            self._finish_cycle()
        self._depth = 0
        self._block = None
        self._fast = False
        self.capacity = 0
        self._tag_live = {}
        self.released_by = released_by
        self.live_generation = RELEASED

    def __repr__(self) -> str:
        state = "released" if self.is_released else ("open" if self.is_open else "closed")
        return f"Workspace({self.name!r}, {state}, capacity={self.capacity}, generation={self.generation})"


class _Borrow:
    """Context manager of ``Workspace.borrow()``."""

    def __init__(self, workspace: Workspace):
        self.workspace = workspace

    def __enter__(self) -> Workspace:
        ws = self.workspace
        ws.check_not_released()
        if ws._depth == 0:
            ws._borrowed = True
            ws.live_generation = ALWAYS_CHECK if ws._circular else ws.generation
        ws._depth += 1
        return ws

    def __exit__(self, *exc: object) -> None:
        self.workspace.leave()


def open_workspace_names() -> list[str]:
    """Names of every open workspace in the process (for the leaked-workspace error)."""
    return sorted(ws.name for ws in list(_ALL_WORKSPACES) if ws._depth > 0)


# --- the per-thread registry ------------------------------------------------------------------------

_thread_local = threading.local()


def _registry() -> dict[str, Workspace]:
    registry = getattr(_thread_local, "workspaces", None)
    if registry is None:
        registry = _thread_local.workspaces = {}
    return registry


def get_or_create_workspace(backend: Any, workspace_id: str, config: WorkspaceConfig | None = None) -> Workspace:
    """This thread's workspace called ``workspace_id``; created with ``config`` on first request.

    Asking again with a different configuration is an error: silently returning a workspace sized for
    someone else is how memory bugs hide.
    """
    registry = _registry()
    workspace = registry.get(workspace_id)
    if workspace is not None and not workspace.is_released:
        if config is not None and config != workspace.config:
            raise ValueError(
                f"workspace [{workspace_id}] already exists in thread {threading.current_thread().name!r} with "
                f"another configuration ({workspace.config}); destroy it first or use another id"
            )
        return workspace
    workspace = Workspace(backend, workspace_id, config)
    registry[workspace_id] = workspace
    return workspace


def workspaces_for_current_thread() -> dict[str, Workspace]:
    return dict(_registry())


def destroy_all_workspaces_for_current_thread() -> int:
    """Destroy every registry workspace of the calling thread; returns how many."""
    registry = _registry()
    count = len(registry)
    thread = threading.current_thread().name
    for workspace in registry.values():
        workspace.destroy(released_by=f"destroy_all_workspaces_for_current_thread() in thread {thread!r}")
    registry.clear()
    return count


def allocation_statistics_for_current_thread() -> str:
    """A table of this thread's registry workspaces: reserved, cycle sizes, spills, block allocations."""
    header = (
        f"{'workspace':<24} {'reserved':>12} {'last cycle':>12} {'max cycle':>12} {'spilled':>12} "
        f"{'spills':>7} {'blocks':>7}"
    )
    lines = [f"workspaces of thread {threading.current_thread().name!r}", header]
    for name, ws in sorted(_registry().items()):
        s = ws.statistics()
        lines.append(
            f"{name:<24} {s.capacity:>12} {s.last_cycle_bytes:>12} {s.max_cycle_bytes:>12} "
            f"{s.spilled_bytes:>12} {s.spilled_count:>7} {s.block_allocations:>7}"
        )
    return "\n".join(lines)


def print_allocation_statistics_for_current_thread() -> None:
    print(allocation_statistics_for_current_thread())

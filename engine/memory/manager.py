"""WorkspaceManager: layers say what an array is for; the manager decides where it lives.

DL4J's LayerWorkspaceMgr in our words. A layer calls ``mgr.create(ArrayType.ACTIVATIONS, shape)``
and never names a workspace; the manager's mode (training, inference, none) maps each ArrayType to
one of its workspaces (the table is in docs/memory.md):

* per-iteration workspaces ("input", "activations", "gradients", "updater") are opened and reset by
  ``with mgr.iteration():`` (one training step or one inference batch) and closed when it ends;
* the "working" workspace (FF/BP working memory) is opened with the iteration and reset again on
  entering and on leaving ``with mgr.layer(index):``, so one layer's scratch is reused by the next;
* the long-lived types (PARAMETERS, GRADIENTS, UPDATER_STATE) are not workspace memory: they live in
  ``ContiguousBlock``s; ``create`` gives them plain unmanaged arrays.

Inference keeps every activation of a batch in one workspace rather than alternating two: the
network is a DAG with residual connections, and ping-ponging would overwrite a skip tensor still
waiting for its add. In training the network makes a ``PlannedArena`` (``engine.memory.arena``) the
default provider of ACTIVATIONS, FF_CACHE and ACTIVATION_GRAD: each tensor gets an offset planned from
its lifespan, so the block is the planned peak rather than every tensor of the step at once; the
"activations" and "gradients" workspaces then only serve what the plan does not (the offload
scheduler's loss-head tensors, managers used without a network). All workspaces default to
FIRST_LOOP learning with REALLOCATE spill: the first step learns the sizes (and the per-layer
working memory grows to its largest layer), and from the second step on a step of the same shapes allocates nothing.

``set_provider(types, provider)`` hands chosen types to someone else (the offload scheduler places
saved-for-backward tensors in its own windows); ``owner`` tells the provider which layer asks.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import numpy as np

from engine.memory.array_type import ArrayType
from engine.memory.tensor import Tensor, WorkspaceError
from engine.memory.tree import ManagerNode, format_bytes, root_manager
from engine.memory.workspace import (
    DebugMode,
    SpillPolicy,
    Workspace,
    WorkspaceClosedError,
    WorkspaceConfig,
    WorkspaceStatistics,
)

MODES = ("training", "inference", "none")

# Mode -> ArrayType -> workspace role. Types not listed are unmanaged (long-lived, or mode "none");
# types in NOT_IN_INFERENCE raise in inference mode.
ROUTES: dict[str, dict[ArrayType, str]] = {
    "training": {
        ArrayType.INPUT: "input",
        ArrayType.ACTIVATIONS: "activations",
        ArrayType.FF_CACHE: "activations",
        ArrayType.ACTIVATION_GRAD: "gradients",
        ArrayType.FF_WORKING_MEM: "working",
        ArrayType.BP_WORKING_MEM: "working",
        ArrayType.UPDATER_WORKING_MEM: "updater",
    },
    "inference": {
        ArrayType.INPUT: "input",
        ArrayType.ACTIVATIONS: "activations",
        ArrayType.FF_CACHE: "activations",
        ArrayType.FF_WORKING_MEM: "working",
    },
    "none": {},
}
NOT_IN_INFERENCE = frozenset({ArrayType.ACTIVATION_GRAD, ArrayType.BP_WORKING_MEM, ArrayType.UPDATER_WORKING_MEM})
PER_LAYER_ROLES = frozenset({"working"})

# No over-allocation: a CNN step repeats its shapes exactly, so the learned size is the size; a step
# that needs more (a larger batch) grows the block once, at its end.
DEFAULT_CONFIG = WorkspaceConfig(overallocation=0.0, spill=SpillPolicy.REALLOCATE)

_names = itertools.count(1)


SHARED_ARENA = "SHARED_ARENA"  # the memory log's key for a planned arena's bytes (reserved_bytes_by_type)

class TensorProvider(Protocol):
    """Whoever takes over some ArrayTypes (the offload scheduler)."""

    def create(self, array_type: ArrayType, shape: tuple[int, ...], dtype: np.dtype, owner: Any) -> Tensor: ...


class WorkspaceManager(ManagerNode):
    """Maps ArrayTypes to workspaces for one mode; a node of the manager tree (see ``engine.memory.tree``)."""

    def __init__(
        self,
        backend: Any,
        mode: str = "training",
        *,
        configs: dict[str, WorkspaceConfig] | None = None,
        parent: ManagerNode | None = None,
        name: str | None = None,
    ):
        if mode not in MODES:
            raise ValueError(f"WorkspaceManager: unknown mode {mode!r}; choose one of {', '.join(MODES)}")
        super().__init__(name or f"{mode}-{next(_names)}", parent if parent is not None else root_manager())
        self.backend = backend
        self.mode = mode
        self.owner: Any = None
        configs = dict(configs or {})
        routes = ROUTES[mode]
        roles = sorted(set(routes.values()))
        unknown = set(configs) - set(roles)
        if unknown:
            raise ValueError(
                f"WorkspaceManager: no workspace called {sorted(unknown)} in mode {mode!r}; its workspaces are {roles}"
            )
        self._workspaces: dict[str, Workspace] = {
            role: Workspace(backend, f"{self.name}/{role}", configs.get(role, DEFAULT_CONFIG)) for role in roles
        }
        self._route: dict[ArrayType, Workspace] = {t: self._workspaces[role] for t, role in routes.items()}
        self._types_of: dict[str, list[ArrayType]] = {
            role: [t for t in ArrayType if routes.get(t) == role] for role in roles
        }
        self._providers: dict[ArrayType, TensorProvider] = {}
        self._default_providers: dict[ArrayType, TensorProvider] = {}
        self._arenas: list[Any] = []
        self._iteration_depth = 0
        self._blocks: list[Any] = []

    # --- allocation ---------------------------------------------------------------------------------

    def create(self, array_type: ArrayType, shape: tuple[int, ...] | int, dtype: Any = np.float32) -> Tensor:
        """A tensor for ``array_type``, placed by the mode's mapping (or by the type's provider)."""
        if self.closed or self.capped:
            self._check_can_allocate()
        if self._providers:
            provider = self._providers.get(array_type)
            if provider is not None:
                shape = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(int(s) for s in shape)
                return provider.create(array_type, shape, np.dtype(dtype), self.owner)
        workspace = self._route.get(array_type)
        if workspace is None:
            return self._unmanaged(array_type, shape, dtype)
        if not workspace.is_open:
            if workspace.is_released:
                workspace.check_not_released()
            raise WorkspaceClosedError(
                f"{array_type!r} goes to workspace [{workspace.name}], which is not open: create it inside "
                f"`with mgr.iteration():` (one training step or inference batch)"
            )
        return workspace.create(shape, dtype, array_type)

    def _unmanaged(self, array_type: ArrayType, shape: tuple[int, ...] | int, dtype: Any) -> Tensor:
        if not isinstance(array_type, ArrayType):
            raise TypeError(f"WorkspaceManager.create: expected an ArrayType, got {array_type!r}")
        if self.mode == "inference" and array_type in NOT_IN_INFERENCE:
            raise WorkspaceError(
                f"{array_type!r} belongs to a backward pass or an optimizer step, which inference mode does not "
                f"have; use a WorkspaceManager with mode='training'"
            )
        shape = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(int(s) for s in shape)
        return Tensor(self.backend.xp.empty(shape, dtype=np.dtype(dtype)), array_type, None, 0, None)

    def zeros(self, array_type: ArrayType, shape: tuple[int, ...] | int, dtype: Any = np.float32) -> Tensor:
        tensor = self.create(array_type, shape, dtype)
        tensor.array.fill(0)
        return tensor

    def leverage_to(self, array_type: ArrayType, tensor: Tensor | Any) -> Tensor:
        """``tensor`` as an ``array_type`` tensor: itself when already there, else a copy into that type's place.

        Accepts a plain backend (or host) array too, which is how a batch enters the INPUT workspace.
        """
        if isinstance(tensor, Tensor):
            target = None if array_type in self._providers else self._route.get(array_type, None)
            source_ws = tensor.workspace
            already_there = (
                array_type not in self._providers
                and source_ws is target
                and (source_ws is None or source_ws.live_generation == tensor.generation)
            )
            if already_there:
                if tensor.array_type is array_type:
                    return tensor
                return Tensor(tensor.array, array_type, source_ws, tensor.generation, tensor.offset)
            source = tensor.kernel_array("leverage_to", "tensor")
        else:
            source = tensor
        out = self.create(array_type, source.shape, source.dtype)
        if self.backend.is_device and isinstance(source, np.ndarray):
            source = self.backend.to_device(source)
        out.array[...] = source
        return out

    def validate_location(self, array_type: ArrayType, tensor: Tensor | Any) -> None:
        """Raise unless ``tensor`` lives where this manager puts ``array_type`` (providers place their own)."""
        if array_type in self._providers:
            return
        expected = self._route.get(array_type)
        actual = tensor.workspace if isinstance(tensor, Tensor) else None
        if expected is actual:
            return
        if expected is not None and expected.config.debug is DebugMode.BYPASS_EVERYTHING and actual is None:
            return
        raise WorkspaceError(
            f"Array of type {array_type.name} should be in workspace {_workspace_label(expected)} but is in "
            f"workspace {_workspace_label(actual)}"
        )

    def set_provider(self, array_types: ArrayType | Iterable[ArrayType], provider: TensorProvider | None) -> None:
        """Send ``create`` for these types to ``provider.create(type, shape, dtype, owner)``; None gives them back."""
        types = [array_types] if isinstance(array_types, ArrayType) else list(array_types)
        for array_type in types:
            if provider is None:
                self._providers.pop(array_type, None)
                if array_type in self._default_providers:
                    self._providers[array_type] = self._default_providers[array_type]
            else:
                self._providers[array_type] = provider

    def set_default_provider(self, array_types: Iterable[ArrayType], provider: TensorProvider | None) -> None:
        """The provider these types go back to when ``set_provider(type, None)`` removes another one.

        The network's planned arena is the default; an offload scheduler set with ``set_provider`` takes
        over its types and gives them back to the arena when it detaches, in whichever order they came.
        """
        for array_type in array_types:
            current = self._default_providers.pop(array_type, None)
            if provider is not None:
                self._default_providers[array_type] = provider
            if self._providers.get(array_type) is current or array_type not in self._providers:
                self.set_provider(array_type, provider)

    def track_arena(self, arena: Any) -> None:
        """Count a planned arena (``engine.memory.arena``) in this manager's reserved/in-use bytes and allocations."""
        self._arenas.append(arena)

    def provider_for(self, array_type: ArrayType) -> TensorProvider | None:
        return self._providers.get(array_type)

    # --- scopes -------------------------------------------------------------------------------------

    @property
    def in_iteration(self) -> bool:
        return self._iteration_depth > 0

    @contextmanager
    def iteration(self) -> Iterator[WorkspaceManager]:
        """One training step or inference batch: opens (resets) every workspace; nested calls only nest."""
        if self.closed:
            self._check_can_allocate()
        if self._iteration_depth == 0:
            for workspace in self._workspaces.values():
                workspace.enter()
                workspace.start_window()
        self._iteration_depth += 1
        try:
            yield self
        finally:
            self._iteration_depth -= 1
            if self._iteration_depth == 0:
                for workspace in reversed(self._workspaces.values()):
                    if workspace.is_open:
                        workspace.leave()

    @contextmanager
    def layer(self, index: Any) -> Iterator[WorkspaceManager]:
        """One layer's forward or backward: fresh working memory, ``owner = index``; both restored after."""
        previous = self.owner
        self.owner = index
        self._reset_per_layer()
        try:
            yield self
        finally:
            self.owner = previous
            self._reset_per_layer()

    def _reset_per_layer(self) -> None:
        for role in PER_LAYER_ROLES:
            workspace = self._workspaces.get(role)
            if workspace is not None and workspace.is_open:
                workspace.reset()

    # --- the tree -----------------------------------------------------------------------------------

    def sub_manager(
        self, mode: str | None = None, *, name: str | None = None, configs: dict[str, WorkspaceConfig] | None = None
    ) -> WorkspaceManager:
        """A child manager with its own workspaces; closing this manager closes it too."""
        child_name = f"{self.name}/{name or f'sub-{next(_names)}'}"
        return WorkspaceManager(self.backend, mode or self.mode, configs=configs, parent=self, name=child_name)

    def track_block(self, block: Any) -> None:
        """Count a ContiguousBlock in this manager's dumps and in the memory monitor."""
        if self.closed or self.capped:
            self._check_can_allocate()
        self._blocks.append(block)

    def untrack_block(self, block: Any) -> None:
        """Stop counting ``block`` (its owner dropped it: ``Network.set_gradient_storage`` replaced it)."""
        self._blocks = [b for b in self._blocks if b is not block]

    def _release(self) -> None:
        for workspace in self._workspaces.values():
            workspace.destroy(released_by=f"manager [{self.name}]")
        self._iteration_depth = 0
        self._blocks = []
        self._providers = {}
        self._default_providers = {}
        for arena in self._arenas:
            arena.release(f"manager [{self.name}]")
        self._arenas = []

    # --- accounting ---------------------------------------------------------------------------------

    @property
    def workspaces(self) -> dict[str, Workspace]:
        """Role -> workspace ("input", "activations", "gradients", "working", "updater": those of the mode)."""
        return dict(self._workspaces)

    @property
    def blocks(self) -> list[Any]:
        return list(self._blocks)

    def workspace_for(self, array_type: ArrayType) -> Workspace | None:
        return self._route.get(array_type)

    def statistics(self) -> dict[str, WorkspaceStatistics]:
        return {role: ws.statistics() for role, ws in self._workspaces.items()}

    def in_use_bytes_by_type(self) -> dict[str, int]:
        """ArrayType name -> the most bytes it held at once in the current (or, between steps, the last) iteration."""
        totals: dict[str, int] = {}
        for workspace in self._workspaces.values():
            for tag, nbytes in workspace.peak_by_tag().items():
                key = tag.name if tag is not None else "UNTYPED"
                totals[key] = totals.get(key, 0) + nbytes
        for block in self._blocks:
            totals[block.array_type.name] = totals.get(block.array_type.name, 0) + block.nbytes
        for arena in self._arenas:
            for array_type, nbytes in arena.in_use_bytes_by_type().items():
                totals[array_type.name] = totals.get(array_type.name, 0) + nbytes
        return totals

    def reserved_bytes_by_type(self, split_arenas: bool = True) -> dict[str, int]:
        """ArrayType name -> bytes reserved for it; a workspace shared by types is split by their peaks.

        ``split_arenas=False`` (the memory log) puts a planned arena's bytes under ``SHARED_ARENA`` instead
        of splitting them by the plan's bytes per type: its types reuse the same bytes at different times,
        so a type's own peak can exceed any share of it (ResNet-18 batch 128: ACTIVATION_GRAD in use
        102,760,448 bytes at its peak against a 49,041,581-byte share, issue 33). Each type's in-use peak
        is then at most the arena's bytes, and the total reserved is the same either way."""
        totals: dict[str, int] = {}
        for role, workspace in self._workspaces.items():
            types = self._types_of[role]
            peaks = workspace.peak_by_tag()
            used = {t: peaks.get(t, 0) for t in types}
            total_used = sum(used.values())
            capacity = workspace.capacity
            if total_used == 0:
                shares = {types[0]: capacity}
            else:
                shares = {t: capacity * u // total_used for t, u in used.items()}
                largest = max(used, key=lambda t: used[t])
                shares[largest] += capacity - sum(shares.values())
            for t, nbytes in shares.items():
                totals[t.name] = totals.get(t.name, 0) + nbytes
        for block in self._blocks:
            totals[block.array_type.name] = totals.get(block.array_type.name, 0) + block.nbytes
        for arena in self._arenas:
            for array_type, nbytes in arena.reserved_bytes_by_type().items():
                key = array_type.name if split_arenas else SHARED_ARENA
                totals[key] = totals.get(key, 0) + nbytes
        if not split_arenas:  # a type whose bytes all live in the arena has no reserve of its own to show
            totals = {key: nbytes for key, nbytes in totals.items() if nbytes}
        return totals

    def spilled_bytes(self) -> int:
        return sum(ws.spilled_bytes for ws in self._workspaces.values())

    def block_allocations(self) -> int:
        return sum(ws.block_allocations for ws in self._workspaces.values()) + sum(
            a.block_allocations for a in self._arenas
        )

    def _describe(self) -> tuple[str, int, dict[str, int]]:
        reserved = (sum(ws.capacity for ws in self._workspaces.values()) + sum(b.nbytes for b in self._blocks)
                    + sum(a.owned_bytes for a in self._arenas))
        spilled = self.spilled_bytes()
        summary = f"{self.name} [{self.mode}]"
        if spilled:
            summary += f" spilled {format_bytes(spilled)} in total"
        return summary, reserved, self.in_use_bytes_by_type()

    def __repr__(self) -> str:
        return f"WorkspaceManager({self.name!r}, mode={self.mode!r}{', closed' if self.closed else ''})"


def _workspace_label(workspace: Workspace | None) -> str:
    return "none (unmanaged)" if workspace is None else f"[{workspace.name}]"


def no_workspaces(backend: Any = None) -> WorkspaceManager:
    """A manager whose every array is plain and unmanaged: for layers used outside a network."""
    if backend is None:
        from engine.backend import get_backend

        backend = get_backend("cpu")
    return WorkspaceManager(backend, "none")

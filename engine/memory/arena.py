"""PlannedArena: a tensor provider that hands out views at statically planned offsets in one block.

A bump workspace keeps every tensor of a step until the step ends. The arena instead places each
tensor at the offset ``engine.memory.planner`` chose from its lifespan, so tensors that are never
alive together share bytes and the block is the planned peak, not the sum of all tensors.

Tensors are recognised by who makes them: ``(owner, type, n)``, the owner node (``mgr.owner``; None
for the loss head), the ArrayType, and the number of tensors of that type the owner made before it in
this iteration (counted per type, so a layer's order between, say, its working memory and what it
keeps for backward is its own business). Each is checked against the plan's shape and dtype; anything
else raises ``PlanMismatchError`` before a byte is written, and so does an owner that made fewer
tensors than planned by the end of its step (``end_step``): a layer that allocates other than the plan
says would otherwise alias a live tensor.

Safety: every planned tensor has a *slot*, a stand-in workspace with its own generation. The slot is
live from the tensor's creation until ``end_step`` passes its last planned step, then marked
outdated; between iterations it is closed. So the kernel table rejects a tensor used outside its
planned lifespan (``OutdatedWorkspaceError``) or after its iteration (``LeakedWorkspaceError``),
exactly where its bytes may already belong to someone else.

The block is allocated once per plan size (through ``backend.alloc_block``) and counted by the
manager that tracks the arena (``mgr.track_arena``): reserved and in-use bytes per ArrayType, block
allocations.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.memory.array_type import ArrayType
from engine.memory.planner import ALIGNMENT, align, plan_offsets
from engine.memory.tensor import CLOSED, RELEASED, Tensor, WorkspaceError

OUTDATED = -4  # a slot's live_generation once its tensor's planned lifespan is over (no generation equals it)


class PlanMismatchError(WorkspaceError):
    """A layer allocated something other than what the static memory plan expected."""


@dataclass(frozen=True)
class PlannedTensor:
    """One tensor of the plan: its key, what it is, when it lives and where it goes."""

    name: str
    owner: Any
    sequence: int  # how many tensors of its type the owner made before it in an iteration
    array_type: ArrayType
    shape: tuple[int, ...]
    dtype: np.dtype
    first: int
    last: int
    offset: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass
class ArenaPlan:
    """The placement of one iteration's tensors; ``planned_peak`` is the arena size it needs."""

    tensors: list[PlannedTensor]
    planned_peak: int
    lower_bound: int
    total_bytes: int  # every tensor's aligned bytes: what a bump workspace would keep

    def by_key(self) -> dict[tuple[Any, ArrayType, int], PlannedTensor]:
        return {(t.owner, t.array_type, t.sequence): t for t in self.tensors}


BACKWARD_TYPES = frozenset({ArrayType.ACTIVATION_GRAD, ArrayType.BP_WORKING_MEM, ArrayType.GRADIENTS})
"""What a node makes in its backward step; everything else it makes in its forward."""


def make_plan(specs: Iterable[Any]) -> ArenaPlan:
    """Plan ``specs`` (objects with name, owner, array_type, shape, dtype, first, last; in creation order)."""
    specs = list(specs)
    counters: dict[tuple[Any, ArrayType], int] = {}
    sequences = []
    for spec in specs:
        sequences.append(counters.get((spec.owner, spec.array_type), 0))
        counters[(spec.owner, spec.array_type)] = sequences[-1] + 1
    sizes = [align(math.prod(s.shape) * np.dtype(s.dtype).itemsize) for s in specs]
    placement = plan_offsets(sizes, [[(s.first, s.last)] for s in specs], [getattr(s, "late", False) for s in specs])
    tensors = [
        PlannedTensor(s.name, s.owner, n, s.array_type, tuple(int(d) for d in s.shape), np.dtype(s.dtype),
                      int(s.first), int(s.last), offset)
        for s, n, offset in zip(specs, sequences, placement.offsets)
    ]
    return ArenaPlan(tensors, placement.planned_peak, placement.lower_bound, sum(sizes))


class _Slot:
    """The stand-in workspace of one planned tensor (what ``Tensor`` checks: name, generation, live_generation)."""

    __slots__ = ("name", "generation", "live_generation", "released_by", "array_type", "nbytes")

    def __init__(self, name: str, array_type: ArrayType, nbytes: int):
        self.name = name
        self.array_type = array_type
        self.nbytes = nbytes
        self.generation = 0
        self.live_generation = CLOSED
        self.released_by = None


class PlannedArena:
    """The provider (``create(array_type, shape, dtype, owner)``) of the planned types of one manager.

    ``plan_for(batch_size, types)`` says what an iteration allocates (the network builds it from the
    step program, ``engine.program``); ``start_iteration(batch_size)`` picks the plan for the types
    this arena provides now, ``end_step(step, owner)`` retires what the step was the last to use,
    ``end_iteration()`` closes all.
    """

    def __init__(self, backend: Any, name: str, plan_for: Any, manager: Any = None,
                 lender: PlannedArena | None = None):
        self.backend = backend
        # An arena whose block this one uses while that arena is between iterations and its block is big
        # enough (the network's inference arena borrows the training arena's: evaluation runs in the
        # training step's bytes instead of touching pages of its own). ``borrowed``: the block is the lender's.
        self.lender = lender
        self.borrowed = False
        self.name = name
        self._plan_for = plan_for  # (batch_size, frozenset of ArrayTypes) -> ArenaPlan
        self.manager = manager
        self._plans: dict[tuple[int, frozenset], ArenaPlan] = {}
        self.plan: ArenaPlan | None = None
        self._types: frozenset = frozenset()
        self._keys: dict[tuple[Any, ArrayType, int], tuple[PlannedTensor, _Slot]] = {}
        self._planned_count: dict[Any, tuple[int, int]] = {}  # owner -> (made in forward, in all)
        self._ending: dict[int, list[_Slot]] = {}
        self._made: dict[tuple[Any, ArrayType], int] = {}  # (owner, type) -> tensors made this iteration
        self._made_by: dict[Any, int] = {}  # owner -> tensors of every type made this iteration
        self._live: list[_Slot] = []
        self._block: Any = None
        self._numpy_block = False
        # Another owner of the block: ``host.step_plan(batch_size, plan)`` then ``host.shared_block(nbytes)`` each
        # iteration (an offload scheduler places its units in the bytes our tensors leave free:
        # engine.offload.plan.place_around). None: the block is ours.
        self.host: Any = None
        self._hosted = False
        self.capacity = 0
        self.block_allocations = 0
        self.generation = 0
        self._in_iteration = False
        self._live_bytes: dict[ArrayType, int] = {}
        self._peak_bytes: dict[ArrayType, int] = {}
        self._last_peak: dict[ArrayType, int] = {}
        self._live_total = 0
        self.measured_peak = 0  # the most bytes of live tensors at once in this (or the last) iteration

    # --- the iteration ------------------------------------------------------------------------------

    def start_iteration(self, batch_size: int, types: Iterable[ArrayType]) -> None:
        """A new iteration of ``batch_size`` in which this arena provides ``types``: pick the plan, size the block."""
        self.end_iteration()
        types = frozenset(types)
        key = (int(batch_size), types)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._plan_for(int(batch_size), types)
        if self.host is not None:  # its tensors may sit elsewhere in the host's region (placed with its own)
            plan = self.host.step_plan(int(batch_size), plan)
        if plan is not self.plan:
            self._use(plan, types)
        elif self.lender is not None or self.host is not None or self._hosted:
            self._place(plan.planned_peak, types)  # the lender's (or host's) block may have moved or be in use now
        self.generation += 1
        self._made = {}
        self._made_by = {}
        self._live = []
        self._live_bytes = {}
        self._peak_bytes = {}
        self._live_total = 0
        self.measured_peak = 0
        self._in_iteration = True

    def _use(self, plan: ArenaPlan, types: frozenset) -> None:
        self._place(plan.planned_peak, types)
        self.plan = plan
        self._types = types
        self._keys = {}
        self._ending = {}
        self._planned_count = {}
        for t in plan.tensors:
            slot = _Slot(f"{self.name}/{t.name} (planned steps {t.first}..{t.last})", t.array_type, align(t.nbytes))
            self._keys[(t.owner, t.array_type, t.sequence)] = (t, slot)
            self._ending.setdefault(t.last, []).append(slot)
            forward, total = self._planned_count.get(t.owner, (0, 0))
            self._planned_count[t.owner] = (forward + (t.array_type not in BACKWARD_TYPES), total + 1)

    def _place(self, need: int, types: frozenset) -> None:
        """Point the block at ``need`` bytes: the lender's block when it lends, else one of our own (allocated
        when it is too small, or when the types changed and it is larger than the plan needs)."""
        if self.host is not None:
            self._block = self.host.shared_block(need)
            self._numpy_block = isinstance(self._block, np.ndarray)
            self.capacity, self.borrowed, self._hosted = need, False, True
            return
        if self._hosted:  # the host let go of us: a block of our own
            self._hosted, self._block, self.capacity = False, None, 0
        lent = self._lent_block(need)
        if lent is not None:
            self._block, self.capacity, self.borrowed = lent, need, True
            self._numpy_block = isinstance(lent, np.ndarray)
            return
        if self.borrowed or need > self.capacity or (types != self._types and need < self.capacity):
            raw = self.backend.alloc_block(need + ALIGNMENT)
            interface = getattr(raw, "__cuda_array_interface__", None) or raw.__array_interface__
            shift = (-int(interface["data"][0])) % ALIGNMENT
            self._block = raw[shift:shift + need]
            self._numpy_block = isinstance(self._block, np.ndarray)
            self.capacity = need
            self.borrowed = False
            self.block_allocations += 1

    def _lent_block(self, need: int) -> Any:
        """The first ``need`` bytes of the lender's block, if it is between iterations and holds that many."""
        lender = self.lender
        if lender is None or lender._in_iteration or lender.borrowed or lender._block is None or lender.capacity < need:
            return None
        return lender._block[:need]

    @property
    def owned_bytes(self) -> int:
        """Bytes of the block this arena allocated (0 while it uses a lender's, which that one counts)."""
        return 0 if self.borrowed else self.capacity

    def forget_plans(self) -> None:
        """Drop the cached plans: the program they came from changed (``Network.set_gradient_storage``)."""
        self._plans = {}

    def end_step(self, step: int, owner: Any = None, backward: bool = False) -> None:
        """Step ``step`` (``owner``'s forward, or its backward) is over: check the owner made exactly what the
        plan says by now, and retire the tensors whose lifespan ends here."""
        if not self._in_iteration:
            return
        if owner is not None:
            made = self._made_by.get(owner, 0)
            forward, total = self._planned_count.get(owner, (0, 0))
            expected = total if backward else forward
            if made != expected:
                raise PlanMismatchError(
                    f"[{self.name}] node {owner} made {made} planned tensors by the end of step {step}, but the "
                    f"step program (engine.program) expected {expected}: a layer allocates other "
                    f"than the plan says (a missing tensor would make the next one alias a live tensor)"
                )
        for slot in self._ending.get(step, ()):
            if slot.live_generation == self.generation:
                slot.live_generation = OUTDATED
                self._live_bytes[slot.array_type] -= slot.nbytes
                self._live_total -= slot.nbytes

    def end_iteration(self) -> None:
        """Close every slot: a tensor of a finished iteration is leaked, whatever its lifespan."""
        if not self._in_iteration:
            return
        self._in_iteration = False
        for _, slot in self._keys.values():
            slot.live_generation = CLOSED
        self._last_peak = dict(self._peak_bytes)

    def release(self, released_by: str) -> None:
        """Drop the block (the manager was closed): every tensor handed out raises ReleasedTensorError."""
        self._in_iteration = False
        for _, slot in self._keys.values():
            slot.live_generation = RELEASED
            slot.released_by = released_by
        self._block = None
        self.capacity = 0
        self.borrowed = False
        self.plan = None
        self._plans = {}
        self._keys = {}

    # --- the provider -------------------------------------------------------------------------------

    def create(self, array_type: ArrayType, shape: tuple[int, ...], dtype: np.dtype, owner: Any) -> Tensor:
        """A view at the planned offset of the owner's next tensor; raises PlanMismatchError if it is not that."""
        if not self._in_iteration:
            if self._block is None and self.block_allocations:
                raise WorkspaceError(f"[{self.name}] was released (its manager was closed)")
            raise WorkspaceError(
                f"[{self.name}] {array_type!r} asked for outside a training iteration: the planned arena only "
                f"serves Network.forward/backward (inside net.forward(x, training=True) ... net.backward())"
            )
        sequence = self._made.get((owner, array_type), 0)
        entry = self._keys.get((owner, array_type, sequence))
        dtype = np.dtype(dtype)
        if entry is None or entry[0].shape != shape or entry[0].dtype != dtype:
            expected = (f"{entry[0].name}: {entry[0].array_type.name} {entry[0].shape} {entry[0].dtype}"
                        if entry is not None else f"no more {array_type.name}")
            raise PlanMismatchError(
                f"[{self.name}] node {owner} created {array_type.name} {tuple(shape)} {dtype} as its planned tensor "
                f"#{sequence} of that type, but the step program (engine.program) expected {expected}. The layer "
                f"allocates other than its output_shape/saved_specs/backward say; fix the layer or the plan, or "
                f"build the network with workspace_mode='none'"
            )
        planned, slot = entry
        self._made[(owner, array_type)] = sequence + 1
        self._made_by[owner] = self._made_by.get(owner, 0) + 1
        slot.generation = self.generation
        slot.live_generation = self.generation
        start = planned.offset
        if self._numpy_block:
            array = np.ndarray(shape, dtype, self._block, start)
        else:
            array = self._block[start:start + planned.nbytes].view(dtype).reshape(shape)
        live = self._live_bytes[array_type] = self._live_bytes.get(array_type, 0) + slot.nbytes
        if live > self._peak_bytes.get(array_type, 0):
            self._peak_bytes[array_type] = live
        self._live_total += slot.nbytes
        if self._live_total > self.measured_peak:
            self.measured_peak = self._live_total
        return Tensor(array, array_type, slot, self.generation, start)

    # --- accounting ---------------------------------------------------------------------------------

    def in_use_bytes_by_type(self) -> dict[ArrayType, int]:
        """The most bytes of live tensors of each type at once in the current (or the last) iteration."""
        return dict(self._peak_bytes if self._in_iteration else self._last_peak)

    def reserved_bytes_by_type(self) -> dict[ArrayType, int]:
        """The block split between the types this arena provides, in proportion to the plan's bytes of each
        (nothing while the block is a lender's: its bytes are the lender's reserve)."""
        if self.owned_bytes == 0 or self.plan is None:
            return {}
        weights: dict[ArrayType, int] = {}
        for t in self.plan.tensors:
            weights[t.array_type] = weights.get(t.array_type, 0) + align(t.nbytes)
        total = sum(weights.values())
        shares = {t: self.capacity * w // total for t, w in weights.items()}
        largest = max(weights, key=lambda t: weights[t])
        shares[largest] += self.capacity - sum(shares.values())
        return shares


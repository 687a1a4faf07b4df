"""The offload plan: which layer's tensors go to disk, where they sit in memory and in the swap file.

A training step runs every node's forward, then every node's backward in reverse: ``2M`` executor
steps on one *timeline*. Each node owns up to two *units* of the tensors created while ``mgr.owner``
was its index (its ACTIVATIONS output and its FF_CACHE): the "saved" unit, which a backward reads
again, and the "transient" one, which only forwards read (freed after its last reader, never
written). A saved unit is used from its forward until the last forward that reads it, and again
from the first backward that needs it until the last.

With a window of N, a unit occupies memory

* from its forward until N steps after its last forward use (the saver may lag N steps behind), and
* from N steps before its first backward use (the loader prefetches N steps ahead) until its backward;

when those two spans touch, the unit stays resident and is never written (the last N layers of the
forward are used again right away); a unit that no backward uses is freed after its last forward
use, never written either.

Every unit gets one page-aligned offset in a resident *arena* for both of its spans (the layers hold tensors that
must come back to the same address), chosen first-fit by decreasing size among the units whose spans
overlap in time (TFLite's greedy arena planner). Because the spans include the lag and the
lookahead, data being saved or prefetched never shares memory with a live tensor: nntrainer's
lookahead corrupted memory exactly there (issue #2034). At run time the scheduler also waits, before a
unit moves into its region, until every earlier occupant of those bytes has left (``predecessors``):
the plan decides how much can overlap, the waits make it safe whatever the timing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, Protocol

import numpy as np

from engine.memory.array_type import ArrayType
from engine.memory.planner import first_fit, greedy_order
from engine.report import format_bytes

ALIGN = 64  # tensor alignment inside a unit, as the workspaces use
NETWORK_INPUT = (-1, "input")
"""A rebuild's source key for the network's input: no unit, held in the INPUT ring from the forward to the step's end
(the first layer keeps it for its weight gradient); the scheduler hands the first node's own kept input."""

PAGE = 4096  # unit alignment in the swap file: page-cache drops and O_DIRECT work on whole pages


def align(nbytes: int, to: int = ALIGN) -> int:
    return (int(nbytes) + to - 1) // to * to


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a unit, in the order the layer created it."""

    name: str  # e.g. "layer1.0.bn1:out", as engine.graph names it
    array_type: ArrayType
    shape: tuple[int, ...]
    dtype: np.dtype
    offset: int  # byte offset inside the unit

    @cached_property
    def nbytes(self) -> int:
        # Cached (the spec is frozen): the scheduler asks ~500 times a step, and np.prod costs ~15 µs
        # a call; cProfile of the IO threads, MobileNetV2 batch 32, N=4: 5,290 calls in 10 steps,
        # 0.18 s of the two threads' 1.07 s (plan.nbytes, under the profiler).
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


@dataclass(frozen=True)
class UnitSpec:
    """What one node leaves in memory during a step, and when it is used on the timeline."""

    owner: int  # the node index (mgr.owner while the tensors were created)
    part: str  # "saved": a backward reads it; "output": a saved output kept apart (``group_units``);
    # "transient": only forwards read it (never written)
    name: str  # the node's name, for logs and error messages
    tensors: tuple[TensorSpec, ...]
    created: int  # timeline step of the node's forward
    forward_end: int  # last forward step that reads the unit
    backward_start: int | None  # first backward step that reads it; None: dead after the forward
    backward_end: int | None  # last backward step that reads it (the node's own backward)

    @property
    def key(self) -> tuple[int, str]:
        return (self.owner, self.part)

    @property
    def label(self) -> str:
        return f"{self.name} ({self.part})"

    @cached_property
    def nbytes(self) -> int:
        """The unit's bytes in the arena (tensors aligned to 64 bytes); cached as ``TensorSpec.nbytes``."""
        if not self.tensors:
            return 0
        last = self.tensors[-1]
        return align(last.offset + last.nbytes)

    @cached_property
    def footprint(self) -> int:
        """Its bytes in the arena and in the swap file: whole pages, so IO can bypass the page cache."""
        return align(self.nbytes, PAGE)

    @property
    def payload_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def layout_tensors(specs: Sequence[tuple[str, ArrayType, tuple[int, ...], np.dtype]]) -> tuple[TensorSpec, ...]:
    """Place a unit's tensors (name, type, shape, dtype) one after another, 64-byte aligned."""
    tensors = []
    offset = 0
    for name, array_type, shape, dtype in specs:
        tensor = TensorSpec(name, array_type, tuple(int(s) for s in shape), np.dtype(dtype), offset)
        tensors.append(tensor)
        offset = align(offset + tensor.nbytes)
    return tuple(tensors)


@dataclass(frozen=True)
class Occupation:
    """A span of timeline steps [start, end] during which a unit holds its arena bytes."""

    key: tuple[int, str]
    index: int  # 0: the forward span (or the whole step when never written), 1: the backward span
    start: int
    end: int

    def overlaps(self, other: Occupation) -> bool:
        return self.start <= other.end and other.start <= self.end


@dataclass(frozen=True)
class Recompute:
    """A saved unit rebuilt from other units' tensors instead of swapped: ``layer.recompute_output``.

    ``nodes`` run in order (the first reads ``sources``, each later one rewrites ``tensor`` in place:
    a ReLU, or an Add then a ReLU); ``sources`` are (unit, tensor) pairs of the first node's inputs;
    ``tensor`` is the rebuilt output as laid out in its unit.
    """

    nodes: tuple[int, ...]
    sources: tuple[tuple[tuple[int, str], TensorSpec], ...]
    tensor: TensorSpec
    scratch_bytes: int = 0  # working memory the rebuild needs (a chunked layer's conv): the arena's tail

    @property
    def source_units(self) -> tuple[tuple[int, str], ...]:
        """The units the sources are in (not the network input: resident for the whole step, in the INPUT ring)."""
        return tuple(dict.fromkeys(key for key, _ in self.sources if key != NETWORK_INPUT))


@dataclass
class UnitPlan:
    spec: UnitSpec
    arena_offset: int
    offloaded: bool  # written after the forward and read back before the backward
    occupations: tuple[Occupation, ...]
    file_offset: int | None  # where its records start in the swap file (None when never written)
    recompute: Recompute | None = None  # rebuilt from a kept tensor before its backward instead of swapped
    load_at: int | None = None  # first backward step it must be in memory (earlier than its own when a
    # recomputed unit reads it)

    @property
    def key(self) -> tuple[int, str]:
        return self.spec.key

    @property
    def decision(self) -> str:
        """keep, swap, recompute or transient: what ``engine memory --offload-n`` shows per unit."""
        if self.spec.backward_start is None:
            return "transient"
        return "swap" if self.offloaded else ("recompute" if self.recompute is not None else "keep")

    @property
    def nbytes(self) -> int:
        """The unit's footprint (whole pages)."""
        return self.spec.footprint


@dataclass
class OffloadPlan:
    """The arena layout for one window size; ``arena_bytes`` is the planned peak of offloadable tensors."""

    window: int
    steps: int  # length of the timeline (2 × nodes)
    units: dict[tuple[int, str], UnitPlan]
    arena_bytes: int
    lower_bound_bytes: int  # max over the timeline of the bytes that must be resident (no fragmentation)
    peak_units: int  # max number of units holding memory at one step
    total_bytes: int  # every unit's bytes: what stays resident for a whole step without offload
    file_bytes: int  # size of the swap file (every unit a backward reads has a place in it)
    predecessors: dict[tuple[tuple[int, str], int], tuple[tuple[tuple[int, str], int], ...]] = field(repr=False)
    kept: frozenset[tuple[int, str]] = frozenset()  # units a byte budget keeps that the window would not (keep_within)
    rebuild_scratch_offset: int = 0  # the arena's tail: working memory of the rebuilds that need it, one at a time
    rebuild_scratch_bytes: int = 0

    @property
    def kept_bytes(self) -> int:
        return sum(self.units[key].nbytes for key in self.kept)

    @property
    def offloaded(self) -> list[UnitPlan]:
        return [u for u in self.units.values() if u.offloaded]

    @property
    def recomputed(self) -> list[UnitPlan]:
        """Units rebuilt before their backward, in the order the backward needs them."""
        return sorted((u for u in self.units.values() if u.recompute is not None),
                      key=lambda u: (u.load_at, u.spec.created))  # a rebuilt source before its readers

    @property
    def load_order(self) -> list[UnitPlan]:
        """Offloaded units in the order the backward needs them (the loader's queue)."""
        return sorted(self.offloaded, key=lambda u: (u.load_at, -u.spec.owner))

    @property
    def offloaded_bytes(self) -> int:
        return sum(u.nbytes for u in self.offloaded)

    @property
    def file_bytes_used(self) -> int:
        """The part of the swap file this plan writes (its offsets are fixed by ``file_layout``): the file
        the scheduler allocates, 0 when every unit stays in memory (issue 33: a budget that kept every unit
        still preallocated the whole ``file_bytes``, 793.8 MiB for MobileNetV2 224 batch 16)."""
        return max((u.file_offset + u.spec.footprint for u in self.offloaded), default=0)

    def summary(self) -> dict[str, int]:
        return {
            "window": self.window,
            "units": len(self.units),
            "offloaded_units": len(self.offloaded),
            "arena_bytes": self.arena_bytes,
            "lower_bound_bytes": self.lower_bound_bytes,
            "total_bytes": self.total_bytes,
            "offloaded_bytes": self.offloaded_bytes,
            "recomputed_units": len(self.recomputed),
            "recomputed_bytes": sum(u.nbytes for u in self.recomputed),
            "file_bytes": self.file_bytes,
            "peak_units": self.peak_units,
        }


def file_layout(units: Sequence[UnitSpec]) -> tuple[dict[tuple[int, str], int], int]:
    """A fixed place in the swap file for every unit a backward reads (page aligned), and the file size.

    It does not depend on the window, so an adaptive window changes which units are written, never
    where they go.
    """
    offsets = {}
    position = 0
    for unit in sorted(units, key=lambda u: u.key):
        if unit.backward_start is None or not unit.tensors:
            continue
        offsets[unit.key] = position
        position += unit.footprint
    return offsets, position


def occupations_for(unit: UnitSpec, window: int, needed_from: int | None = None) -> tuple[tuple[Occupation, ...], bool]:
    """The unit's spans for a window of ``window`` and whether it is written to disk (or recomputed).

    ``needed_from``: the first backward step that needs the unit, when earlier than its own (a
    recomputed unit reads it).
    """
    if unit.backward_start is None:
        return (Occupation(unit.key, 0, unit.created, unit.forward_end),), False
    forward_until = unit.forward_end + window
    backward_from = (unit.backward_start if needed_from is None else needed_from) - window
    if backward_from <= forward_until + 1:  # the spans touch: keep it, never write it
        return (Occupation(unit.key, 0, unit.created, unit.backward_end),), False
    return (
        Occupation(unit.key, 0, unit.created, forward_until),
        Occupation(unit.key, 1, backward_from, unit.backward_end),
    ), True


def build_plan(units: Sequence[UnitSpec], window: int, steps: int,
               recompute: Mapping[tuple[int, str], Recompute] | None = None,
               budget_bytes: int | None = None) -> OffloadPlan:
    """Plan the arena for ``window`` (>= 1) layers of slack on each side of the executing one.

    ``recompute`` (``recompute_candidates``): units that may be rebuilt from another unit instead of
    swapped. A candidate that the window would write is recomputed instead; its sources are then
    needed (loaded) from the candidate's first backward step on.

    A candidate whose source is rebuilt itself (a basic block's ReLU output from the previous
    block's, through the identity shortcut) is *chained*: the source is rebuilt first, so it and its
    own sources are needed from the candidate's backward on, earlier than they would be. That holds
    more bytes at once, so a chain is taken only when the arena does not grow: each in forward
    order, kept when the plan with it needs no more arena bytes than without (the units' bytes: the tail
    where a rebuild's conv works, ``OffloadPlan.rebuild_scratch_bytes``, is not counted against it). ResNet-18 (CIFAR,
    batch 32, N=4): 74 MiB written per step with every chain and a 68 MiB arena, 88 MiB and 48 MiB
    with none; the rule takes layer2.1's and layer3.1's (82 MiB written, 48 MiB arena).
    """
    if window < 1:
        raise ValueError(f"the offload window must be at least 1 layer, got {window}")
    plan, chains = plan_with_chains(units, window, steps, recompute or {}, frozenset())
    taken: frozenset[tuple[int, str]] = frozenset()
    tried: set[tuple[int, str]] = set()
    while pending := [key for key in chains if key not in taken and key not in tried]:
        key = pending[0]
        tried.add(key)
        trial, trial_chains = plan_with_chains(units, window, steps, recompute or {}, taken | {key})
        # the units' bytes decide; the tail a rebuild's conv works in (a few MiB) is the price of any rebuild.
        # Taking a chain can make its readers chains themselves (they were rebuilt from its swapped bytes): they
        # are tried next, and the chain is taken only if the plan writes no more than without it.
        if (trial.arena_bytes - trial.rebuild_scratch_bytes <= plan.arena_bytes - plan.rebuild_scratch_bytes
                and trial.offloaded_bytes <= plan.offloaded_bytes and key in {u.key for u in trial.recomputed}):
            plan, taken, chains = trial, taken | {key}, trial_chains
    if budget_bytes is not None and plan.arena_bytes < budget_bytes:
        plan = keep_within(plan, units, recompute or {}, taken, budget_bytes)
    return plan


def largest_window(units: Sequence[UnitSpec], plan_at: Callable[[int], OffloadPlan], budget_bytes: int | None,
                   min_window: int = 1) -> int:
    """The largest useful window: past it nothing is written any more, or (with a budget) the window's own
    plan (``plan_at(N)``, no units kept for the budget) needs more arena than the budget: bisected, the arena
    grows with the window."""
    # A unit is written while backward_start - N > forward_end + N + 1 (occupations_for).
    gaps = [u.backward_start - u.forward_end - 1 for u in units if u.backward_start is not None]
    nothing_written = max([min_window] + [(gap + 1) // 2 for gap in gaps])
    if budget_bytes is None:
        return nothing_written
    low, high = min_window, nothing_written
    while low < high:
        middle = (low + high + 1) // 2
        if plan_at(middle).arena_bytes <= budget_bytes:
            low = middle
        else:
            high = middle - 1
    return low


def budget_refusal(units: Sequence[UnitSpec], plan_at: Callable[[int], OffloadPlan], budget_bytes: int,
                   window: int | None, min_window: int = 1, batch_size: int | None = None) -> str | None:
    """Why ``budget_bytes`` cannot hold the run, in one line that says what to do, or None when it can: the
    smallest window's plan does not fit, or the fixed ``window``'s does not (naming the largest that does).
    The scheduler and ``engine memory`` refuse with these same words."""
    size = format_bytes
    smallest = plan_at(min_window).arena_bytes
    if smallest > budget_bytes:
        at = f" at batch size {batch_size}" if batch_size is not None else ""
        return (f"offload budget {size(budget_bytes)} is below what the smallest window needs{at}: {size(smallest)} "
                f"(window {min_window}); raise --offload-budget or lower the batch size")
    if window is not None and plan_at(window).arena_bytes > budget_bytes:
        return (f"--offload-n {window} needs {size(plan_at(window).arena_bytes)} of resident memory, more than "
                f"--offload-budget {size(budget_bytes)}; the budget allows "
                f"N={largest_window(units, plan_at, budget_bytes, min_window)}")
    return None


def keep_within(plan: OffloadPlan, units: Sequence[UnitSpec], recompute: Mapping[tuple[int, str], Recompute],
                chained: frozenset[tuple[int, str]], budget_bytes: int) -> OffloadPlan:
    """``plan`` with swapped units kept resident instead, largest first, while the arena fits ``budget_bytes``.

    Why (issue 11, Capuchin's keep-or-swap per tensor): a byte budget larger than the window's arena
    was spent on a larger window, which keeps only the units next to the turn from forward to
    backward, the smallest ones. MobileNetV2 (CIFAR, batch 32): N=4 writes 206.5 MiB per step with an
    81 MiB arena, N=12 202.1 MiB with 150 MiB, N=32 193.0 MiB with 217 MiB; ResNet-18: 82.1 MiB at
    48 MiB, 79.1 at 80, 68.0 at 124. A unit kept whole costs its bytes at the turn (every kept unit
    is live there) and removes the same bytes from the disk's writes and reads, whichever unit it
    is, so the largest go first: the fewest units (and IO calls) for the bytes. Each is taken when the
    plan with it still fits (first fit is not monotone in what it places). Tried and dropped: the units
    nearest the turn first (latest made), whose IO no compute hides. MobileNetV2 at 224, batch 32, under
    610 MiB: it swapped 13 early units instead of 36 late small ones (166.9 against 167.7 MiB written),
    and the stall went from 62-81 to 59-63 ms a step, but the step did not move (1.23-1.37 against
    1.23-1.39 s, three alternating rounds of ``engine train --offload-n auto``). Then, with what is left,
    the recomputed units (ReLU outputs): keeping one saves the executor its rebuild pass (~75 µs per
    MiB here), less per byte than a swap saves (the IO threads' ~60 µs per MiB each way, about as much
    again in kernels slowed beside them, and the disk's time), so they come second. The window's own
    units and the chains stay as ``build_plan`` chose them. Keeping changes no arithmetic: the same
    bytes are read, from memory instead of the disk, or the ReLU's output as its forward wrote it.
    """
    def by_size(unit: UnitPlan) -> tuple[int, int, tuple[int, str]]:
        return (-unit.nbytes, unit.spec.created, unit.key)

    kept: frozenset[tuple[int, str]] = frozenset()

    for unit in sorted(plan.offloaded, key=by_size) + sorted(plan.recomputed, key=by_size):
        trial, _ = plan_with_chains(units, plan.window, plan.steps, recompute, chained, kept | {unit.key}, links=False)
        if trial.arena_bytes <= budget_bytes:
            kept = kept | {unit.key}
    return plan_with_chains(units, plan.window, plan.steps, recompute, chained, kept)[0] if kept else plan


def plan_with_chains(units: Sequence[UnitSpec], window: int, steps: int, recompute: Mapping[tuple[int, str], Recompute],
                chained: frozenset[tuple[int, str]], kept: frozenset[tuple[int, str]] = frozenset(),
                links: bool = True) -> tuple[OffloadPlan, list[tuple[int, str]]]:
    """The plan with the chains in ``chained`` taken, and the chain candidates (forward order); the
    units in ``kept`` stay resident from their forward to their backward, never written. ``links=False``
    leaves ``predecessors`` empty: half of the time, for a trial that only compares arena sizes."""
    units = [u for u in units if u.tensors]
    file_offsets, file_bytes = file_layout(units)
    chosen: dict[tuple[int, str], Recompute] = {}
    needed_from: dict[tuple[int, str], int] = {}
    keys = {u.key for u in units}
    chains: list[tuple[int, str]] = []

    def need(key: tuple[int, str], at: int) -> None:
        """``key`` must be in memory from backward step ``at``: a rebuilt one's sources too, transitively."""
        if needed_from.get(key, at + 1) <= at:
            return
        needed_from[key] = at
        if key in chosen:
            for source in chosen[key].source_units:
                need(source, at)

    for u in sorted(units, key=lambda u: u.created):  # forward order: a source is decided before its readers
        candidate = recompute.get(u.key)
        if candidate is None or u.key in kept or not occupations_for(u, window)[1]:
            continue  # nothing to rebuild from, or the window keeps it anyway
        if any(key not in keys for key in candidate.source_units):
            continue
        if any(key in chosen for key in candidate.source_units):
            chains.append(u.key)
            if u.key not in chained:
                continue
        chosen[u.key] = candidate
        for key in candidate.source_units:
            need(key, u.backward_start)
    spans = {}
    for u in units:
        start = needed_from.get(u.key)
        if start is not None and u.backward_start is not None:
            start = min(start, u.backward_start)
        occupations, written = occupations_for(u, window, start)
        if u.key in kept and written:  # keep_within: one span from its forward to its backward
            occupations, written = (Occupation(u.key, 0, u.created, u.backward_end),), False
        if not written:  # needed early enough (a chained rebuild reads it) that it stays resident
            chosen.pop(u.key, None)
        spans[u.key] = (occupations, written and u.key not in chosen)
    load_at = {u.key: min(needed_from.get(u.key, u.backward_start), u.backward_start)
               for u in units if u.backward_start is not None}

    # Largest first, earlier first among equals: the TFLite arena order; first fit at the lowest offset.
    order = sorted(range(len(units)), key=lambda i: (-units[i].footprint, units[i].created, units[i].key))
    offsets = first_fit([u.footprint for u in units],
                        [[(o.start, o.end) for o in spans[u.key][0]] for u in units], order)
    placed = {u.key: offset for u, offset in zip(units, offsets)}

    plans = {
        u.key: UnitPlan(u, placed[u.key], spans[u.key][1], spans[u.key][0],
                        file_offsets.get(u.key) if spans[u.key][1] else None, chosen.get(u.key), load_at.get(u.key))
        for u in units
    }
    arena_bytes = max((p.arena_offset + p.nbytes for p in plans.values()), default=0)
    lower_bound, peak_units = _resident_profile(plans.values(), steps)
    # the rebuilds run one at a time on the executor: one tail for the largest working memory among those taken
    scratch = max((p.recompute.scratch_bytes for p in plans.values() if p.recompute is not None), default=0)
    scratch_offset = align(arena_bytes, PAGE)
    if scratch:
        arena_bytes, lower_bound = scratch_offset + align(scratch, PAGE), lower_bound + align(scratch, PAGE)
    return OffloadPlan(
        window=window,
        steps=steps,
        units=plans,
        arena_bytes=arena_bytes,
        lower_bound_bytes=lower_bound,
        peak_units=peak_units,
        total_bytes=sum(u.footprint for u in units),
        file_bytes=file_bytes,
        predecessors=_predecessors(plans.values()) if links else {},
        kept=frozenset(key for key in kept if key in plans and not spans[key][1] and key not in chosen),
        rebuild_scratch_offset=scratch_offset if scratch else 0,
        rebuild_scratch_bytes=align(scratch, PAGE) if scratch else 0,
    ), chains


def _spans_overlap(a: Sequence[Occupation], b: Sequence[Occupation]) -> bool:
    return any(x.overlaps(y) for x in a for y in b)


def _resident_profile(plans: Sequence[UnitPlan] | object, steps: int) -> tuple[int, int]:
    plans = list(plans)  # type: ignore[arg-type]
    last = max([o.end for p in plans for o in p.occupations] + [steps - 1, 0])
    bytes_at = np.zeros(last + 2, dtype=np.int64)
    units_at = np.zeros(last + 2, dtype=np.int64)
    for p in plans:
        for o in p.occupations:
            bytes_at[o.start] += p.nbytes
            bytes_at[o.end + 1] -= p.nbytes
            units_at[o.start] += 1
            units_at[o.end + 1] -= 1
    return int(np.cumsum(bytes_at).max(initial=0)), int(np.cumsum(units_at).max(initial=0))


def _predecessors(plans: Sequence[UnitPlan] | object) -> dict[tuple[tuple[int, str], int], tuple]:
    """For each span, the earlier spans of the same bytes: they must be vacated before it moves in."""
    plans = list(plans)  # type: ignore[arg-type]
    result: dict[tuple[tuple[int, str], int], tuple] = {}
    for p in plans:
        lo, hi = p.arena_offset, p.arena_offset + p.nbytes
        for occ in p.occupations:
            before = []
            for q in plans:
                if q.arena_offset >= hi or lo >= q.arena_offset + q.nbytes:
                    continue
                for other in q.occupations:
                    if other.end < occ.start:
                        before.append((q.key, other.index))
            result[(p.key, occ.index)] = tuple(sorted(before))
    return result


@dataclass(frozen=True)
class StepTensor:
    """A tensor of the step's own arena (``Network.arena_plan``: activation gradients, working memory, per-layer
    gradients) as ``place_around`` sees it: its bytes from the region's start and its moments [first, last]."""

    offset: int
    nbytes: int
    first: int
    last: int


@dataclass(frozen=True)
class SharedLayout:
    """An offload plan whose units share one region with the step arena's tensors (``place_around``).

    The step arena keeps its offsets from the region's start; the units sit in the bytes its tensors leave free while
    they are alive. Two orders the executor and the IO threads must then keep, besides the units' own
    ``predecessors``: a unit's occupation that moves into bytes a step tensor used before it waits until the executor
    has passed that tensor's last moment (``gates``: the loader may bring a unit back before its planned span opens);
    a step tensor made in bytes a unit occupied before waits until the unit has left them (``waits``: a save may
    still be writing them out)."""

    plan: OffloadPlan  # the plan's units at their offsets in the region; ``arena_bytes`` the region's bytes
    step_bytes: int  # the step arena's bytes: its tensors end below this (from offset 0)
    gates: dict[tuple[tuple[int, str], int], int]  # (unit, occupation) -> the last moment of a step tensor before it
    waits: dict[int, tuple[tuple[tuple[int, str], int], ...]]  # moment -> occupations to be vacated before it
    step_offsets: tuple[int, ...] | None = None  # the step tensors' offsets when placed with the units (None: theirs)
    own_step_bytes: int = 0  # the step arena's planned peak alone (what a run's other figures count it as)

    @property
    def region_bytes(self) -> int:
        return self.plan.arena_bytes

    @property
    def extra_bytes(self) -> int:
        """What the offload plan adds to the step arena: the region beyond the step arena's own planned peak."""
        return max(0, self.region_bytes - self.own_step_bytes)


def place_around(plan: OffloadPlan, tensors: Sequence[StepTensor], step_bytes: int) -> SharedLayout:
    """``plan``'s units placed in one region with the step arena's ``tensors`` (``SharedLayout``).

    The offload arena peaks early in the forward (the first layers' units being written while the next are made) and
    the step arena late in the backward (the activation gradients of the largest planes): planned apart, a run needs
    the sum of both peaks; in one region, the most both hold at once. Units are placed as ``plan_with_chains`` places
    them (largest first, first fit, one page-aligned offset for both spans), around the step tensors alive during
    their spans; or both placed together in TFLite's order, whichever region is smaller (then the step arena takes
    its offsets from here: ``step_offsets``); the rebuilds' working memory goes on top, as before. When neither is
    smaller than the two arenas side by side, they are put side by side (the units above the step's bytes): never
    worse than apart. ``python benchmarks/shared_region.py`` (``engine memory`` reads ``extra_bytes``), ImageNet
    variants at 224, every chunked layer recomputing, N=1, step arena + units' arena → one region (the most both
    hold at one moment), MiB: ResNet-18 batch 32 79.9 + 106.6 → 137.5 (125.1), batch 128 253.5 + 419.0 → 492.5
    (441.0); MobileNetV2 batch 32 208.3 + 223.1 → 394.6 (368.7), batch 128 748.4 + 884.6 → 1,472.6 (1,434.4).
    Around the step arena's own layout alone, MobileNetV2 batch 32 needed 417.7 and batch 128 no less than apart:
    its step arena, laid out alone, leaves its free bytes where the units cannot use them."""
    units = sorted(plan.units.values(), key=lambda u: (-u.nbytes, u.spec.created, u.key))
    unit_spans = [[(o.start, o.end) for o in u.occupations] for u in units]
    # around: the step tensors where the step arena put them, the units in what they leave
    fixed = [(t.offset, t.offset + t.nbytes, t.first, t.last) for t in tensors]
    around = first_fit([u.nbytes for u in units], unit_spans, range(len(units)), [PAGE] * len(units), fixed)
    # together: both placed at once, TFLite's order over all of them (MobileNetV2's step arena and its units overlap
    # little as the step arena lays itself out alone)
    sizes = [t.nbytes for t in tensors] + [u.nbytes for u in units]
    spans = [[(t.first, t.last)] for t in tensors] + unit_spans
    together = first_fit(sizes, spans, greedy_order(sizes, spans), [1] * len(tensors) + [PAGE] * len(units))
    n = len(tensors)
    step_end = max((o + t.nbytes for o, t in zip(together[:n], tensors)), default=0)
    candidates = [  # (region without the rebuilds' tail, step tensors' offsets or None, their bytes, units' offsets)
        (align(max([step_bytes] + [o + u.nbytes for o, u in zip(around, units)]), PAGE), None, step_bytes,
         dict(zip((u.key for u in units), around))),
        (align(max([step_end] + [o + u.nbytes for o, u in zip(together[n:], units)]), PAGE), tuple(together[:n]),
         step_end, dict(zip((u.key for u in units), together[n:]))),
    ]
    own = step_bytes
    top, step_offsets, step_bytes, offsets = min(candidates, key=lambda c: c[0])
    base = align(step_bytes, PAGE)
    apart = align(candidates[0][2], PAGE) + plan.arena_bytes
    if top + plan.rebuild_scratch_bytes >= apart:  # no better than side by side: side by side
        step_offsets, step_bytes = None, candidates[0][2]
        base = align(step_bytes, PAGE)
        offsets = {key: base + p.arena_offset for key, p in plan.units.items()}
        scratch_offset = base + plan.rebuild_scratch_offset
        region = apart
    else:
        scratch_offset = top
        region = top + plan.rebuild_scratch_bytes
    units_placed = {key: replace(p, arena_offset=offsets[key]) for key, p in plan.units.items()}
    shared = replace(plan, units=units_placed, arena_bytes=region, predecessors=_predecessors(units_placed.values()),
                     rebuild_scratch_offset=scratch_offset if plan.rebuild_scratch_bytes else 0)
    if step_offsets is not None:
        tensors = [replace(t, offset=o) for t, o in zip(tensors, step_offsets)]
    gates: dict[tuple[tuple[int, str], int], int] = {}
    waits: dict[int, list[tuple[tuple[int, str], int]]] = {}
    for p in units_placed.values():
        lo, hi = p.arena_offset, p.arena_offset + p.nbytes
        for t in tensors:
            if t.offset >= hi or lo >= t.offset + t.nbytes:
                continue
            for o in p.occupations:
                if t.last < o.start:
                    gates[(p.key, o.index)] = max(gates.get((p.key, o.index), -1), t.last)
                elif o.end < t.first:
                    waits.setdefault(t.first, []).append((p.key, o.index))
                else:
                    raise AssertionError(f"unit {p.spec.label!r} shares bytes with a live step tensor")  # first fit
    return SharedLayout(shared, int(step_bytes), gates, {m: tuple(sorted(set(v))) for m, v in waits.items()},
                        step_offsets, int(own))


def check_plan(plan: OffloadPlan) -> None:
    """Raise AssertionError when two spans that overlap in time share bytes (used by the tests)."""
    plans = list(plan.units.values())
    for i, p in enumerate(plans):
        for q in plans[i + 1:]:
            if p.arena_offset >= q.arena_offset + q.nbytes or q.arena_offset >= p.arena_offset + p.nbytes:
                continue
            if _spans_overlap(p.occupations, q.occupations):
                raise AssertionError(f"units {p.spec.label!r} and {q.spec.label!r} share arena bytes while both live")
        if p.arena_offset + p.nbytes > plan.arena_bytes:
            raise AssertionError(f"unit {p.spec.label!r} lies past the arena")


@dataclass(frozen=True)
class TensorUse:
    """One tensor a node creates, in creation order, with the steps that read it."""

    name: str
    array_type: ArrayType
    shape: tuple[int, ...]
    dtype: np.dtype
    forward_end: int  # last forward step reading it (its own step at least)
    backward_start: int | None  # first backward step reading it; None when no backward does
    backward_end: int | None


def group_units(
    created: Mapping[int, int], names: Mapping[int, str], uses: Mapping[int, Sequence[TensorUse]],
    outputs_apart: Mapping[int, str] | None = None,
) -> tuple[list[UnitSpec], dict[int, list[tuple[tuple[int, str], TensorSpec]]]]:
    """Split each node's tensors into a "saved" unit (a backward reads them) and a "transient" one;
    ``outputs_apart`` (node -> tensor name): that saved tensor in an "output" unit of its own, which the
    plan may rebuild from the node's saved unit instead of swapping it (a chunked layer's output,
    ``recompute_candidates``).

    Returns the units and, per node, its creations in order: (unit key, tensor spec), which is what
    the scheduler checks every ``create`` against.
    """
    units: list[UnitSpec] = []
    creations: dict[int, list[tuple[tuple[int, str], TensorSpec]]] = {}
    apart = outputs_apart or {}
    for owner, tensor_uses in uses.items():
        parts = {"saved": [u for u in tensor_uses if u.backward_start is not None and u.name != apart.get(owner)],
                 "output": [u for u in tensor_uses if u.backward_start is not None and u.name == apart.get(owner)],
                 "transient": [u for u in tensor_uses if u.backward_start is None]}
        by_use: dict[int, tuple[tuple[int, str], TensorSpec]] = {}
        for part, members in parts.items():
            if not members:
                continue
            tensors = layout_tensors([(m.name, m.array_type, m.shape, m.dtype) for m in members])
            saved = part != "transient"
            unit = UnitSpec(
                owner=owner,
                part=part,
                name=names[owner],
                tensors=tensors,
                created=created[owner],
                forward_end=max(m.forward_end for m in members),
                backward_start=min(m.backward_start for m in members) if saved else None,  # type: ignore[type-var]
                backward_end=max(m.backward_end for m in members) if saved else None,  # type: ignore[type-var]
            )
            units.append(unit)
            for m, t in zip(members, tensors):
                by_use[id(m)] = (unit.key, t)
        creations[owner] = [by_use[id(m)] for m in tensor_uses]
    return units, creations


class ProgramBuffer(Protocol):
    """What the offload plan reads of one buffer of a step program (``engine.program.Buffer``)."""

    @property
    def name(self) -> str: ...
    @property
    def owner(self) -> int | None: ...
    @property
    def array_type(self) -> ArrayType: ...
    @property
    def offloadable(self) -> bool: ...  # a node's ACTIVATIONS or FF_CACHE buffer: a unit's
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def dtype(self) -> np.dtype: ...
    @property
    def first(self) -> int: ...
    @property
    def uses(self) -> tuple[int, ...]: ...


class StepProgram(Protocol):
    """What the offload plan reads of a compiled training iteration (``engine.program.Program``)."""

    @property
    def buffers(self) -> Sequence[ProgramBuffer]: ...
    @property
    def moments(self) -> int: ...
    @property
    def node_names(self) -> list[str]: ...
    @property
    def graph(self) -> Any: ...  # engine.graph.Graph: the layers a recompute runs, and who reads whom
    @property
    def batch_size(self) -> int: ...


def program_units(program: StepProgram) -> tuple[list[UnitSpec], dict[int, list], int]:
    """The units of a training program: (units, creations per node, timeline length).

    A node's ACTIVATIONS and FF_CACHE buffers, in the order the program says the node creates them;
    a buffer's forward span ends at its last use before moment L, its backward span covers its uses
    from moment L on (the program's ``uses``: consumers' forwards, the backwards that keep it, the
    loss head holding the logits). A buffer no backward uses is transient: never written.
    """
    steps = program.moments
    names = program.node_names
    uses: dict[int, list[TensorUse]] = {i: [] for i in range(len(names))}
    for b in program.buffers:
        if not b.offloadable:
            continue
        forward_end = max([b.first, *(t for t in b.uses if t < steps // 2)])
        backward = [t for t in b.uses if t >= steps // 2]
        uses[b.owner].append(TensorUse(b.name, b.array_type, tuple(b.shape), np.dtype(b.dtype), forward_end,
                                       min(backward) if backward else None, max(backward) if backward else None))
    indices = range(len(names))
    apart = {node.index: f"{node.name}:out" for node, _ in _rebuilt_outputs(program)}
    units, creations = group_units({i: i for i in indices}, {i: names[i] for i in indices}, uses, apart)
    return units, creations, steps


def _rebuilt_outputs(program: StepProgram) -> list[tuple[Any, str]]:
    """(node, what it rebuilds its output from) for the layers that can (``ChunkedConvBN.output_rebuilt_from``:
    "y", its own saved tensor, or "x", its input: a unit, or the network's input, ``NETWORK_INPUT``), at the
    program's batch size."""
    graph = getattr(program, "graph", None)
    if graph is None:
        return []
    found = []
    shapes = graph.shapes(program.batch_size)
    for node in graph.nodes:
        rebuilt_from = getattr(node.layer, "output_rebuilt_from", None)
        if rebuilt_from is None:
            continue
        source = rebuilt_from(tuple(shapes[node.inputs[0]]))
        if source is not None:
            found.append((node, source))
    return found


def recompute_candidates(program: StepProgram, units: Sequence[UnitSpec]) -> dict[tuple[int, str], Recompute]:
    """Saved units that can be rebuilt instead of swapped: the output of a ``recomputable`` layer
    (ReLU) whose saved unit holds nothing else, from its input when that input is kept in its
    producer's saved unit anyway (a batch norm keeps its output: In-Place ABN); or, when its input is
    an Add read by nothing else, from the Add's two inputs (Add, then ReLU in place). ``build_plan``
    takes a candidate only when the window would write it, and one whose source is rebuilt itself
    (chained) only when the arena does not grow.

    Why (issue 11): such an output costs a write and a read of its bytes per step; rebuilding it is
    one or two elementwise passes over bytes in memory anyway, with the same bits. Capuchin decides
    per tensor between swap and recompute by their costs; here the choice is structural, because a
    ReLU pass is cheaper than the XXH3 hash alone of the same bytes, before any disk time.

    The same holds inside a chunked layer (``ChunkedConvBN`` in keep mode with an activation and no pool):
    it saves y for its own backward and its output, activation(y), for the next conv's; ``program_units``
    puts the output in an "output" unit of its own, rebuilt from the layer's saved y by the activation's
    kernel (``output_rebuilt_from``), so y is loaded from the next conv's backward on instead. In recompute
    mode (no y) a chunked layer rebuilds its output from its input (its producer's output, kept or rebuilt
    itself: a chain; or the network's input, ``NETWORK_INPUT``) and its saved scale and shift, the forward's
    pass 2 again: the one convolution the plan recomputes, because there the IO is what a tight limit waits
    for (MobileNetV2 at 224 under 620 MiB: stall 255-302 → 117-137 ms a step). A conv that needs working
    memory on a chunk gets it from the arena's tail (``Recompute.scratch_bytes``, planned by
    ``plan_with_chains``), so nothing the plan does not count is allocated.

    Why no convolution outside a chunked layer is recomputed (Capuchin's other choice, measured before
    building it, at N=4, where the disk keeps up): in
    MobileNetV2 at N=4 the plan writes 206 MiB per step at batch 32, 47% of it the expand batch
    norms' outputs (97 MiB), 39% the depthwise ones' (80 MiB). Rebuilding an expand output means the
    1×1 conv's forward from the block input plus a batch-norm pass. ``benchmarks/offload_costs.py``
    (AMD EPYC, 2 cores, steps of all configurations alternating in one process, nothing else running)
    measured that work at its place in the backward: 33 ms per step at batch 32 and 139 ms at batch
    128, against an IO-removal upper bound (those units kept resident, nothing written) of 24-36 ms
    and 87 ms. Step with offload / without: batch 32 1.260x as is, 1.164x kept, 1.289x with the
    recompute's work; batch 128 1.130x, 1.072x, 1.175x. Only blocks 2-4 (the cheapest per byte:
    16-24 input channels, 48 MiB): 10.6-10.8 ms of work, and two runs within their noise (+31 and
    -13 ms against N=4). On two cores that the kernels keep busy the conv costs what the IO it saves
    costs, so the choice stays structural: ReLU and Add outputs, and the chunked layers' above. The
    depthwise outputs would need the depthwise conv (18-20 ms per step at batch 32) for at most 18-26 ms.
    """
    nodes = program.graph.nodes
    shapes = program.graph.shapes(program.batch_size)
    saved = {u.owner: u for u in units if u.part == "saved" and u.tensors}
    outputs = {u.owner: u for u in units if u.part == "output" and u.tensors}

    def held(index: int, name: str, *parts: dict[int, UnitSpec]) -> tuple[tuple[int, str], TensorSpec] | None:
        """Node ``index``'s tensor ``name`` and the unit holding it, looked for in ``parts`` in order."""
        for part in parts if index >= 0 else ():
            unit = part.get(index)
            tensor = None if unit is None else next(
                (t for t in unit.tensors if t.name == f"{nodes[index].name}:{name}"), None)
            if tensor is not None:
                return unit.key, tensor  # type: ignore[union-attr]
        return None

    def kept_output(index: int) -> tuple[tuple[int, str], TensorSpec] | None:
        return held(index, "out", saved)

    result: dict[tuple[int, str], Recompute] = {}
    for node in nodes:
        unit = saved.get(node.index)
        if (unit is None or not node.layer.recomputable or len(node.inputs) != 1 or len(unit.tensors) != 1
                or unit.tensors[0].name != f"{node.name}:out"):
            continue
        chain: tuple[int, ...] = (node.index,)
        first = node.inputs[0]
        source = kept_output(first)
        sources = [source] if source is not None else []
        if source is None and first >= 0:  # a recomputable producer read by nothing else (Add): rebuild it too
            producer = nodes[first]
            if producer.layer.recomputable and producer.consumers == (node.index,) and first not in saved:
                chain = (first, node.index)
                sources = [kept_output(i) for i in producer.inputs]  # type: ignore[misc]
        if not sources or any(s is None for s in sources):
            continue
        if any(t.shape != unit.tensors[0].shape for _, t in sources):
            continue
        result[unit.key] = Recompute(chain, tuple(sources), unit.tensors[0])  # type: ignore[arg-type]
    for node, source in _rebuilt_outputs(program):  # a chunked layer's output kept apart: from its y, or its x
        unit = outputs.get(node.index)
        if unit is None:
            continue
        first = node.inputs[0]
        if source == "y":
            found = [held(node.index, "y", saved)]
        else:  # its input: the network's, or its producer's output, kept or rebuilt (a chain)
            network_input = TensorSpec("input", ArrayType.INPUT, tuple(shapes[first]), np.dtype(np.float32), 0)
            source_input = held(first, "out", saved, outputs) if first >= 0 else (NETWORK_INPUT, network_input)
            found = [source_input, held(node.index, "scale_shift", saved)]
        scratch = 0 if source == "y" else 4 * node.layer.rebuild_scratch_elements(tuple(shapes[first]))
        if all(f is not None for f in found):
            result[unit.key] = Recompute((node.index,), tuple(found), unit.tensors[0],  # type: ignore[arg-type]
                                         scratch)
    return result

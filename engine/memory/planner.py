"""The static memory planner: one offset per tensor, chosen before the first step from known lifespans.

A training step makes the same tensors in the same order every time, and the graph knows when each
one is first written and last read. Two tensors that are never alive together may share bytes, so
instead of keeping every tensor of the step at once (a bump workspace) we give each one a fixed
offset in one arena, the way TFLite's arena planner does:

* order: tensors alive for the whole timeline first, then by non-increasing size (earlier first
  among equals, then the caller's order, so the plan is deterministic);
* place: first fit, the lowest offset where the tensor does not overlap any already placed tensor
  whose lifespan overlaps its own.

``planned_peak`` is the arena size this gives; ``lower_bound`` is the most bytes alive at any one
step, what no placement can beat (XLA's ``HeapSimulator::MinimumMemoryForModule`` yardstick). The
greedy order usually lands within a few percent of it.

The placement works on *spans*: an item may hold its bytes during several disjoint intervals (the
offload plan's units do: before they are saved and after they are loaded back), and must keep one
offset for all of them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

ALIGNMENT = 64  # bytes, as the workspaces align their views

Span = tuple[int, int]  # [first, last] steps, both inclusive


def align(nbytes: int, to: int = ALIGNMENT) -> int:
    return (int(nbytes) + to - 1) // to * to


@dataclass(frozen=True)
class Placement:
    """Offsets (bytes, in the items' order), the arena size they need, and the fragmentation-free bound."""

    offsets: tuple[int, ...]
    planned_peak: int
    lower_bound: int


def _overlap(a: Sequence[Span], b: Sequence[Span]) -> bool:
    return any(x0 <= y1 and y0 <= x1 for x0, x1 in a for y0, y1 in b)


def first_fit(sizes: Sequence[int], spans: Sequence[Sequence[Span]], order: Sequence[int],
              granules: Sequence[int] | None = None, fixed: Sequence[tuple[int, int, int, int]] = ()) -> list[int]:
    """Place items in ``order`` at the lowest offset free of every placed item whose spans overlap theirs.

    Returns one offset per item (in the items' order, not ``order``). Sizes are used as given: align
    them first if the arena needs aligned offsets. ``granules``: per item, the unit its offset and the extent it
    keeps clear of others are whole multiples of (the offload plan's units take whole pages among 64-byte
    tensors: ``engine.offload.plan.place_around``); ``fixed``: (start, end, first, last) bytes and moments already
    taken.
    """
    if sorted(order) != list(range(len(sizes))) or len(spans) != len(sizes):
        raise ValueError("first_fit: order must be a permutation of the items, with one span list per size")
    offsets: list[int | None] = [None] * len(sizes)
    placed: list[int] = []
    # each item's first and last moment: items whose hulls do not meet cannot overlap, a test that skips the
    # span-by-span one for most pairs (it was 40% of ``engine memory --model mobilenetv2``'s CPU time)
    hulls = [(min(s for s, _ in item), max(e for _, e in item)) if item else (math.inf, -math.inf)
             for item in spans]
    for item in order:
        size = int(sizes[item])
        lo, hi = hulls[item]
        granule = int(granules[item]) if granules is not None else 1
        taken = [(start, end) for start, end, first, last in fixed
                 if first <= hi and lo <= last and _overlap(spans[item], [(first, last)])]
        taken += [(offsets[other], offsets[other] + int(sizes[other]))  # type: ignore[operator]
                  for other in placed
                  if hulls[other][0] <= hi and lo <= hulls[other][1] and _overlap(spans[item], spans[other])]
        if granule > 1:
            taken = [(start // granule * granule, align(end, granule)) for start, end in taken]
        offset = 0
        for start, end in sorted(taken):
            if offset + size <= start:
                break
            offset = max(offset, end)
        offsets[item] = offset
        placed.append(item)
    return [int(o) for o in offsets]  # type: ignore[arg-type]


def greedy_order(sizes: Sequence[int], spans: Sequence[Sequence[Span]],
                 late: Sequence[bool] | None = None) -> list[int]:
    """TFLite's order: items alive over the whole timeline first, then largest first, earlier first; ``late`` items
    after all the others, in the same order among themselves. A late item fills a gap the others leave, or goes on
    top: the working memory a recomputing chunked layer takes only where its moment has room
    (``Network._widen_chunks``), which placed by its size among the others would move them."""
    if not sizes:
        return []
    start = min(s for item in spans for s, _ in item)
    end = max(e for item in spans for _, e in item)
    late = late if late is not None else [False] * len(sizes)

    def key(i: int) -> tuple[bool, bool, int, int, int]:
        whole = any(s <= start and e >= end for s, e in spans[i])
        return (bool(late[i]), not whole, -int(sizes[i]), min(s for s, _ in spans[i]), i)

    return sorted(range(len(sizes)), key=key)


def lower_bound(sizes: Sequence[int], spans: Sequence[Sequence[Span]]) -> int:
    """The most bytes alive at one step: a sweep over span starts and ends."""
    events: dict[int, int] = {}
    for size, item in zip(sizes, spans):
        for s, e in item:
            events[s] = events.get(s, 0) + int(size)
            events[e + 1] = events.get(e + 1, 0) - int(size)
    live = best = 0
    for step in sorted(events):
        live += events[step]
        best = max(best, live)
    return best


def plan_offsets(sizes: Sequence[int], spans: Sequence[Sequence[Span]],
                 late: Sequence[bool] | None = None) -> Placement:
    """The TFLite plan for items of ``sizes`` bytes alive during ``spans``: offsets, planned peak, lower bound.
    ``late`` items are placed after all the others (``greedy_order``)."""
    for size, item in zip(sizes, spans):
        if size < 0 or not item or any(s > e for s, e in item):
            raise ValueError(f"plan_offsets: bad item (size {size}, spans {item}): sizes >= 0, spans first <= last")
    offsets = first_fit(sizes, spans, greedy_order(sizes, spans, late))
    peak = max((o + int(s) for o, s in zip(offsets, sizes)), default=0)
    return Placement(tuple(offsets), peak, lower_bound(sizes, spans))

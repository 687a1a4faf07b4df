"""Per-step history in fixed memory: a long run must not grow with its step count.

Measured before (issue 14): ~2.3 KiB kept per step forever (the memory monitor's record of every
step, the offload scheduler's StepStats of every step, every step's loss and time), +45 MiB over
20,000 steps. Each is now bounded:

- ``History``: the last ``maxlen`` items of a growing sequence, indexed as the whole sequence
  (``len()`` counts every item ever appended, ``history[-1]`` is the latest, ``history[k:]`` works
  while k is within the kept window). For the scheduler's StepStats: callers take the latest step or
  the few steps since they started measuring.
- ``Thinned``: a list that keeps every ``stride``-th item; when it reaches ``capacity`` it drops
  every other item and doubles the stride, so it always spans the whole run evenly (for the memory
  plot). Below ``capacity`` it is the plain list of everything.

Totals (peaks, sums) are kept as running values by their owners, exact whatever was dropped; the
full per-step detail goes to the JSON-lines memory log, on disk, when one is asked for.

Measured (20,000 steps of a 2-layer 8-wide MLP on 4×4 inputs, batch 4, RSS growth from step 2,000 to
the end; 2 cores shared with other jobs, one run each): before, +25.3 MiB without offload and +41.8 MiB
with ``--offload-n 1`` (2.4 KiB per step); after, +3.0 and +3.8 MiB with a 4,096-record cap, all of it
before step 5,000 (the cap filling); +0.05 and +0.16 MiB from step 5,000 to 20,000. With the cap at
1,024 records (now): +0.13 MiB with offload from step 2,000 to 20,000. The test:
``pytest --slow tests/engine/test_bounded_history.py``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Generic, TypeVar, overload

T = TypeVar("T")


class History(Generic[T]):
    """The last ``maxlen`` items, indexed by their position in everything ever appended."""

    def __init__(self, maxlen: int = 1024):
        if maxlen < 1:
            raise ValueError(f"History: maxlen must be at least 1, got {maxlen}")
        self.maxlen = maxlen
        self._items: deque[T] = deque(maxlen=maxlen)
        self._count = 0

    def append(self, item: T) -> None:
        self._items.append(item)
        self._count += 1

    def __len__(self) -> int:
        return self._count

    @property
    def first_kept(self) -> int:
        """Index of the oldest item still kept."""
        return self._count - len(self._items)

    @overload
    def __getitem__(self, index: int) -> T: ...

    @overload
    def __getitem__(self, index: slice) -> list[T]: ...

    def __getitem__(self, index: int | slice) -> T | list[T]:
        first = self.first_kept
        if isinstance(index, slice):
            start, stop, step = index.indices(self._count)
            if start < first and start < stop:
                raise IndexError(f"History: item {start} was dropped (only the last {self.maxlen} are kept)")
            return [self._items[i - first] for i in range(start, stop, step)]
        position = index + self._count if index < 0 else index
        if not first <= position < self._count:
            raise IndexError(f"History: no item {index} (items {first}..{self._count - 1} are kept)")
        return self._items[position - first]

    def __iter__(self) -> Iterator[T]:
        return iter(self._items)


class Thinned(list):
    """A list of every ``stride``-th appended item that never holds more than ``capacity`` items."""

    def __init__(self, capacity: int = 1024):
        super().__init__()
        if capacity < 2:
            raise ValueError(f"Thinned: capacity must be at least 2, got {capacity}")
        self.capacity = capacity
        self.stride = 1
        self.offered = 0  # items ever offered to append()

    def append(self, item: T) -> None:  # type: ignore[override]
        if self.offered % self.stride == 0:
            super().append(item)
            if len(self) >= self.capacity:
                del self[1::2]
                self.stride *= 2
        self.offered += 1


__all__ = ["History", "Thinned"]

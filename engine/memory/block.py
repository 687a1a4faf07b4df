"""ContiguousBlock: many named arrays that are really one array.

Parameters, their gradients and the optimizer's state live as long as the model. Keeping each kind
in one block, with every layer's tensor a view into it, makes an optimizer update one kernel call
over ``flat`` and a data-parallel gradient average one allreduce, instead of a loop over layers.
The views are packed back to back in spec order with no padding, so ``flat`` is exactly the
concatenation of the views (and the same offsets index every block built from the same specs).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from engine.memory.array_type import ArrayType


class ContiguousBlock:
    """One zero-initialized allocation holding named views: ``flat`` (1-D, all of it) and ``views[name]``."""

    def __init__(
        self,
        backend: Any,
        array_type: ArrayType,
        specs: list[tuple[str, tuple[int, ...]]],
        dtype: Any = np.float32,
        *,
        manager: Any = None,
    ):
        if not isinstance(array_type, ArrayType):
            raise TypeError(f"ContiguousBlock: array_type must be an ArrayType, got {array_type!r}")
        self.backend = backend
        self.array_type = array_type
        self.dtype = np.dtype(dtype)
        self.offsets: dict[str, tuple[int, int]] = {}  # name -> (start, stop) in elements of flat
        shapes: dict[str, tuple[int, ...]] = {}
        start = 0
        for name, shape in specs:
            if name in shapes:
                raise ValueError(f"ContiguousBlock: the name {name!r} appears twice in the specs; names must be unique")
            shape = tuple(int(s) for s in shape)
            if any(s < 0 for s in shape):
                raise ValueError(f"ContiguousBlock: {name!r} has a negative dimension in {shape}")
            shapes[name] = shape
            stop = start + math.prod(shape)
            self.offsets[name] = (start, stop)
            start = stop
        self.size = start  # elements
        self.nbytes = start * self.dtype.itemsize
        self.flat = backend.alloc_block(self.nbytes).view(self.dtype)
        self.flat.fill(0)
        self.views: dict[str, Any] = {
            name: self.flat[lo:hi].reshape(shapes[name]) for name, (lo, hi) in self.offsets.items()
        }
        if manager is not None:
            manager.track_block(self)

    @property
    def names(self) -> list[str]:
        return list(self.views)

    def __len__(self) -> int:
        return len(self.views)

    def __getitem__(self, name: str) -> Any:
        return self.views[name]

    def zero(self) -> None:
        """Set every element to 0 (for gradients before a backward pass that accumulates)."""
        self.flat.fill(0)

    def __repr__(self) -> str:
        return f"ContiguousBlock({self.array_type.name}, {len(self.views)} arrays, {self.nbytes} bytes)"

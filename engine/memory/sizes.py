"""Shapes and byte sizes: the two facts every memory plan starts from.

They live in ``engine.memory`` (not in the layers) because the planners, the arena, the offload plan
and the step program all size tensors, and the dependencies point one way: layers use memory, never
the reverse.
"""

from __future__ import annotations

from typing import Any

import numpy as np

Shape = tuple[int, ...]


def nbytes(shape: Shape, dtype: Any = np.float32) -> int:
    """Bytes of a dense array of ``shape`` and ``dtype`` (no alignment)."""
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize

"""The CPU kernel table: Numba ``@njit(cache=True)`` kernels behind argument-checking wrappers.

``TABLE`` has the names and signatures of kernels/README.md. Each entry is a plain Python function
that checks its arrays (float32, C-contiguous, matching shapes) and calls the compiled kernel, so a
wrong argument fails with a message instead of compiling a new version or writing into a copy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kernels.reference import build_table

TABLE: dict[str, Callable[..., Any]] = build_table(__name__)

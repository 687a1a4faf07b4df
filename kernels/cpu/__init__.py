"""The CPU kernel table: Numba ``@njit(cache=True)`` kernels behind argument-checking wrappers.

``TABLE`` has the names and signatures of kernels/README.md. Each entry is a plain Python function
that checks its arrays (float32, C-contiguous, matching shapes) and calls the compiled kernel, so a
wrong argument fails with a message instead of compiling a new version or writing into a copy.
"""

from __future__ import annotations

import os

# Numba's OpenMP workers spin after every parallel loop by default. On a busy 2-core machine a
# spinning worker steals the core the next parallel loop (or BLAS) needs: a parallel launch
# measured 8 ms spinning and 0.1 ms passive. This affects every parallel kernel of the table, not
# only conv, and the OpenMP runtime reads the variable once, when it starts (the first parallel
# call), so it is set here, before any kernel module is imported; a value the user set wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from collections.abc import Callable
from typing import Any

from kernels.reference import build_table

TABLE: dict[str, Callable[..., Any]] = build_table(__name__)

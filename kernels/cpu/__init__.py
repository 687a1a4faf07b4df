"""The CPU kernel table: Numba ``@njit(cache=True)`` kernels behind argument-checking wrappers.

``TABLE`` has the names and signatures of kernels/README.md. Each entry is a plain Python function
that checks its arrays (float32, C-contiguous, matching shapes) and calls the compiled kernel, so a
wrong argument fails with a message instead of compiling a new version or writing into a copy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kernels.cpu.cache import guard

# Before any kernel is defined: a cache Numba cannot write is named (not silently ignored), and a
# truncated cache file is compiled again instead of a traceback (kernels/cpu/cache.py says why).
guard()

from kernels.cpu.blas import select_sgemm  # noqa: E402
from kernels.cpu.threads import start_numba_pool  # noqa: E402
from kernels.reference import build_table  # noqa: E402

# MKL's sgemm when the mkl wheel is installed (ResNet-18's step +20%), before any kernel multiplies:
# Numba keeps the first sgemm it finds (kernels/cpu/blas.py says how it was measured).
select_sgemm()

# Numba's OpenMP workers would spin ~5 ms after every parallel loop, holding the core a conv share
# or BLAS needs next (ResNet-18 step: 41-43 images/s spinning, 51-53 passive): start the pool with
# them sleeping when idle, before any kernel runs (kernels/cpu/threads.py says how it was measured).
start_numba_pool()

TABLE: dict[str, Callable[..., Any]] = build_table(__name__)

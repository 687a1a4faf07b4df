"""Shared set-up for the CUDA-simulator kernel tests: tiny GEMM tiles and a closeness check.

The simulator runs one Python thread per CUDA thread, so conv and dense tests swap the production
64×64 register-blocked GEMM for the same kernel built with 8×8 block tiles and 4×4 outputs per
thread (4 threads per block): the code path is the same, the thread and block counts are what the
simulator can afford (it pays per block and per barrier).
"""

from __future__ import annotations

import numpy as np
import pytest

TOLERANCE = 1e-5


def assert_close(actual: np.ndarray, expected: np.ndarray, tol: float = TOLERANCE) -> None:
    """float32 kernels against float64-minded references: an error bound scaled by the result's magnitude."""
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape
    scale = max(1.0, float(np.abs(expected).max(initial=0.0)))
    np.testing.assert_allclose(actual, expected, rtol=0, atol=tol * scale)


@pytest.fixture
def tiny_gemm():
    """Run conv and dense through a small-tile register-blocked GEMM for the duration of a test."""
    from kernels.cuda import gemm

    previous = gemm.use_gemm(gemm.register_blocked_version(8, 8, 8, 4, 4))
    yield gemm.active_gemm()
    gemm.use_gemm(previous)

"""The three GEMM versions against NumPy under the simulator: odd sizes, transposed views, accumulate."""

from __future__ import annotations

import numpy as np
import pytest

from kernels.cuda import gemm
from tests.kernels.cuda.conftest import assert_close

pytestmark = pytest.mark.cudasim

# Small tiles so a 7×9×5 problem spans several blocks and ragged edges in every dimension.
SMALL_VERSIONS = {
    "v1_naive": lambda: gemm.naive_version(threads=4),
    "v2_tiled": lambda: gemm.tiled_version(tile=4),
    "v3_register_blocked": lambda: gemm.register_blocked_version(4, 4, 2, 2, 2),
}


@pytest.mark.parametrize("name", SMALL_VERSIONS)
@pytest.mark.parametrize("M, K, N", [(7, 5, 9), (1, 11, 3)])
def test_gemm_matches_numpy(name, M, K, N):
    rng = np.random.default_rng(M * 100 + N)
    A = rng.standard_normal((M, K), dtype=np.float32)
    B = rng.standard_normal((K, N), dtype=np.float32)
    C = np.full((M, N), np.nan, np.float32)
    SMALL_VERSIONS[name]()(A, B, C)
    assert_close(C, A.astype(np.float64) @ B)


@pytest.mark.parametrize("name", SMALL_VERSIONS)
def test_gemm_transposed_views_and_accumulate(name):
    rng = np.random.default_rng(1)
    At = rng.standard_normal((5, 7), dtype=np.float32)  # A = At.T, a strided view
    Bt = rng.standard_normal((9, 5), dtype=np.float32)
    C0 = rng.standard_normal((7, 9), dtype=np.float32)
    C = C0.copy()
    SMALL_VERSIONS[name]()(At.T, Bt.T, C, accumulate=True)
    assert_close(C, At.T.astype(np.float64) @ Bt.T + C0)


def test_versions_agree_bit_for_bit():
    """Every version sums k in the same order, so (without FMA contraction, as in the simulator) they agree exactly."""
    rng = np.random.default_rng(2)
    A = rng.standard_normal((6, 10), dtype=np.float32)
    B = rng.standard_normal((10, 5), dtype=np.float32)
    results = []
    for make in SMALL_VERSIONS.values():
        C = np.empty((6, 5), np.float32)
        make()(A, B, C)
        results.append(C)
    for C in results[1:]:
        np.testing.assert_array_equal(C, results[0])


def test_production_tiles_on_a_ragged_problem():
    """The 16×16 tiled and the 64×64 register-blocked kernels, once each, on a 17×17 problem."""
    rng = np.random.default_rng(3)
    A = rng.standard_normal((17, 6), dtype=np.float32)
    B = rng.standard_normal((6, 17), dtype=np.float32)
    for version in (gemm.tiled_version(), gemm.register_blocked_version()):
        C = np.full((17, 17), np.nan, np.float32)
        version(A, B, C)
        assert_close(C, A.astype(np.float64) @ B)


def test_use_gemm_selects_and_rejects():
    previous = gemm.use_gemm("v1")
    try:
        assert gemm.active_gemm().name == "v1_naive"
        with pytest.raises(ValueError, match="unknown GEMM version"):
            gemm.use_gemm("v9")
    finally:
        gemm.use_gemm(previous)


def test_shape_mismatch_is_a_clear_error():
    with pytest.raises(ValueError, match="do not match"):
        gemm.naive_version()(np.zeros((2, 3), np.float32), np.zeros((4, 2), np.float32), np.zeros((2, 2), np.float32))

"""The CUDA dense layer (three GEMMs over transposed views) against the NumPy reference, simulated."""

from __future__ import annotations

import numpy as np
import pytest

from kernels.cuda import dense
from kernels.reference import dense as ref
from tests.kernels.cuda.conftest import assert_close

pytestmark = pytest.mark.cudasim


@pytest.mark.parametrize("with_bias", [True, False])
def test_dense_matches_reference(with_bias, tiny_gemm):
    rng = np.random.default_rng(0)
    N, I, O = 3, 7, 5
    x = rng.standard_normal((N, I), dtype=np.float32)
    w = rng.standard_normal((O, I), dtype=np.float32)
    b = rng.standard_normal(O, dtype=np.float32) if with_bias else None
    dout = rng.standard_normal((N, O), dtype=np.float32)

    out, expected_out = np.full((N, O), np.nan, np.float32), np.empty((N, O), np.float32)
    dense.dense_forward(x, w, b, out)
    ref.dense_forward(x, w, b, expected_out)
    assert_close(out, expected_out)

    dx, dw = np.full_like(x, np.nan), np.full_like(w, np.nan)
    db = np.full(O, np.nan, np.float32) if with_bias else None
    dense.dense_backward(x, w, dout, dx, dw, db)
    expected = [np.empty_like(x), np.empty_like(w), np.empty(O, np.float32) if with_bias else None]
    ref.dense_backward(x, w, dout, *expected)
    for actual, wanted in zip((dx, dw, db), expected):
        if wanted is not None:
            assert_close(actual, wanted)


def test_dense_backward_without_dx(tiny_gemm):
    """The first layer needs no input gradient: dx=None skips that GEMM."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 3), dtype=np.float32)
    w = rng.standard_normal((4, 3), dtype=np.float32)
    dout = rng.standard_normal((2, 4), dtype=np.float32)
    dw = np.empty_like(w)
    dense.dense_backward(x, w, dout, None, dw, None)
    assert_close(dw, dout.T.astype(np.float64) @ x)


def test_dense_shape_mismatch_is_a_clear_error():
    with pytest.raises(ValueError, match="out has shape"):
        x, w, out = np.zeros((2, 3), np.float32), np.zeros((4, 3), np.float32), np.zeros((2, 5), np.float32)
        dense.dense_forward(x, w, None, out)

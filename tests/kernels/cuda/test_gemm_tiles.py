"""The tile family (kernels/cuda/gemm.py, v4) against NumPy under the simulator.

Every configuration the table may name runs once at its real size on a ragged problem (one block, three
k-slabs: the double buffer's prologue, steady state and last slab, with M, N and K all ragged); small
members of the same family cover several blocks, transposed views, accumulate, and conv's three
directions with split-K forced on, against the reference.
"""

from __future__ import annotations

import numpy as np
import pytest

from kernels.cuda import conv as cuda_conv
from kernels.cuda import gemm
from kernels.reference import conv as ref
from tests.kernels.cuda.conftest import assert_close

pytestmark = pytest.mark.cudasim

SMALL = {
    "4x4k2t2x2": gemm.TileConfig(4, 4, 2, 2, 2),
    "4x8k2t2x2-single": gemm.TileConfig(4, 8, 2, 2, 2, double_buffer=False),
    "8x4k4t2x2": gemm.TileConfig(8, 4, 4, 2, 2),
}


@pytest.mark.parametrize("name", gemm.CANDIDATES)
def test_every_candidate_matches_numpy_on_a_ragged_tile(name):
    config = gemm.CANDIDATES[name]
    rng = np.random.default_rng(len(name))
    M, N, K = config.block_m - 3, config.block_n - 5, 2 * config.block_k + 3
    A = rng.standard_normal((M, K), dtype=np.float32)
    B = rng.standard_normal((K, N), dtype=np.float32)
    C = np.full((M, N), np.nan, np.float32)
    gemm.tile_version(config)(A, B, C)
    assert_close(C, A.astype(np.float64) @ B)


@pytest.mark.parametrize("name", SMALL)
@pytest.mark.parametrize("M, K, N", [(9, 7, 11), (1, 5, 3)])
def test_small_members_over_several_blocks(name, M, K, N):
    rng = np.random.default_rng(M * 10 + N)
    At = rng.standard_normal((K, M), dtype=np.float32)  # A = At.T: a strided view
    B = rng.standard_normal((K, N), dtype=np.float32)
    C0 = rng.standard_normal((M, N), dtype=np.float32)
    C = C0.copy()
    gemm.tile_version(SMALL[name])(At.T, B, C, accumulate=True)
    assert_close(C, At.T.astype(np.float64) @ B + C0)


def test_the_family_adds_in_v3s_order_bit_for_bit():
    """Each output's products in the same k order as v1–v3 (the zero-padded slabs add exact zeros)."""
    rng = np.random.default_rng(5)
    A = rng.standard_normal((9, 13), dtype=np.float32)
    B = rng.standard_normal((13, 7), dtype=np.float32)
    expected = np.empty((9, 7), np.float32)
    gemm.register_blocked_version(4, 4, 2, 2, 2)(A, B, expected)
    for config in (SMALL["4x8k2t2x2-single"], gemm.SIMULATOR_CONFIG):
        C = np.empty((9, 7), np.float32)
        gemm.tile_version(config)(A, B, C)
        np.testing.assert_array_equal(C, expected)


# (N, C, H, W, K, kernel, stride, pad, groups): ragged planes, stride 2 (four phases), two groups.
CONV = {
    "3x3-stride2-groups2": (1, 4, 5, 5, 4, 3, 2, 1, 2),
}


@pytest.mark.parametrize("splits", [3])
@pytest.mark.parametrize("shape", CONV.values(), ids=CONV.keys())
def test_conv_directions_with_split_k(shape, splits, monkeypatch):
    """Forward, backward data and weight through the family with k cut into ``splits`` chunks: scratch sized
    by the workspace functions under the same choice, partials summed in order, all against the reference."""
    n, c, h, wd, k, r, stride, pad, groups = shape
    rng = np.random.default_rng(splits)
    x = rng.standard_normal((n, c, h, wd), dtype=np.float32)
    w = rng.standard_normal((k, c // groups, r, r), dtype=np.float32)
    oh, ow = ref.check_conv2d_shapes(x.shape, w.shape, stride, pad, groups)
    dout = rng.standard_normal((n, k, oh, ow), dtype=np.float32)
    args = (stride, pad, groups)
    monkeypatch.setattr(cuda_conv, "SPLIT_K_ALIGN", 2)  # tiny K: chunks of 8 would leave one split
    with gemm.forced_choice(gemm.SIMULATOR_CONFIG, splits):
        sizes = [f(x.shape, w.shape, *args) for f in (cuda_conv.conv2d_forward_workspace_size,
                                                      cuda_conv.conv2d_backward_data_workspace_size,
                                                      cuda_conv.conv2d_backward_weight_workspace_size)]
        g = cuda_conv.conv_geometry(x.shape, w.shape, *args)
        got = [g.gemm(d).splits for d in ("forward", "data", "weight")]
        assert got == [3, 2, 3]
        assert sizes == [got[0] * dout.size, got[1] * x.size, got[2] * w.size]
        out, dx, dw = (np.full(a.shape, np.nan, np.float32) for a in (dout, x, w))
        cuda_conv.conv2d_forward(x, w, None, out, *args, np.full(sizes[0], np.nan, np.float32))
        cuda_conv.conv2d_backward_data(dout, w, dx, *args, np.full(sizes[1], np.nan, np.float32))
        cuda_conv.conv2d_backward_weight(x, dout, dw, None, *args, np.full(sizes[2], np.nan, np.float32))
    expected = [np.empty_like(a) for a in (out, dx, dw)]
    ref.conv2d_forward(x, w, None, expected[0], *args)
    ref.conv2d_backward_data(dout, w, expected[1], *args)
    ref.conv2d_backward_weight(x, dout, expected[2], None, *args)
    for actual, wanted in zip((out, dx, dw), expected):
        assert_close(actual, wanted)


def test_a_split_launch_without_its_scratch_is_a_clear_error():
    x = np.zeros((2, 3, 5, 5), np.float32)
    w = np.zeros((4, 3, 3, 3), np.float32)
    with gemm.forced_choice(SMALL["4x4k2t2x2"], 2), pytest.raises(ValueError, match="conv2d_forward_workspace_size"):
        cuda_conv.conv2d_forward(x, w, None, np.zeros((2, 4, 5, 5), np.float32), 1, 1, 1, None)


def test_imagenet_stem_through_the_family():
    """The 224×224 variants' stem (7×7, stride 2, pad 3; four phases of up to 4×4 taps in backward data) at 9×9:
    the ImageNet models run the same kernels as the CIFAR ones on other shapes; this is the one new shape
    kind (the 3×3 stride-2 max pool is in test_pool)."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((1, 3, 9, 9), dtype=np.float32)
    w = rng.standard_normal((2, 3, 7, 7), dtype=np.float32)
    args = (2, 3, 1)
    dout = rng.standard_normal((1, 2, 5, 5), dtype=np.float32)
    out, dx, dw = (np.full(a.shape, np.nan, np.float32) for a in (dout, x, w))
    with gemm.forced_choice(gemm.SIMULATOR_CONFIG, 1):
        cuda_conv.conv2d_forward(x, w, None, out, *args, None)
        cuda_conv.conv2d_backward_data(dout, w, dx, *args, None)
        cuda_conv.conv2d_backward_weight(x, dout, dw, None, *args, None)
    expected = [np.empty_like(a) for a in (out, dx, dw)]
    ref.conv2d_forward(x, w, None, expected[0], *args)
    ref.conv2d_backward_data(dout, w, expected[1], *args)
    ref.conv2d_backward_weight(x, dout, expected[2], None, *args)
    for actual, wanted in zip((out, dx, dw), expected):
        assert_close(actual, wanted)

"""The CUDA conv (im2col + GEMM, 1×1 path, direct depthwise) against the NumPy reference, simulated."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from kernels.cuda import conv as cuda_conv
from kernels.cuda import gemm
from kernels.reference import conv as ref
from tests.kernels.cuda.conftest import assert_close

pytestmark = pytest.mark.cudasim

# (N, C, H, W, K, kernel, stride, pad, groups) and the path each one takes.
SHAPES = {
    "im2col": (2, 3, 5, 5, 4, 3, 1, 1, 1),
    "im2col-stride2-pad0-groups2": (1, 4, 5, 5, 6, 3, 2, 0, 2),
    "depthwise-stride2": (2, 4, 5, 5, 4, 3, 2, 1, 4),
    "depthwise-multiplier2": (1, 2, 4, 4, 4, 3, 1, 1, 2),
    "depthwise-tiny": (1, 2, 3, 3, 2, 3, 1, 1, 2),
    "pointwise": (2, 4, 4, 4, 3, 1, 1, 0, 1),
    "1x1-stride2-groups2": (1, 4, 5, 5, 4, 1, 2, 0, 2),
}


def _case(shape, seed=0):
    n, c, h, wd, k, r, stride, pad, groups = shape
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, c, h, wd), dtype=np.float32)
    w = rng.standard_normal((k, c // groups, r, r), dtype=np.float32)
    b = rng.standard_normal(k, dtype=np.float32)
    oh, ow = ref.check_conv2d_shapes(x.shape, w.shape, stride, pad, groups)
    dout = rng.standard_normal((n, k, oh, ow), dtype=np.float32)
    return x, w, b, dout, (stride, pad, groups)


def _scratch(size_function, x, w, args):
    return np.full(size_function(x.shape, w.shape, *args), np.nan, np.float32)  # NaN: unwritten scratch shows


def _run_cuda(x, w, b, dout, args, with_bias=True):
    out = np.full(dout.shape, np.nan, np.float32)
    dx = np.full(x.shape, np.nan, np.float32)
    dw = np.full(w.shape, np.nan, np.float32)
    db = np.full(b.shape, np.nan, np.float32) if with_bias else None
    cuda_conv.conv2d_forward(
        x, w, b if with_bias else None, out, *args, _scratch(cuda_conv.conv2d_forward_workspace_size, x, w, args)
    )
    cuda_conv.conv2d_backward_data(
        dout, w, dx, *args, _scratch(cuda_conv.conv2d_backward_data_workspace_size, x, w, args)
    )
    cuda_conv.conv2d_backward_weight(
        x, dout, dw, db, *args, _scratch(cuda_conv.conv2d_backward_weight_workspace_size, x, w, args)
    )
    return out, dx, dw, db


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_cuda_conv_matches_reference(shape, tiny_gemm):
    x, w, b, dout, args = _case(shape)
    out, dx, dw, db = _run_cuda(x, w, b, dout, args)
    expected = [np.empty_like(a) for a in (out, dx, dw, db)]
    ref.conv2d_forward(x, w, b, expected[0], *args)
    ref.conv2d_backward_data(dout, w, expected[1], *args)
    ref.conv2d_backward_weight(x, dout, expected[2], expected[3], *args)
    for actual, wanted in zip((out, dx, dw, db), expected):
        assert_close(actual, wanted)


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_conv_runs_on_every_gemm_version(version):
    small = {"v1": gemm.naive_version(threads=4), "v2": gemm.tiled_version(tile=4)}[version]
    previous = gemm.use_gemm(small)
    try:
        x, w, b, dout, args = _case(SHAPES["im2col-stride2-pad0-groups2"], seed=1)
        out, dx, dw, db = _run_cuda(x, w, b, dout, args, with_bias=False)
    finally:
        gemm.use_gemm(previous)
    expected_out, expected_dx, expected_dw = np.empty_like(out), np.empty_like(dx), np.empty_like(dw)
    ref.conv2d_forward(x, w, None, expected_out, *args)
    ref.conv2d_backward_data(dout, w, expected_dx, *args)
    ref.conv2d_backward_weight(x, dout, expected_dw, None, *args)
    assert_close(out, expected_out)
    assert_close(dx, expected_dx)
    assert_close(dw, expected_dw)


@pytest.mark.parametrize("path", ["im2col-stride2-pad0-groups2", "depthwise-tiny"])
def test_cuda_conv_gradients_are_deterministic(path, tiny_gemm):
    x, w, b, dout, args = _case(SHAPES[path], seed=2)
    first = _run_cuda(x, w, b, dout, args)
    second = _run_cuda(x, w, b, dout, args)
    for a, b_ in zip(first, second):
        np.testing.assert_array_equal(a, b_)


def test_workspace_sizes(tmp_path, monkeypatch):
    """Forward and backward-data read the tensors in place; only a split weight gradient needs scratch.

    The split rule's figures, so with a table that names no shape (the committed one overrides the rule
    where the GPU measured another split)."""
    empty = tmp_path / "table.json"
    empty.write_text('{"entries": {}}')
    monkeypatch.setenv(gemm.TABLE_ENV, str(empty))
    assert cuda_conv.conv2d_forward_workspace_size((2, 3, 5, 5), (4, 3, 3, 3), 1, 1, 1) == 0
    assert cuda_conv.conv2d_backward_data_workspace_size((2, 3, 5, 5), (4, 3, 3, 3), 1, 1, 1) == 0
    assert cuda_conv.conv2d_backward_weight_workspace_size((2, 3, 5, 5), (4, 3, 3, 3), 1, 1, 1) == 0  # K = 50
    # ResNet-18's first 3x3 layer at batch 32: K = 32*32*32 products into a 64x576 dw (9 tiles) -> 30 splits.
    g = cuda_conv.conv_geometry((32, 64, 32, 32), (64, 64, 3, 3), 1, 1, 1)
    splits, chunk = g.weight_splits
    assert (splits, chunk) == (30, 1096) and (splits - 1) * chunk < 32 * 1024 <= splits * chunk
    assert cuda_conv.conv2d_backward_weight_workspace_size((32, 64, 32, 32), (64, 64, 3, 3), 1, 1, 1) == 30 * 64 * 576
    # 512->512 at 4x4: 576 tiles already fill the GPU, no split.
    assert cuda_conv.conv_geometry((32, 512, 4, 4), (512, 512, 3, 3), 1, 1, 1).weight_splits == (1, 512)


@pytest.mark.parametrize(
    "shape, splits",
    [
        ((2, 3, 5, 5, 4, 3, 1, 1, 1), (4, 16)),  # 50 products: chunks of 16, 16, 16, 2
        ((2, 4, 6, 6, 6, 3, 1, 1, 2), (9, 8)),  # two groups, each cut into 9 chunks (grid z = 18)
    ],
    ids=["ragged", "groups2"],
)
def test_split_k_weight_gradient(shape, splits, tiny_gemm, monkeypatch):
    """A weight gradient cut into k-chunks (SPLIT_MIN_K lowered so tiny shapes split) matches the reference."""
    monkeypatch.setattr(cuda_conv, "SPLIT_MIN_K", 8)
    x, w, b, dout, args = _case(shape, seed=3)
    g = cuda_conv.conv_geometry(x.shape, w.shape, *args)
    assert g.weight_splits == splits
    scratch = _scratch(cuda_conv.conv2d_backward_weight_workspace_size, x, w, args)
    assert scratch.size == splits[0] * w.size
    dw, db = np.full(w.shape, np.nan, np.float32), np.full(b.shape, np.nan, np.float32)
    cuda_conv.conv2d_backward_weight(x, dout, dw, db, *args, scratch)
    expected_dw, expected_db = np.empty_like(dw), np.empty_like(db)
    ref.conv2d_backward_weight(x, dout, expected_dw, expected_db, *args)
    assert_close(dw, expected_dw)
    assert_close(db, expected_db)


@pytest.mark.parametrize(
    "path, forward, data, weight",
    [
        ("im2col", 2, 1, 2),  # GEMM + bias; GEMM; GEMM + bias gradient
        ("im2col-stride2-pad0-groups2", 2, 1, 2),  # both groups in one launch (grid z)
        ("depthwise-stride2", 2, 1, 2),
    ],
)
def test_one_launch_per_direction_for_the_whole_batch(path, forward, data, weight, tiny_gemm):
    """Launches per call do not grow with the batch or the groups (they did: 2 per image and group)."""
    from kernels.cuda import LAUNCHES, count_only, reset_launches

    x, w, b, dout, args = _case(SHAPES[path])
    reset_launches()
    with count_only():
        cuda_conv.conv2d_forward(x, w, b, np.empty(dout.shape, np.float32), *args, None)
        assert sum(LAUNCHES.values()) == forward
        cuda_conv.conv2d_backward_data(dout, w, np.empty(x.shape, np.float32), *args, None)
        assert sum(LAUNCHES.values()) == forward + data
        dw, db = np.empty(w.shape, np.float32), np.empty(b.shape, np.float32)
        cuda_conv.conv2d_backward_weight(x, dout, dw, db, *args, None)
        assert sum(LAUNCHES.values()) == forward + data + weight
    reset_launches()


def test_bad_input_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(cuda_conv, "SPLIT_MIN_K", 8)
    x, w, b, dout, args = _case(SHAPES["im2col"])
    out = np.empty_like(dout)
    with pytest.raises(ValueError, match="conv2d_backward_weight_workspace_size"):
        cuda_conv.conv2d_backward_weight(x, dout, np.empty_like(w), None, *args, np.empty(3, np.float32))
    with pytest.raises(ValueError, match="groups=2 must divide"):
        cuda_conv.conv2d_forward_workspace_size((1, 3, 5, 5), (4, 1, 3, 3), 1, 1, 2)
    with pytest.raises(ValueError, match="out has shape"):
        cuda_conv.conv2d_forward(x, w, b, out[:, :2], *args, None)


def test_division_by_an_invariant_divisor_is_exact():
    """conv._divider / _fdiv (the per-k loads' multiply-and-shift division) against // at the edges of its
    range: every divisor kind the operands use (1, powers of two and their neighbours, 3·3, large pixel
    counts up to 2**31 − 1) and dividends 0, 1, multiples of d and their neighbours, up to 2**31 − 1."""
    divisors = sorted({1, 2, 3, 4, 5, 7, 9, 49, 255, 256, 257, 1024, 3136, 12544, 65535, 65536, 65537,
                       (1 << 20) + 1, (1 << 30) - 1, 1 << 30, (1 << 30) + 1, (1 << 31) - 1})
    pairs = []
    for d in divisors:
        for n in {0, 1, d - 1, d, d + 1, 2 * d - 1, 2 * d, 7 * d + 3, (1 << 31) - 1, (1 << 31) - 2,
                  ((1 << 31) - 1) // d * d, ((1 << 31) - 1) // d * d - 1}:
            if 0 <= n < 1 << 31:
                pairs.append((n, d))
    n = np.array([p[0] for p in pairs], np.int64)
    d = np.array([p[1] for p in pairs], np.int64)
    got = np.full(len(pairs), -1, np.int64)

    @cuda.jit
    def divide(n, d, out):
        i = cuda.grid(1)
        if i < out.shape[0]:
            m, p = cuda_conv._divider(d[i])
            out[i] = cuda_conv._fdiv(n[i], m, p)

    divide[(len(pairs) + 31) // 32, 32](n, d, got)
    np.testing.assert_array_equal(got, n // d)

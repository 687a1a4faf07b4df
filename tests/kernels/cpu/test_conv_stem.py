"""The strided stems (v39, ``kernels/cpu/conv_stem.py``): ResNet-18's 7×7 stride-2 and MobileNetV2's 3×3 stride-2
ImageNet stems, forward and weight gradient, against the NumPy reference; blocks of output rows; routing; bits."""

from __future__ import annotations

import numpy as np
import pytest

from kernels.cpu import conv, conv_stem
from kernels.reference import conv as ref

# (N, C, H, W, K, R, stride, pad): the two ImageNet stems at a small plane, odd and non-square planes, a 2-channel
# input, a pad of 0, stride 3
STEMS = [
    (2, 3, 30, 30, 64, 7, 2, 3),
    (3, 3, 33, 31, 32, 3, 2, 1),
    (2, 2, 17, 12, 8, 5, 2, 2),
    (2, 3, 13, 13, 16, 3, 2, 0),
    (2, 4, 14, 16, 40, 4, 3, 1),
]


V41 = conv.Paths(imagenet_measured=False, stem_phases=False)
"""v39–v41's routes: every strided stem's forward and weight gradient on ``conv_stem`` (in v42–v46 only the 7×7
forward, where it measured faster than im2col); the kernels are checked here on every stem shape."""

PHASES = conv.Paths(imagenet_measured=False)
"""The same routes with v47's kernel: columns copied from the phase-split image, the weight gradient in one
transposed sgemm per block (since v47 the 7×7 forward and both weight gradients take it)."""


@pytest.fixture(autouse=True, params=[V41, PHASES], ids=["v39-columns", "v47-phases"])
def stems_on_their_columns(request, monkeypatch):
    monkeypatch.setattr(conv, "EXPORTED", request.param)  # what every call without its own paths reads


def _case(shape, seed=0):
    n, c, h, w, k, r, stride, pad = shape
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, c, h, w)).astype(np.float32)
    wt = rng.standard_normal((k, c, r, r)).astype(np.float32)
    oh, ow = (h + 2 * pad - r) // stride + 1, (w + 2 * pad - r) // stride + 1
    return x, wt, rng.standard_normal((n, k, oh, ow)).astype(np.float32), stride, pad


def _run(x, w, dout, stride, pad, bias=None, dbias=None):
    out = np.full(dout.shape, np.nan, np.float32)
    size = conv.conv2d_forward_workspace_size(x.shape, w.shape, stride, pad, 1)
    conv.conv2d_forward(x, w, bias, out, stride, pad, 1, np.full(max(size, 1), np.nan, np.float32))
    dw = np.full(w.shape, np.nan, np.float32)
    size = conv.conv2d_backward_weight_workspace_size(x.shape, w.shape, stride, pad, 1)
    conv.conv2d_backward_weight(x, dout, dw, dbias, stride, pad, 1, np.full(max(size, 1), np.nan, np.float32))
    return out, dw


def _reference(x, w, dout, stride, pad):
    out = np.zeros(dout.shape)
    ref.conv2d_forward(x, w, None, out, stride, pad, 1)
    dw = np.zeros(w.shape)
    ref.conv2d_backward_weight(x, dout, dw, None, stride, pad, 1)
    return out, dw


def _close(got, want):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * float(np.abs(want).max()) + 1e-6)


@pytest.mark.parametrize("shape", STEMS, ids=[str(s) for s in STEMS])
@pytest.mark.parametrize("budget", [conv_stem.COLUMN_BUDGET, 1])
def test_strided_stems_match_reference(shape, budget, monkeypatch):
    # budget 1: one output row per block (many blocks per image, beta = 1 across them); the default: whole images
    monkeypatch.setattr(conv_stem, "COLUMN_BUDGET", budget)
    x, w, dout, stride, pad = _case(shape)
    assert conv.path(x.shape, w.shape, stride, pad, 1, "forward") == "stem-strided"
    assert conv.path(x.shape, w.shape, stride, pad, 1, "weight") == "stem-strided"
    out, dw = _run(x, w, dout, stride, pad)
    want_out, want_dw = _reference(x, w, dout, stride, pad)
    _close(out, want_out)
    _close(dw, want_dw)


def test_strided_stem_bias_and_its_gradient():
    x, w, dout, stride, pad = _case(STEMS[0])
    bias = np.linspace(-1, 1, w.shape[0], dtype=np.float32)
    dbias = np.full(w.shape[0], np.nan, np.float32)
    out, _ = _run(x, w, dout, stride, pad, bias, dbias)
    want_out, _ = _reference(x, w, dout, stride, pad)
    _close(out, want_out + bias[None, :, None, None])
    _close(dbias, dout.astype(np.float64).sum(axis=(0, 2, 3)))


@pytest.mark.parametrize(("c", "k", "r", "pad"), [(3, 64, 7, 3), (3, 32, 3, 1)], ids=["resnet18", "mobilenetv2"])
def test_the_imagenet_stems_at_224(c, k, r, pad):
    # the real planes: 112×112 outputs, several blocks of output rows per image
    x, w, dout, stride, pad = _case((1, c, 224, 224, k, r, 2, pad))
    assert conv_stem.block_rows(x.shape, w.shape, stride, pad) < 112
    out, dw = _run(x, w, dout, stride, pad)
    want_out, want_dw = _reference(x, w, dout, stride, pad)
    _close(out, want_out)
    _close(dw, want_dw)


def test_strided_stems_give_the_same_bits_every_call():
    x, w, dout, stride, pad = _case((4, 3, 40, 40, 64, 7, 2, 3))
    first = _run(x, w, dout, stride, pad)
    second = _run(x, w, dout, stride, pad)
    assert all(np.array_equal(a, b) for a, b in zip(first, second))


def test_only_narrow_strided_convs_take_the_stem_path():
    assert conv.path((2, 3, 224, 224), (64, 3, 7, 7), 2, 3, 1, "data") != "stem-strided"  # never called: no rule
    assert conv.path((2, 8, 32, 32), (16, 8, 3, 3), 2, 1, 1, "forward") == "gemm"  # > 4 channels
    assert conv.path((2, 3, 32, 32), (16, 3, 3, 3), 1, 1, 1, "forward") == "stem"  # v36's
    assert conv.path((2, 3, 32, 32), (16, 3, 1, 1), 2, 0, 1, "forward") == "pointwise-strided"  # 1×1: v33's
    before = conv.Paths(stem_strided=False)
    assert conv.path((2, 3, 224, 224), (64, 3, 7, 7), 2, 3, 1, "forward", before) == "gemm"


@pytest.mark.parametrize("shape", STEMS, ids=[str(s) for s in STEMS])
def test_phase_columns_give_the_bits_of_v39s(shape, monkeypatch):
    # the same columns, copied from the phase-split image instead of gathered per tap: the same forward bits; the
    # weight gradient's transposed sgemm sums the same products (equal to float32 rounding)
    x, w, dout, stride, pad = _case(shape, seed=1)
    monkeypatch.setattr(conv, "EXPORTED", V41)
    before = _run(x, w, dout, stride, pad)
    monkeypatch.setattr(conv, "EXPORTED", PHASES)
    after = _run(x, w, dout, stride, pad)
    assert np.array_equal(before[0], after[0])
    _close(after[1], before[1].astype(np.float64))

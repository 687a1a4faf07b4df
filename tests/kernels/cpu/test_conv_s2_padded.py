"""v40 (``kernels.cpu.conv.s2_padded``): 3×3 stride-2 convs on planes that are not multiples of 4 (ImageNet ResNet-18's
256→512 @14×14) by the polyphase transform on zero-padded planes, in every direction, against the NumPy reference."""

from __future__ import annotations

import numpy as np
import pytest

from kernels.cpu import blas, conv
from kernels.reference import conv as ref

pytestmark = pytest.mark.skipif(blas.select_sgemm() != blas.OPENBLAS, reason="the polyphase path is OpenBLAS's only")

SHAPES = [(2, 64, 14, 14, 64), (3, 64, 13, 10, 72), (1, 64, 18, 22, 64)]  # (N, C, H, W, K)
V41 = conv.Paths(imagenet_measured=False)
"""v40–v41's routes: the padded transform in every direction (v42 sends the weight gradient back to im2col, where it
measured faster; the kernel stays a numbered version's and is checked here in every direction)."""


@pytest.fixture(autouse=True)
def every_direction_padded(monkeypatch):
    monkeypatch.setattr(conv, "EXPORTED", V41)  # what every call without its own paths reads


def _case(shape):
    n, c, h, w, k = shape
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, c, h, w)).astype(np.float32)
    wt = (rng.standard_normal((k, c, 3, 3)) / np.sqrt(9 * c)).astype(np.float32)
    b = rng.standard_normal(k).astype(np.float32)
    dout = rng.standard_normal((n, k, (h - 1) // 2 + 1, (w - 1) // 2 + 1)).astype(np.float32)
    return x, wt, b, dout


def _scratch(size):
    return np.full(max(size, 1), np.nan, np.float32)


def _close(got, want):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * float(np.abs(want).max()))


@pytest.mark.parametrize("shape", SHAPES, ids=[str(s) for s in SHAPES])
def test_padded_polyphase_matches_reference(shape):
    x, w, b, dout = _case(shape)
    args = (2, 1, 1)
    for direction in ("forward", "data", "weight"):
        assert conv.path(x.shape, w.shape, *args, direction) == "winograd-s2"
        assert conv.s2_padded(x.shape, w.shape, *args)
    out = np.empty(dout.shape, np.float32)
    conv.conv2d_forward(x, w, b, out, *args, _scratch(conv.conv2d_forward_workspace_size(x.shape, w.shape, *args)))
    want = np.zeros(dout.shape)
    ref.conv2d_forward(x, w, b, want, *args)
    _close(out, want)
    dx = np.empty(x.shape, np.float32)
    conv.conv2d_backward_data(dout, w, dx, *args,
                              _scratch(conv.conv2d_backward_data_workspace_size(x.shape, w.shape, *args)))
    want = np.zeros(x.shape)
    ref.conv2d_backward_data(dout, w, want, *args)
    _close(dx, want)
    dw, db = np.empty(w.shape, np.float32), np.empty(b.shape, np.float32)
    conv.conv2d_backward_weight(x, dout, dw, db, *args,
                                _scratch(conv.conv2d_backward_weight_workspace_size(x.shape, w.shape, *args)))
    want, want_b = np.zeros(w.shape), np.zeros(b.shape)
    ref.conv2d_backward_weight(x, dout, want, want_b, *args)
    _close(dw, want)
    _close(db, want_b)


def test_padded_polyphase_routing():
    shape = ((32, 256, 14, 14), (512, 256, 3, 3), 2, 1, 1)
    exported = conv.paths_for(conv.MODE)  # this module's fixture makes V41 the table's
    assert conv.path(*shape, "forward", exported) == "winograd-s2"
    assert conv.path(*shape, "data", exported) == "winograd-s2"
    assert conv.path(*shape, "weight", exported) == "gemm"  # v42: im2col measured faster (conv.STEM_STRIDED_MIN_KERNEL)
    assert conv.path(*shape, "weight", V41) == "winograd-s2"
    assert conv.path(*shape, "forward", conv.Paths(winograd_s2_padded=False)) == "gemm"  # v39 and before
    assert not conv.s2_padded((32, 256, 16, 16), (512, 256, 3, 3), 2, 1, 1)  # multiples of 4: the plain path

"""3×3 stride-1 pad-1 convolution as cache-blocked Winograd F(2×2, 3×3): study version 10.

Why. Our 3×3 convolutions are GEMMs (im2col, or the shifted GEMMs of ``conv_shifted.py``) and
run at OpenBLAS's sgemm rate, ~140 GFLOP/s per thread on these shapes; oneDNN's direct AVX-512
kernels (PyTorch) reach ~160–190. No better way of calling sgemm closes that gap; doing fewer
multiplies can. Winograd F(2×2, 3×3) computes a 2×2 output tile from a 4×4 input tile with 16
multiplies per (input, output) channel pair instead of 36: 2.25× fewer GEMM flops.

An earlier, *untiled* attempt (kernels/README.md, "Tried and dropped: Winograd F(2×2, 3×3)")
had GEMMs twice as fast as im2col's, but transformed the whole batch at once: V (16 values per
2×2 tile = four times the input) and the GEMM result went out to memory and back, and the
transforms cost more than the GEMMs saved. This version keeps both in L2.

The algorithm (Lavin & Gray 2015), per tile of output pixels ``Y`` (2×2) and its input ``d``
(4×4, rows/columns 2·ty − 1 … 2·ty + 2, zero outside the plane)::

    U = G g Gᵀ   (4×4 per (k, c), once per call)        G  = [[1, 0, 0], [½, ½, ½], [½, −½, ½], [0, 0, 1]]
    V = Bᵀ d B   (4×4 per (c, tile))                     Bᵀ = [[1, 0, −1, 0], [0, 1, 1, 0], [0, −1, 1, 0], [0, 1, 0, −1]]
    M[ξ] = U[ξ] @ V[ξ]  for each of the 16 positions ξ: a (K × C) @ (C × tiles) GEMM
    Y = Aᵀ M A   (2×2 per (k, tile))                     Aᵀ = [[1, 1, 1, 0], [0, 1, −1, −1]]

Layout and blocking. Tiles are numbered in raster order over (image, tile row, tile column);
a plane of H × W has ⌈H/2⌉ × ⌈W/2⌉ tiles (odd sizes: the last tile reads zeros past the edge and
its extra outputs are dropped). Thread ``t`` owns the tile rows ``[t·R/T, (t+1)·R/T)`` of the
R = N·⌈H/2⌉ in the batch (a fixed range: the same bits every call at a given thread count) and
walks them in blocks of ``rows`` tile rows (Tb = rows·⌈W/2⌉ tiles; a block crosses image borders,
so the 4-tile planes of 4×4 layers batch many images into one block). Per block:

1. input transform into ``V[ξ][c][j]`` (16 × C × Tb, ``j`` the tile within the block): per
   channel and tile row, Bᵀ on whole input rows (four rows of W, contiguous), then B across
   the columns; the 16 stores per tile go to 16 contiguous streams.
2. 16 GEMMs ``M[ξ] (K × Tb) = U[ξ] (K × C) @ V[ξ] (C × Tb)`` through single-threaded BLAS
   (``conv_shifted.sgemm``: ``numba_xxgemm`` with leading dimensions).
3. output transform ``Aᵀ M[·][k][j] A`` straight into ``out``.

V and M together are 16·(C + K)·Tb floats: the block is sized (``block_rows``) so that they stay
within ``BLOCK_BUDGET_ELEMENTS`` of L2 (2 MiB per core here).

Backward-data is the forward convolution of dout with w'[c, k] = w[k, c] flipped. Flipping g
gives G·J·g·J·Gᵀ with J the reversal, and G·J = P·G with P the swap of rows 0 and 3, so
U'[(i, j)] = U[(p(i), p(j))]ᵀ: the forward filter transform, read transposed by the GEMM at the
swapped position. No second filter transform, no transposing copy.

Numerics: the transforms add and subtract inputs (B, A) and halve (G, exact in binary), so the
result differs from a direct sum by rounding only: max abs error 1e-6 … 1e-5 on ResNet shapes
(figures in kernels/README.md).
"""

from __future__ import annotations

import numpy as np
from numba import njit, uint64

from kernels.cpu.conv_shifted import sgemm
from kernels.cpu.threads import run_shares

TARGET_TILES = 128
"""Tiles per block (Tb), rounded up to whole tile rows, before the cache budget below."""

BLOCK_BUDGET_ELEMENTS = 1 << 18
"""At most this many float32 (1 MiB) in a block's V and M together, so they stay in L2 (2 MiB)
beside the GEMM's packed panels."""

def supported(x_shape, w_shape, stride: int, pad: int, groups: int) -> bool:
    """Dense (groups 1) 3×3 convolutions with stride 1 and padding 1."""
    return groups == 1 and w_shape[2] == 3 and w_shape[3] == 3 and stride == 1 and pad == 1


def block_rows(x_shape, c_in: int, c_out: int, threads: int, target_tiles: int = TARGET_TILES) -> int:
    """Tile rows per block: ``target_tiles`` tiles, within the budget, ≤ a thread's share."""
    n, _, h, w = x_shape
    tw = (w + 1) // 2
    share = -(-n * ((h + 1) // 2) // threads)
    wanted = -(-target_tiles // tw)
    fits = max(1, BLOCK_BUDGET_ELEMENTS // (16 * (c_in + c_out) * tw))
    return max(1, min(share, wanted, fits))


def workspace_size(x_shape, w_shape, direction: str, threads: int, target_tiles: int = TARGET_TILES) -> int:
    """Scratch (float32 elements): the transformed filter U (16·K·C), and per thread a block's V and M."""
    k, c = w_shape[0], w_shape[1]
    c_in, c_out = (k, c) if direction == "data" else (c, k)
    tiles = block_rows(x_shape, c_in, c_out, threads, target_tiles) * ((x_shape[3] + 1) // 2)
    return 16 * k * c + threads * 16 * (c_in + c_out) * tiles


@njit(cache=True, nogil=True)
def _filter_transform(w, k_lo, k_hi, u):
    """u[ξ][k, c] = (G w[k, c] Gᵀ)[ξ] for k in [k_lo, k_hi): 16 planes of K × C, each contiguous."""
    k, c = w.shape[0], w.shape[1]
    plane = k * c
    g = np.empty((4, 3), np.float32)
    for kk in range(k_lo, k_hi):
        for cc in range(c):
            for s in range(3):
                a, b, e = w[kk, cc, 0, s], w[kk, cc, 1, s], w[kk, cc, 2, s]
                g[0, s] = a
                g[1, s] = np.float32(0.5) * (a + b + e)
                g[2, s] = np.float32(0.5) * (a - b + e)
                g[3, s] = e
            at = kk * c + cc
            for i in range(4):
                a, b, e = g[i, 0], g[i, 1], g[i, 2]
                u[(4 * i) * plane + at] = a
                u[(4 * i + 1) * plane + at] = np.float32(0.5) * (a + b + e)
                u[(4 * i + 2) * plane + at] = np.float32(0.5) * (a - b + e)
                u[(4 * i + 3) * plane + at] = e


@njit(cache=True, nogil=True)
def _input_transform(src, r0, nr, channels, height, width, v, tmp):
    """v[ξ][c][j] = (Bᵀ d B)[ξ] for the tiles j of tile rows [r0, r0 + nr), read from src (flat NCHW)."""
    th, tw = (height + 1) // 2, (width + 1) // 2
    cols = nr * tw
    span = 2 * tw + 2  # tmp row p holds column x = p − 1, zero outside [0, W)
    plane = height * width
    for c in range(channels):
        for r in range(nr):
            n, ty = (r0 + r) // th, (r0 + r) % th
            s0 = uint64((n * channels + c) * plane)
            y0 = 2 * ty - 1
            # Bᵀ on whole rows: t0 = d0 − d2, t1 = d1 + d2, t2 = d2 − d1, t3 = d1 − d3
            for p in range(span):
                tmp[p] = 0.0
                tmp[span + p] = 0.0
                tmp[2 * span + p] = 0.0
                tmp[3 * span + p] = 0.0
            d_ok = (y0 >= 0, y0 + 1 < height, y0 + 2 < height, y0 + 3 < height)
            a0 = s0 + uint64(max(y0, 0) * width)
            a1 = s0 + uint64((y0 + 1) * width)
            a2 = s0 + uint64((y0 + 2) * width)
            a3 = s0 + uint64((y0 + 3) * width)
            for x in range(width):
                d0 = src[a0 + uint64(x)] if d_ok[0] else np.float32(0.0)
                d1 = src[a1 + uint64(x)] if d_ok[1] else np.float32(0.0)
                d2 = src[a2 + uint64(x)] if d_ok[2] else np.float32(0.0)
                d3 = src[a3 + uint64(x)] if d_ok[3] else np.float32(0.0)
                tmp[x + 1] = d0 - d2
                tmp[span + x + 1] = d1 + d2
                tmp[2 * span + x + 1] = d2 - d1
                tmp[3 * span + x + 1] = d1 - d3
            # B across columns, one tile per step: 16 contiguous output streams
            j0 = uint64(r * tw)
            for i in range(4):
                row = i * span
                o0 = uint64((4 * i * channels + c) * cols) + j0
                o1 = o0 + uint64(channels * cols)
                o2 = o1 + uint64(channels * cols)
                o3 = o2 + uint64(channels * cols)
                for tx in range(tw):
                    p = row + 2 * tx
                    e0, e1, e2, e3 = tmp[p], tmp[p + 1], tmp[p + 2], tmp[p + 3]
                    v[o0 + uint64(tx)] = e0 - e2
                    v[o1 + uint64(tx)] = e1 + e2
                    v[o2 + uint64(tx)] = e2 - e1
                    v[o3 + uint64(tx)] = e1 - e3


@njit(cache=True, nogil=True)
def _output_transform(m, r0, nr, channels, height, width, dst):
    """dst[n, k, 2ty + a, 2tx + b] = (Aᵀ M A)[a, b] for the tiles of tile rows [r0, r0 + nr)."""
    th, tw = (height + 1) // 2, (width + 1) // 2
    cols = nr * tw
    stride = uint64(channels * cols)
    plane = height * width
    full = width // 2
    for k in range(channels):
        for r in range(nr):
            n, ty = (r0 + r) // th, (r0 + r) % th
            b0 = uint64((n * channels + k) * plane + 2 * ty * width)
            b1 = b0 + uint64(width)
            second = 2 * ty + 1 < height
            base = uint64(k * cols + r * tw)
            for tx in range(tw):
                q = base + uint64(tx)
                m00, m01, m02, m03 = m[q], m[q + stride], m[q + 2 * stride], m[q + 3 * stride]
                q += 4 * stride
                m10, m11, m12, m13 = m[q], m[q + stride], m[q + 2 * stride], m[q + 3 * stride]
                q += 4 * stride
                m20, m21, m22, m23 = m[q], m[q + stride], m[q + 2 * stride], m[q + 3 * stride]
                q += 4 * stride
                m30, m31, m32, m33 = m[q], m[q + stride], m[q + 2 * stride], m[q + 3 * stride]
                # Aᵀ on rows: s0 = m0 + m1 + m2, s1 = m1 − m2 − m3; then A across columns
                s00, s01, s02, s03 = m00 + m10 + m20, m01 + m11 + m21, m02 + m12 + m22, m03 + m13 + m23
                s10, s11, s12, s13 = m10 - m20 - m30, m11 - m21 - m31, m12 - m22 - m32, m13 - m23 - m33
                x = uint64(2 * tx)
                dst[b0 + x] = s00 + s01 + s02
                if tx < full:
                    dst[b0 + x + 1] = s01 - s02 - s03
                if second:
                    dst[b1 + x] = s10 + s11 + s12
                    if tx < full:
                        dst[b1 + x + 1] = s11 - s12 - s13


@njit(cache=True, nogil=True)
def _rows(x, u, out, flipped, first, last, rows, mine, parts):
    """Tile rows [first, last) on the calling thread, ``rows`` at a time: transform, 16 GEMMs, transform.

    ``parts`` (bits 1, 2, 4: input transform, GEMMs, output transform) is 7 except when the study
    times the parts one at a time."""
    c_in, height, width = x.shape[1], x.shape[2], x.shape[3]
    c_out = out.shape[1]
    tw = (width + 1) // 2
    tb = rows * tw
    src, dst = x.reshape(x.size), out.reshape(out.size)
    v = mine[: 16 * c_in * tb]
    m = mine[16 * c_in * tb : 16 * (c_in + c_out) * tb]
    tmp = np.empty(4 * (2 * tw + 2), np.float32)
    scalars = np.empty(2, np.float32)
    plane = c_in * c_out
    for r0 in range(first, last, rows):
        nr = min(rows, last - r0)
        cols = nr * tw
        if parts & 1:
            _input_transform(src, r0, nr, c_in, height, width, v, tmp)
        if parts & 2:
            for xi in range(16):
                at = xi
                if flipped:  # U'[(i, j)] = U[(p(i), p(j))]ᵀ, p swapping 0 and 3
                    i, j = xi // 4, xi % 4
                    at = 4 * (3 - i if i == 0 or i == 3 else i) + (3 - j if j == 0 or j == 3 else j)
                sgemm(
                    flipped,
                    False,
                    c_out,
                    cols,
                    c_in,
                    u[at * plane :],
                    c_out if flipped else c_in,
                    v[xi * c_in * cols :],
                    cols,
                    0.0,
                    m[xi * c_out * cols :],
                    cols,
                    scalars,
                )
        if parts & 4:
            _output_transform(m, r0, nr, c_out, height, width, dst)


def forward(x, w, out, flipped: bool, threads: int, rows: int, scratch, parts: int = 7) -> None:
    """out = conv3×3(x, w), stride 1, pad 1, by Winograd F(2×2, 3×3) (flipped: backward-data, x = dout)."""
    n, c_in, height, _ = x.shape
    c_out = out.shape[1]
    tw = (x.shape[3] + 1) // 2
    total = n * ((height + 1) // 2)
    u = scratch[: 16 * c_in * c_out]
    k = w.shape[0]
    if parts & 2:
        run_shares(lambda t: _filter_transform(w, t * k // threads, (t + 1) * k // threads, u), threads)
    per_thread = 16 * (c_in + c_out) * rows * tw
    start = 16 * c_in * c_out

    def work(t: int) -> None:
        mine = scratch[start + t * per_thread : start + (t + 1) * per_thread]
        _rows(x, u, out, flipped, t * total // threads, (t + 1) * total // threads, rows, mine, parts)

    run_shares(work, threads)

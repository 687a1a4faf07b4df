"""3×3 stride-2 pad-1 convolution forward by a polyphase Winograd transform (``conv.Paths.winograd_s2``, off).

Why. ResNet-18's three downsampling 3×3 convolutions (64→128 @32×32, 128→256 @16×16, 256→512
@8×8, stride 2) ran on im2col and one sgemm, and the sgemm was ⅞ of the forward's time. OpenBLAS's
sgemm reaches ~100 GFLOP/s per thread on these shapes (one thread, GFLOP/s, M × K × N: 128 × 576 ×
256 99.6, 256 × 1152 × 256 101.0, 512 × 2304 × 128 96.4, 1024³ 99.9), while PyTorch (oneDNN)
ran the same layers at an implied 98 / 108 / 114 GFLOP/s per thread: no way of calling sgemm on
the im2col matrix catches up (measured ceiling ≈ torch's time). Fewer multiplies can.

The transform. In one dimension, two outputs of a stride-2 three-tap filter,
``y0 = w0·d0 + w1·d1 + w2·d2`` and ``y1 = w0·d2 + w1·d3 + w2·d4`` (d0 … d4 the five inputs
2·o − 1 … 2·o + 3), split into the even inputs, which meet w1 alone (d1, d3: a 1×1 "conv"), and
the odd ones (d0, d2, d4), a two-tap stride-1 filter (w0, w2) run by Winograd F(2, 2) in 3
multiplies::

    e0 = w1·d1,  e1 = w1·d3,  m1 = w0·(d0 − d2),  m2 = (w0 + w2)·d2,  m3 = w2·(d4 − d2)
    y0 = e0 + m1 + m2,        y1 = e1 + m2 + m3

five multiplies for two outputs instead of six. Nested over rows and columns, a 2×2 output tile
reads a 5×5 input tile (tiles 4 pixels apart, overlapping by one) and takes 25 multiplies per
(input, output) channel pair instead of 36: 1.44× fewer GEMM flops. Every coefficient is 0 or ±1,
so the result differs from the direct sum by the order of the additions only (no halving, unlike
F(2×2, 3×3)'s G, and no growth of the error with the tile).

The filter has only four distinct rows, G = [[0, 1, 0], [1, 0, 0], [1, 0, 1], [0, 0, 1]] (e0 and e1
both take w1), so of the 25 positions only 16 transformed filters U = G g Gᵀ differ: position group
(a, b), a, b ∈ {e, m1, m2, m3}, holds ``mult(a)·mult(b)`` positions (mult(e) = 2, else 1) that share
U[a, b]. Each group is ONE GEMM ``M[a, b] (K × mult·Tb) = U[a, b] (K × C) @ V[a, b] (C × mult·Tb)``,
its positions side by side as columns (V and M laid out [channel][position in group][tile]): 16
GEMMs per block, four of them two or four times wider.

Layout, blocks and threads as ``conv_winograd.forward``: tiles in raster order over (image, tile
row, tile column), thread ``t`` owns the tile rows ``[t·R/T, (t+1)·R/T)`` and walks them in blocks
of ``rows`` tile rows (``TARGET_TILES`` tiles within ``BLOCK_BUDGET_ELEMENTS``); per block the input
transform into V, the 16 GEMMs (``conv_shifted.sgemm``, single-threaded BLAS), the output transform
straight into ``out``. The filter transform is split over the threads by output channel. Each output
element is one GEMM column's dot products and one thread's output transform: the same bits at any
thread count (tested at 1, 2 and 3).

Planes must be multiples of 4 (32×32, 16×16, 8×8: every stride-2 3×3 layer of ResNet-18); the input
tile then only crosses the top and left edges (row / column −1, the padding).

Measured (AMD EPYC, OpenBLAS). One thread, 16 images, ms, each part alone (filter transform, input
transform, 16 GEMMs and their GFLOP/s, output transform; the whole call): 64→128 @32×32 0.06 + 1.23 +
4.75 (88) + 0.88 = 7.13; 128→256 @16×16 0.24 + 0.66 + 4.44 (94) + 0.51 = 6.36; 256→512 @8×8 1.05 + 0.47 +
5.54 (76) + 0.31 = 8.22 (run-to-run spread ~10%). Whole convolutions against im2col, two threads:
``conv.WINOGRAD_S2_MIN_PIXELS``, which also says why the table does not take this path (3.2 s of cold
compile CPU for −5 to −10% on two records). Max abs error against a float64 reference, outputs of
magnitude ~100–200: 4e-5 to 1.4e-4 (relative ~5e-7).

Tried and dropped:

- One tile at a time (25 scalar loads, 25 scalar stores), in both transforms: input 1.23–1.31 ms, output
  1.50 ms at 64→128 (one thread, 16 images); the output transform's ten block-wide loops took it to 0.88.
  The input's phase-split copy (this version) did not beat the scalar one: its 5·(W + 1) scalar copies
  per tile row are the cost. Group starts kept in local scalars instead of read from ``offsets`` in the
  loop: no change.
- Blocks of 64 or 256 tiles instead of 128, two threads, ms (v23 → this): 64→128 8.41 → 8.43 and 8.36 →
  7.81 (128: 8.37 → 7.76); 128→256 7.63 → 7.57 and 8.51 → 8.13; 256→512 7.73 → 8.31 and 8.50 → 8.19.
- The threads sharing each block (input transform split by channel, the 16 GEMMs by position group, about
  half of the 25 positions each, the output transform by channel; blocks independent of the thread count),
  as ``conv_winograd.forward_by_xi`` does for 4×4 planes: two threads, batch 32, ms, v23 / tile split /
  group split: 64→128 8.16 / 7.56 / 10.56, 128→256 7.28 / 6.30 / 6.91, 256→512 7.52 / 7.58 / 7.79. Three
  barriers per block, and per thread no fewer GEMM columns than the tile split at 8×8.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from kernels.cpu.conv_shifted import sgemm
from kernels.cpu.threads import run_shares

TARGET_TILES = 128
"""Tiles per block (Tb), rounded up to whole tile rows, before the cache budget below."""

BLOCK_BUDGET_ELEMENTS = 1 << 21
"""At most this many float32 (8 MiB) in a block's V and M together (25·(C + K)·Tb)."""

SKEW = 16
"""Floats between consecutive position groups of U, V and M beyond their size (as ``conv_winograd.SKEW``:
planes a multiple of 4 KiB apart put a transform's store streams into one L1 set)."""

POSITIONS = 25
GROUPS = 16


def supported(x_shape, w_shape, stride: int, pad: int, groups: int) -> bool:
    """Dense 3×3 convolutions with stride 2 and padding 1 on planes whose sides are multiples of 4."""
    return (
        groups == 1 and w_shape[2] == 3 and w_shape[3] == 3 and stride == 2 and pad == 1
        and x_shape[2] % 4 == 0 and x_shape[3] % 4 == 0
    )


def block_rows(x_shape, c_in: int, c_out: int, threads: int, target_tiles: int = TARGET_TILES) -> int:
    """Tile rows per block: ``target_tiles`` tiles, within the budget, ≤ a thread's share."""
    n, _, h, w = x_shape
    tw = w // 4
    share = -(-n * (h // 4) // threads)
    wanted = -(-target_tiles // tw)
    fits = max(1, BLOCK_BUDGET_ELEMENTS // (POSITIONS * (c_in + c_out) * tw))
    return max(1, min(share, wanted, fits))


def _filter_size(c_in: int, c_out: int) -> int:
    return GROUPS * (c_in * c_out + SKEW)


def _per_thread(c_in: int, c_out: int, width: int, rows: int) -> int:
    """A thread's scratch: a block's V and M, and the transforms' buffer."""
    cols = rows * (width // 4)
    return POSITIONS * (c_in + c_out) * cols + 2 * GROUPS * SKEW + _buffer(width, rows)


def workspace_size(x_shape, w_shape, threads: int) -> int:
    """Scratch (float32 elements) of ``forward``: U (16 groups of K × C), per thread a block's V and M."""
    k, c = w_shape[0], w_shape[1]
    rows = block_rows(x_shape, c, k, threads)
    return _filter_size(c, k) + threads * _per_thread(c, k, x_shape[3], rows)


@njit(cache=True, nogil=True, inline="always")
def _mult(a):
    return 2 if a == 0 else 1


@njit(cache=True, nogil=True)
def _group_offsets(channels, cols, offsets):
    """offsets[g] = the start of position group g = 4a + b in V or M ([channel][position][tile]); g = 16: the end."""
    at = 0
    for g in range(GROUPS):
        offsets[g] = at
        at += channels * _mult(g // 4) * _mult(g % 4) * cols + SKEW
    offsets[GROUPS] = at


@njit(cache=True, nogil=True)
def _filter_transform(w, k_lo, k_hi, u):
    """u[g][k, c] = (G w[k, c] Gᵀ)[a, b] (g = 4a + b) for k in [k_lo, k_hi): 16 planes of K × C.

    G's rows pick w1, w0, w0 + w2, w2 (of a row, then of a column): additions only."""
    k, c = w.shape[0], w.shape[1]
    plane = k * c + SKEW
    g = w.reshape(w.size)
    for kk in range(k_lo, k_hi):
        for cc in range(c):
            at = kk * c + cc
            s = 9 * at
            for a in range(4):
                # row a of G g: (w1·), (w0·), (w0· + w2·), (w2·) over the three columns
                if a == 0:
                    r0, r1, r2 = g[s + 3], g[s + 4], g[s + 5]
                elif a == 1:
                    r0, r1, r2 = g[s], g[s + 1], g[s + 2]
                elif a == 2:
                    r0, r1, r2 = g[s] + g[s + 6], g[s + 1] + g[s + 7], g[s + 2] + g[s + 8]
                else:
                    r0, r1, r2 = g[s + 6], g[s + 7], g[s + 8]
                b0 = 4 * a * plane + at
                u[b0] = r1
                u[b0 + plane] = r0
                u[b0 + 2 * plane] = r0 + r2
                u[b0 + 3 * plane] = r2


def _buffer(width: int, rows: int) -> int:
    """The transforms' buffer: the input transform's phase-split rows (5 rows × 4 phases × (tw + 1)·rows)
    and its two difference rows; more than the output transform's 10 rows of tw·rows."""
    return 7 * 4 * (width // 4 + 1) * rows


@njit(cache=True, inline="always")
def _row_position(buf, offsets, i, channel, cols):
    """Row position i's five column slices of V (or M) for one channel: e0 and e1 of its 2-wide group
    (positions e0, e1) or of its row (m1, m2, m3), then the group's m1, m2, m3 (the transforms' layout,
    read the same way by the input and the output transform)."""
    pa, sa = (0, i) if i < 2 else (i - 1, 0)
    ma = 2 if pa == 0 else 1
    at = offsets[4 * pa] + (channel * ma * 2 + sa * 2) * cols
    at1 = (channel * ma + sa) * cols
    return (
        buf[at : at + cols], buf[at + cols : at + 2 * cols],
        buf[offsets[4 * pa + 1] + at1 : offsets[4 * pa + 1] + at1 + cols],
        buf[offsets[4 * pa + 2] + at1 : offsets[4 * pa + 2] + at1 + cols],
        buf[offsets[4 * pa + 3] + at1 : offsets[4 * pa + 3] + at1 + cols],
    )  # fmt: skip


@njit(cache=True, nogil=True)
def _input_transform(src, r0, nr, c_lo, c_hi, channels, height, width, v, offsets, tmp):
    """V[(a, b)][c][(sa, sb)][j] = (Bᵀ d B) of the 5×5 input tile d of every tile of tile rows
    [r0, r0 + nr) and the channels [c_lo, c_hi); tile (r, tx) at column j = tx·nr + r (column-major
    within the block).
    Bᵀ's rows: d1, d3, d0 − d2, d2, d4 − d2.

    Per channel, the block's five input rows per tile row are copied split by column phase,
    p[a][φ][m·nr + r] = d(4ty − 1 + a, 4m + φ − 1) (zero outside the plane), so that a tile's five
    columns are p[·][0…3] at j and p[·][0] at j + nr; then Bᵀ down the rows (two difference rows: the
    others are rows of p as they are) and B across the columns are one loop each over the whole block,
    as ``conv_winograd._input_transform`` does it (a first version, one tile at a time with 25 scalar
    loads and stores, took 1.2–1.3 ms of a 7.7 ms forward at 64→128 @32×32, one thread, 16 images)."""
    th, tw = height // 4, width // 4
    cols = nr * tw
    span = (tw + 1) * nr  # one phase of one input row over the block
    row = 4 * span
    p = tmp[: 5 * row]
    t1 = tmp[5 * row : 6 * row]  # row m1: d0 − d2
    t3 = tmp[6 * row : 7 * row]  # row m3: d4 − d2
    plane = height * width
    zero = np.float32(0.0)
    for c in range(c_lo, c_hi):
        for r in range(nr):
            n, ty = (r0 + r) // th, (r0 + r) % th
            s0 = (n * channels + c) * plane
            for a in range(5):
                y = 4 * ty - 1 + a
                pa = p[a * row + r :]
                if y >= 0:
                    b = s0 + y * width - 1
                    pa[0] = zero  # x = −1
                    pa[span] = src[b + 1]
                    pa[2 * span] = src[b + 2]
                    pa[3 * span] = src[b + 3]
                    for mm in range(1, tw):
                        at = mm * nr
                        q = b + 4 * mm
                        pa[at] = src[q]
                        pa[span + at] = src[q + 1]
                        pa[2 * span + at] = src[q + 2]
                        pa[3 * span + at] = src[q + 3]
                    pa[tw * nr] = src[b + 4 * tw]  # x = W − 1, the last tile's fifth column
                else:
                    for mm in range(tw + 1):
                        pa[mm * nr] = zero
                        pa[span + mm * nr] = zero
                        pa[2 * span + mm * nr] = zero
                        pa[3 * span + mm * nr] = zero
        r0_, r2_, r4_ = p[0:row], p[2 * row : 3 * row], p[4 * row : 5 * row]
        for e in range(row):
            t1[e] = r0_[e] - r2_[e]
        for e in range(row):
            t3[e] = r4_[e] - r2_[e]
        for i in range(5):  # row positions e0, e1, m1, m2, m3 = p[1], p[3], t1, p[2], t3
            if i == 0:
                ti = p[row : 2 * row]
            elif i == 1:
                ti = p[3 * row : 4 * row]
            elif i == 2:
                ti = t1
            elif i == 3:
                ti = r2_
            else:
                ti = t3
            f0, f1 = ti[0:cols], ti[span : span + cols]
            f2, f3 = ti[2 * span : 2 * span + cols], ti[3 * span : 3 * span + cols]
            f4 = ti[nr : nr + cols]
            w0, w1, w2, w3, w4 = _row_position(v, offsets, i, c, cols)
            for j in range(cols):
                w0[j] = f1[j]
            for j in range(cols):
                w1[j] = f3[j]
            for j in range(cols):
                w2[j] = f0[j] - f2[j]
            for j in range(cols):
                w3[j] = f2[j]
            for j in range(cols):
                w4[j] = f4[j] - f2[j]


@njit(cache=True, nogil=True)
def _output_transform(m, r0, nr, k_lo, k_hi, channels, height, width, dst, offsets, tmp):
    """dst[n, k, 2ty + a, 2tx + b] = (Aᵀ M A)[a, b] for the tiles of tile rows [r0, r0 + nr) (tile (r, tx)
    at column tx·nr + r) and the channels [k_lo, k_hi). A's rows: e0 + m1 + m2 and e1 + m2 + m3.

    Per channel, A across the columns of each of the five row positions is ten loops over the whole
    block; Aᵀ down the rows then runs per tile, into ``dst``'s two output rows."""
    th, tw = height // 4, width // 4
    out_w = width // 2
    out_plane = (height // 2) * out_w
    cols = nr * tw
    z = tmp[: 10 * cols]
    for k in range(k_lo, k_hi):
        for i in range(5):
            me0, me1, m1, m2, m3 = _row_position(m, offsets, i, k, cols)
            z0, z1 = z[2 * i * cols : (2 * i + 1) * cols], z[(2 * i + 1) * cols : (2 * i + 2) * cols]
            for j in range(cols):
                z0[j] = me0[j] + m1[j] + m2[j]
            for j in range(cols):
                z1[j] = me1[j] + m2[j] + m3[j]
        for r in range(nr):
            n, ty = (r0 + r) // th, (r0 + r) % th
            o = (n * channels + k) * out_plane + 2 * ty * out_w
            for tx in range(tw):
                j = tx * nr + r
                # z rows: e0 (0, 1), e1 (2, 3), m1 (4, 5), m2 (6, 7), m3 (8, 9); columns 0 / 1 interleaved
                x = o + 2 * tx
                dst[x] = z[j] + z[4 * cols + j] + z[6 * cols + j]
                dst[x + 1] = z[cols + j] + z[5 * cols + j] + z[7 * cols + j]
                dst[x + out_w] = z[2 * cols + j] + z[6 * cols + j] + z[8 * cols + j]
                dst[x + out_w + 1] = z[3 * cols + j] + z[7 * cols + j] + z[9 * cols + j]


@njit(cache=True, nogil=True)
def _rows(x, u, out, first, last, rows, mine):
    """Tile rows [first, last) on the calling thread, ``rows`` at a time: transform, 16 GEMMs, transform."""
    c_in, height, width = x.shape[1], x.shape[2], x.shape[3]
    c_out = out.shape[1]
    tw = width // 4
    src, dst = x.reshape(x.size), out.reshape(out.size)
    v_offsets = np.empty(GROUPS + 1, np.int64)
    m_offsets = np.empty(GROUPS + 1, np.int64)
    scalars = np.empty(2, np.float32)
    plane = c_in * c_out + SKEW
    for r0 in range(first, last, rows):
        nr = min(rows, last - r0)
        cols = nr * tw
        _group_offsets(c_in, cols, v_offsets)
        _group_offsets(c_out, cols, m_offsets)
        v = mine[: v_offsets[GROUPS]]
        m = mine[v_offsets[GROUPS] : v_offsets[GROUPS] + m_offsets[GROUPS]]
        tmp = mine[v_offsets[GROUPS] + m_offsets[GROUPS] :]
        _input_transform(src, r0, nr, np.int64(0), c_in, c_in, height, width, v, v_offsets, tmp)
        for g in range(GROUPS):
            wide = _mult(g // 4) * _mult(g % 4) * cols
            sgemm(False, False, c_out, wide, c_in, u[g * plane :], c_in, v[v_offsets[g] :], wide, 0.0,
                  m[m_offsets[g] :], wide, scalars)
        _output_transform(m, r0, nr, np.int64(0), c_out, c_out, height, width, dst, m_offsets, tmp)


def forward(x, w, out, threads: int, rows: int, scratch) -> None:
    """out = conv3×3(x, w), stride 2, pad 1 (``supported`` shapes), by the polyphase Winograd transform."""
    n, c_in, height, width = x.shape
    c_out = out.shape[1]
    total = n * (height // 4)
    start = _filter_size(c_in, c_out)
    u = scratch[:start]
    run_shares(lambda t: _filter_transform(w, t * c_out // threads, (t + 1) * c_out // threads, u), threads)
    per_thread = _per_thread(c_in, c_out, width, rows)

    def work(t: int) -> None:
        mine = scratch[start + t * per_thread : start + (t + 1) * per_thread]
        _rows(x, u, out, t * total // threads, (t + 1) * total // threads, rows, mine)

    run_shares(work, threads)


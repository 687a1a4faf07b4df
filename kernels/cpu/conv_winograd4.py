"""3×3 stride-1 pad-1 convolution as cache-blocked Winograd F(4×4, 3×3): study versions 14, 15 and 18.

Why. F(2×2, 3×3) (``conv_winograd.py``) does 16 multiplies per 2×2 output tile and input/output
channel pair: 4 per output against the direct 9. F(4×4, 3×3) does 36 per 4×4 tile: 2.25 per output,
1.78× fewer GEMM flops again, and its transformed input V holds 36 values per 16 outputs (2.25 per
output, not 4), so the transforms move less data too. The price: larger transform coefficients
(up to 8 in Aᵀ, 5 in Bᵀ, 1/24 in G), so more rounding, and 36 GEMMs per block instead of 16.

The algorithm (Lavin & Gray 2015), per 4×4 output tile and its 6×6 input tile ``d`` (rows and
columns 4·t − 1 … 4·t + 4, zero outside the plane)::

    U = G g Gᵀ   G  = [[1/4, 0, 0], [−1/6, −1/6, −1/6], [−1/6, 1/6, −1/6],
                       [1/24, 1/12, 1/6], [1/24, −1/12, 1/6], [0, 0, 1]]
    V = Bᵀ d B   Bᵀ = [[4, 0, −5, 0, 1, 0], [0, −4, −4, 1, 1, 0], [0, 4, −4, −1, 1, 0],
                       [0, −2, −1, 2, 1, 0], [0, 2, −1, −2, 1, 0], [0, 4, 0, −5, 0, 1]]
    M[ξ] = U[ξ] @ V[ξ] for the 36 positions ξ: (K × C) @ (C × tiles) GEMMs
    Y = Aᵀ M A   Aᵀ = [[1, 1, 1, 1, 1, 0], [0, 1, −1, 2, −2, 0], [0, 1, 1, 4, 4, 0], [0, 1, −1, 8, −8, 1]]

Layout and blocking as ``conv_winograd`` (tiles in raster order over (image, tile row, tile
column), thread t owns a fixed range of tile rows, blocks of ``rows`` tile rows, V and M per block,
planes ``SKEW`` floats apart). Backward-data is the forward convolution of dout with the flipped,
transposed filter, transformed as such (``_filter_transform(..., flipped=True)``): F(4×4)'s G has
no row-swap symmetry to reuse the forward's U.

The input transform splits each padded input row into its four column phases (x + 1 ≡ q mod 4),
so that Bᵀ down the six rows is one contiguous loop per output row, and B across a tile's six
columns reads phases 0–3 at the tile and 0–1 at the next: contiguous streams over the tiles.

Since v18 a block's tiles are numbered column-major, tile (r, tx) of the block's tile rows r at
column j = tx·nr + r of V and M (the GEMMs do not care which column is which tile). The phase-split
rows of all nr tile rows of a channel then sit side by side, p[i][q][m·nr + r], and "phase q at the
next tile" is the same array shifted by nr: Bᵀ is six loops over the whole block (6·4·(tw + 1)·nr
values each) and B 36 loops of tw·nr, where v14–v17 ran 48 loops of ⌈W/4⌉ (+ 1) iterations per
tile row and channel (2–9 iterations: loop overhead and runtime alias checks, not arithmetic, were
the cost, 360–560 ns per tile row and channel). The output transform does Aᵀ as 24 loops over the
block, then A across each tile into the output rows; the weight gradient's dout transform writes M
in the same order. One thread, 16 images, blocks as the forward's, input transform ms, v17 → v18:
64 @32×32 4.58 → 2.09, 128 @16×16 4.12 → 1.26, 256 @8×8 3.36 → 0.89 (512 @4×4 2.95 → 0.76). Whole
convolutions, two threads, batch 32, wall ms, median of 7 rounds of best-of-5, main and this tree
in alternating processes, two rounds each: 64 @32×32 forward 8.17 / 7.92 → 6.33 / 6.90, backward-data
12.50 / 7.83 → 6.28 / 6.82, weight 19.12 / 10.75 → 10.22 / 12.90 (noise both ways); 128 @16×16 forward
17.55 / 9.41 → 6.04 / 6.33, backward-data 15.35 / 9.31 → 5.93 / 6.67, weight 8.68 / 9.70 → 7.29 /
7.70; 256 @8×8 weight 8.88 / 9.58 → 7.08 / 7.46. With the cheaper transforms F(4×4) also wins
forward and backward-data on 8×8 planes (``conv.WINOGRAD4_MIN_PIXELS_8X8``). The forward's bits do
not change (each column of a GEMM is the same dot product wherever it sits); the weight gradient
sums the tiles in the new order.

The weight gradient (v15, ``backward_weight``) is ``conv_winograd.backward_weight``'s scheme with
these transforms: dw = Gᵀ [Σ_tiles (A dY Aᵀ) ⊙ (Bᵀ d B)] G (A = (Aᵀ)ᵀ, 6 × 4), per block 36 GEMMs
dU[ξ] += M[ξ] V[ξ]ᵀ split by ξ over the threads, blocks fixed by the shape: the same bits at any
thread count. Two threads, batch 32, wall ms (AMD EPYC, OpenBLAS), the table before → F(4×4):
64 @32×32 15.51 (shifted GEMMs) → 11.25; 128 @16×16 10.56 (F(2×2)) → 9.09; 256 @8×8 10.30 → 9.23.
Its rounding: max abs error against float64, batch 2, weights of magnitude up to 197 / 96 / 53:
1.4e-3 / 4.4e-4 / 2.2e-4 (~7e-6 of the largest; the shifted and F(2×2) paths: 8.5e-5 / 6.3e-5 /
1.7e-5).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
from numba import njit

from kernels.cpu.conv_shifted import gemm_list, gemm_table, row_block, sgemm
from kernels.cpu.conv_winograd import SKEW, block_buffers, weight_gemms
from kernels.cpu.threads import run_shares

# SKEW: floats between consecutive ξ planes beyond their size (4 KiB set aliasing), conv_winograd's, so
# the two paths share weight_gemms


def supported(x_shape, w_shape, stride: int, pad: int, groups: int) -> bool:
    return groups == 1 and w_shape[2] == 3 and w_shape[3] == 3 and stride == 1 and pad == 1


def block_rows(x_shape, c_in: int, c_out: int, threads: int, target_tiles: int = 128,
               budget: int = 1 << 20) -> int:
    """Tile rows per block: ``target_tiles`` tiles, V and M within ``budget`` floats, ≤ a thread's share."""
    n, _, h, w = x_shape
    tw = (w + 3) // 4
    share = -(-n * ((h + 3) // 4) // threads)
    wanted = -(-target_tiles // tw)
    fits = max(1, budget // (36 * (c_in + c_out) * tw))
    return max(1, min(share, wanted, fits))


def _per_thread(c_in: int, c_out: int, width: int, rows: int) -> int:
    tw = (width + 3) // 4
    return 36 * ((c_in + c_out) * rows * tw + 2 * SKEW) + _buffer(width, rows)


def _buffer(width: int, rows: int) -> int:
    """The transforms' row buffer for blocks of ``rows`` tile rows: the input transform's phase-split
    rows and Bᵀ of them (48·(tw + 1)·rows), more than the output transform's 24·tw·rows."""
    return 48 * ((width + 3) // 4 + 1) * rows


def workspace_size(x_shape, w_shape, direction: str, threads: int, rows: int) -> int:
    """Scratch (float32 elements): U (36·K·C), and per thread a block's V and M and row buffers."""
    k, c = w_shape[0], w_shape[1]
    c_in, c_out = (k, c) if direction == "data" else (c, k)
    return 36 * (k * c + SKEW) + threads * _per_thread(c_in, c_out, x_shape[3], rows)


@njit(cache=True, nogil=True, inline="always")
def _g6(x0, x1, x2):
    """G applied to three values: six."""
    q, s, t = np.float32(0.25), np.float32(1.0 / 6.0), np.float32(1.0 / 24.0)
    a = x0 + x2
    b = t * x0 + s * x2
    h = np.float32(1.0 / 12.0) * x1
    return q * x0, -s * (a + x1), -s * (a - x1), b + h, b - h, x2


@njit(cache=True, nogil=True)
def _filter_transform(w, lo, hi, u, flipped):
    """u[ξ][k, c] = (G w[k, c] Gᵀ)[ξ] for k in [lo, hi) (36 planes of K × C); flipped (backward-data):
    u[ξ][c, k] = (G w[k, c, ::-1, ::-1] Gᵀ)[ξ] for c in [lo, hi) (planes of C × K).

    The scalar form, kept as the reference ``_filter_rows`` is tested against (the same bits): since 2026-11-28
    ``forward`` transforms its U with ``_filter_rows`` too, so no warm-up compiles this one (0.42 s of the CIFAR
    warm-up's exclusive compile CPU)."""
    k, c = w.shape[0], w.shape[1]
    plane = k * c + SKEW
    g = w.reshape(w.size)
    rows = np.empty((6, 3), np.float32)
    for outer in range(lo, hi):
        for inner in range(c if not flipped else k):
            kk, cc = (outer, inner) if not flipped else (inner, outer)
            s = 9 * (kk * c + cc)
            at = kk * c + cc if not flipped else cc * k + kk
            for j in range(3):  # G down each column j of g
                if flipped:
                    x0, x1, x2 = g[s + 8 - j], g[s + 5 - j], g[s + 2 - j]
                else:
                    x0, x1, x2 = g[s + j], g[s + 3 + j], g[s + 6 + j]
                y = _g6(x0, x1, x2)
                for i in range(6):
                    rows[i, j] = y[i]
            for i in range(6):  # then G across each row
                y = _g6(rows[i, 0], rows[i, 1], rows[i, 2])
                for j in range(6):
                    u[(6 * i + j) * plane + at] = y[j]


@njit(cache=True, nogil=True, inline="always")
def _bt_runs(d0, d1, d2, d3, d4, d5, o0, o1, o2, o3, o4, o5, length):
    """o = Bᵀ (d0 … d5) element by element over runs of ``length``: one flat loop per output row, so
    each vectorizes. The input transform's pass down the rows and its pass across the columns.

    Written out four times before (both passes of both transforms); as two inlined helpers the same
    bits and the same time (batch 32, two threads, best of 15, three alternating rounds, ms before /
    after: 64 @32×32 forward 6.60, 6.45, 6.64 / 6.78, 6.50, 6.60; weight 9.20, 9.24, 9.19 / 9.16,
    9.19, 9.26; 256 @8×8 weight 7.09, 6.75, 6.89 / 6.91, 6.96, 7.02)."""
    four, five, two = np.float32(4.0), np.float32(5.0), np.float32(2.0)
    for e in range(length):
        o0[e] = four * d0[e] - five * d2[e] + d4[e]
    for e in range(length):
        o1[e] = d3[e] + d4[e] - four * (d1[e] + d2[e])
    for e in range(length):
        o2[e] = four * (d1[e] - d2[e]) - d3[e] + d4[e]
    for e in range(length):
        o3[e] = two * (d3[e] - d1[e]) - d2[e] + d4[e]
    for e in range(length):
        o4[e] = two * (d1[e] - d3[e]) - d2[e] + d4[e]
    for e in range(length):
        o5[e] = four * d1[e] - five * d3[e] + d5[e]


@njit(cache=True, nogil=True, inline="always")
def _a_runs(y0, y1, y2, y3, o0, o1, o2, o3, o4, o5, length):
    """o = A (y0 … y3) element by element over runs of ``length`` (A: F(4×4)'s 6 × 4 output matrix,
    transposed): the weight gradient's dout transform down the rows and across the columns."""
    two, four, eight = np.float32(2.0), np.float32(4.0), np.float32(8.0)
    for e in range(length):
        o0[e] = y0[e]
    for e in range(length):
        o1[e] = y0[e] + y1[e] + y2[e] + y3[e]
    for e in range(length):
        o2[e] = y0[e] - y1[e] + y2[e] - y3[e]
    for e in range(length):
        o3[e] = y0[e] + two * y1[e] + four * y2[e] + eight * y3[e]
    for e in range(length):
        o4[e] = y0[e] - two * y1[e] + four * y2[e] - eight * y3[e]
    for e in range(length):
        o5[e] = y3[e]


@njit(cache=True, nogil=True)
def _input_transform(src, r0, nr, channels, height, width, v, buf, c_lo=0, c_hi=-1):
    """v[ξ][c][j] = (Bᵀ d B)[ξ] for the channels [c_lo, c_hi) (all by default) and the tiles of tile
    rows [r0, r0 + nr), tile (r, tx) at column j = tx·nr + r (column-major within the block, v18).

    Per channel, the block's ``nr`` tile rows are first split into their six input rows and four
    column phases, p[i][q][m·nr + r] = d(4ty − 1 + i, 4m + q − 1) (zero outside the plane); then
    Bᵀ down the rows is six loops over the whole block (6·4·(tw + 1)·nr each), and B across a tile's
    six columns, phases 0–3 at m = tx and 0–1 at m = tx + 1, i.e. at j and j + nr, is 36 loops of
    tw·nr over the whole block. v14 did the same per tile row: 48 loops of ⌈W/4⌉ + 1 or ⌈W/4⌉
    iterations each, whose loop overhead made the transform cost more than the GEMMs.

    Tried and dropped (2026-11-26): each input row first copied into a zero-padded buffer, so that the
    phase split has no bounds checks. 64 @32×32, 16 images, one thread, this transform alone, ms, two
    alternating pairs: 2.20 / 2.12 → 2.59 / 2.84. (The transform is 1.98–2.20 ms of such a forward's
    ~6 ms; the GEMMs 2.7, the output transform 1.2.)"""
    th, tw = (height + 3) // 4, (width + 3) // 4
    cols = nr * tw
    ph = tw + 1  # phase length: positions 4m + q, m ≤ tw
    span = ph * nr  # one phase of one input row over the block's tile rows
    row = 4 * span
    p = buf[: 6 * row]
    t = buf[6 * row : 12 * row]  # Bᵀ p
    plane = height * width
    step = channels * cols + SKEW
    zero = np.float32(0.0)
    for c in range(c_lo, channels if c_hi < 0 else c_hi):
        for r in range(nr):
            n, ty = (r0 + r) // th, (r0 + r) % th
            s0 = (n * channels + c) * plane
            for i in range(6):
                y = 4 * ty - 1 + i
                if 0 <= y < height:
                    a = s0 + y * width
                    for q in range(4):
                        pq = p[i * row + q * span + r :]
                        for m in range(ph):
                            x = 4 * m + q - 1
                            pq[m * nr] = src[a + x] if 0 <= x < width else zero
                else:
                    for q in range(4):
                        pq = p[i * row + q * span + r :]
                        for m in range(ph):
                            pq[m * nr] = zero
        d0, d1, d2 = p[0:row], p[row : 2 * row], p[2 * row : 3 * row]
        d3, d4, d5 = p[3 * row : 4 * row], p[4 * row : 5 * row], p[5 * row : 6 * row]
        t0, t1, t2 = t[0:row], t[row : 2 * row], t[2 * row : 3 * row]
        t3, t4, t5 = t[3 * row : 4 * row], t[4 * row : 5 * row], t[5 * row : 6 * row]
        _bt_runs(d0, d1, d2, d3, d4, d5, t0, t1, t2, t3, t4, t5, row)
        for i in range(6):
            ti = t[i * row : (i + 1) * row]
            # phase q at tile column tx: ti[q·span + tx·nr + r] = eq[j]; at tx + 1: eq[j + nr]
            e0, e1 = ti[0 : span], ti[span : 2 * span]
            e2, e3 = ti[2 * span : 2 * span + cols], ti[3 * span : 3 * span + cols]
            f0, f1 = ti[nr : nr + cols], ti[span + nr : span + nr + cols]
            b = 6 * i * step + c * cols
            o0, o1, o2 = v[b : b + cols], v[b + step : b + step + cols], v[b + 2 * step : b + 2 * step + cols]
            o3, o4 = v[b + 3 * step : b + 3 * step + cols], v[b + 4 * step : b + 4 * step + cols]
            o5 = v[b + 5 * step : b + 5 * step + cols]
            # the tile's six columns: e0, e1, e2, e3 (phases 0-3 at tx), f0, f1 (phases 0-1 at tx + 1)
            _bt_runs(e0, e1, e2, e3, f0, f1, o0, o1, o2, o3, o4, o5, cols)


@njit(cache=True, nogil=True)
def _output_transform(m, r0, nr, channels, height, width, dst, buf, k_lo, k_hi):
    """dst[n, k, 4ty + a, 4tx + b] = (Aᵀ M A)[a, b] for the output channels [k_lo, k_hi) (M holds just
    those, k at row k − k_lo) and the tiles of tile rows [r0, r0 + nr) (tile (r, tx) at column
    j = tx·nr + r of M, as ``_input_transform`` wrote V): Aᵀ down the six rows of every tile of the
    block in 24 loops over the block, then A across each tile's six columns into the output rows."""
    th, tw = (height + 3) // 4, (width + 3) // 4
    cols = nr * tw
    stride = (k_hi - k_lo) * cols + SKEW
    plane = height * width
    s = buf[: 24 * cols]  # s[a][j'][tile] = Σ_i Aᵀ[a, i] M[(i, j')][tile]
    two, four, eight = np.float32(2.0), np.float32(4.0), np.float32(8.0)
    for k in range(k_lo, k_hi):
        b = (k - k_lo) * cols
        for jj in range(6):
            at = b + jj * stride
            m0, m1, m2 = m[at : at + cols], m[at + 6 * stride :], m[at + 12 * stride :]
            m3, m4, m5 = m[at + 18 * stride :], m[at + 24 * stride :], m[at + 30 * stride :]
            s0, s1 = s[jj * cols : (jj + 1) * cols], s[(6 + jj) * cols : (7 + jj) * cols]
            s2, s3 = s[(12 + jj) * cols : (13 + jj) * cols], s[(18 + jj) * cols : (19 + jj) * cols]
            for e in range(cols):
                s0[e] = m0[e] + m1[e] + m2[e] + m3[e] + m4[e]
            for e in range(cols):
                s1[e] = m1[e] - m2[e] + two * (m3[e] - m4[e])
            for e in range(cols):
                s2[e] = m1[e] + m2[e] + four * (m3[e] + m4[e])
            for e in range(cols):
                s3[e] = m1[e] - m2[e] + eight * (m3[e] - m4[e]) + m5[e]
        for r in range(nr):
            n, ty = (r0 + r) // th, (r0 + r) % th
            o = (n * channels + k) * plane
            for a in range(4):
                y = 4 * ty + a
                if y >= height:
                    break
                sa = s[6 * a * cols + r :]
                out = dst[o + y * width : o + (y + 1) * width]
                for tx in range(tw):
                    at = tx * nr
                    v0, v1, v2 = sa[at], sa[cols + at], sa[2 * cols + at]
                    v3, v4, v5 = sa[3 * cols + at], sa[4 * cols + at], sa[5 * cols + at]
                    x = 4 * tx
                    y0 = v0 + v1 + v2 + v3 + v4
                    y1 = v1 - v2 + two * (v3 - v4)
                    y2 = v1 + v2 + four * (v3 + v4)
                    y3 = v1 - v2 + eight * (v3 - v4) + v5
                    if x + 3 < width:
                        out[x] = y0
                        out[x + 1] = y1
                        out[x + 2] = y2
                        out[x + 3] = y3
                    else:
                        out[x] = y0
                        if x + 1 < width:
                            out[x + 1] = y1
                        if x + 2 < width:
                            out[x + 2] = y2


@lru_cache(maxsize=512)
def _gemms(uplane, vplane, mplane, c_out, cols, c_in, step) -> np.ndarray:
    """The ``gemm_list`` table of a block: M[ξ] (c_out × cols) = U[ξ] (c_out × c_in) @ V[ξ] (c_in × cols) for the 36
    positions ξ, each GEMM in blocks of ``step`` output rows (``row_block``); planes ``uplane``, ``vplane``,
    ``mplane`` floats apart."""
    return gemm_table(
        (False, False, min(step, c_out - k0), cols, c_in, xi * uplane + k0 * c_in, c_in, xi * vplane, cols, 0,
         xi * mplane + k0 * cols, cols)
        for xi in range(36) for k0 in range(0, c_out, step)
    )


def _rows(x, u, out, first, last, rows, mine, limit):
    """Tile rows [first, last) on the calling thread, ``rows`` at a time: transform, 36 GEMMs (each in row
    blocks of ≤ ``limit`` multiply-adds when ``limit`` > 0), transform.

    A Python loop over compiled pieces, not one compiled driver: Numba links a compiled callee's code into
    every compiled caller and optimizes and emits it again there, so a driver in ``njit`` compiled both
    transforms a second time (1.75 s of a cold first run's CPU for this function alone, against ~1 µs a
    block for three calls from Python; ``conv.py``'s module docstring, "Compiled pieces, Python drivers")."""
    c_in, height, width = x.shape[1], x.shape[2], x.shape[3]
    c_out = out.shape[1]
    tw = (width + 3) // 4
    tb = rows * tw
    src, dst = x.reshape(x.size), out.reshape(out.size)
    vsize = 36 * (c_in * tb + SKEW)
    msize = 36 * (c_out * tb + SKEW)
    v = mine[:vsize]
    m = mine[vsize : vsize + msize]
    buf = mine[vsize + msize :]
    uplane = c_in * c_out + SKEW
    for r0 in range(first, last, rows):
        nr = min(rows, last - r0)
        cols = nr * tw
        _input_transform(src, r0, nr, c_in, height, width, v, buf, 0, c_in)
        gemm_list(u, v, m, _gemms(uplane, c_in * cols + SKEW, c_out * cols + SKEW, c_out, cols, c_in,
                                  row_block(c_out, c_in, cols, limit)))
        _output_transform(m, r0, nr, c_out, height, width, dst, buf, 0, c_out)


def forward(x, w, out, flipped: bool, threads: int, rows: int, scratch, limit: int = 0) -> None:
    """out = conv3×3(x, w), stride 1, pad 1, by Winograd F(4×4, 3×3) (flipped: backward-data, x = dout).

    ``limit`` > 0 (v30): each of the 36 GEMMs in blocks of output channels of ≤ ``limit`` multiply-adds,
    where SciPy's OpenBLAS takes its small-matrix kernel (``conv_pointwise.SMALL_GEMM_MNK``, v27's finding).
    Same thread count, same bits, as before; the bits can differ from one GEMM's (256 @8×8 did, 64 @32×32
    and 128 @16×16 did not).
    Batch 32, two threads, the table's forward with the limit switched, median of 15 alternating calls, ms,
    one GEMM → blocks of ≤ 10⁶: 64 @32×32 6.72 → 6.68 (its GEMMs are ≤ 10⁶ already), 128 @16×16 7.20 →
    6.46, 256 @8×8 8.32 → 7.48."""
    n, c_in, height, width = x.shape
    c_out = out.shape[1]
    total = n * ((height + 3) // 4)
    u = scratch[: 36 * (c_in * c_out + SKEW)]
    outer = w.shape[1] if flipped else w.shape[0]
    per_thread = _per_thread(c_in, c_out, width, rows)
    start = 36 * (c_in * c_out + SKEW)

    def filters(t: int) -> None:  # each thread's share of U, ``forward_by_k``'s transform (the thread's V as scratch)
        lo, hi = t * outer // threads, (t + 1) * outer // threads
        _filter_rows(w, lo, hi, u[lo * c_in :], c_in * c_out + SKEW, flipped, scratch[start + t * per_thread :])

    run_shares(filters, threads)

    def work(t: int) -> None:
        mine = scratch[start + t * per_thread : start + (t + 1) * per_thread]
        _rows(x, u, out, t * total // threads, (t + 1) * total // threads, rows, mine, limit)

    run_shares(work, threads)


@njit(cache=True, nogil=True, inline="always")
def _g6_runs(x0, x1, x2, y0, y1, y2, y3, y4, y5, length):
    """``_g6`` over runs: (y0[r], …, y5[r]) = G (x0[r], x1[r], x2[r]) for r < ``length``."""
    for r in range(length):
        y0[r], y1[r], y2[r], y3[r], y4[r], y5[r] = _g6(x0[r], x1[r], x2[r])


@njit(cache=True, nogil=True)
def _filter_rows(w, lo, hi, u, plane, flipped, tmp):
    """u[ξ·plane + (o − lo)·R + r] = (G g Gᵀ)[ξ] for the output channels o in [lo, hi) and every
    reduction channel r (R of them), g = w[o, r] (flipped, backward-data: g = w[r, o] rotated 180°):
    ``_filter_transform``'s arithmetic, the same bits, as loops over r that LLVM vectorizes.

    Per output channel the nine taps are gathered into nine rows of R (``tmp[:9R]``), G runs down the
    three columns (18 rows, ``tmp[9R:27R]``), then across the six rows into six runs of u each."""
    c = w.shape[1]
    inner = w.shape[0] if flipped else c
    g = w.reshape(w.size)
    taps = tmp[: 9 * inner]
    col = tmp[9 * inner : 27 * inner]
    for o in range(lo, hi):
        if flipped:  # tap (i, j) of w[r, o] rotated: w[r, o, 2 − i, 2 − j]
            for r in range(inner):
                b = 9 * (r * c + o) + 8
                for e in range(9):
                    taps[e * inner + r] = g[b - e]
        else:
            b = 9 * o * c
            for r in range(inner):
                for e in range(9):
                    taps[e * inner + r] = g[b + 9 * r + e]
        for j in range(3):  # G down column j: rows i = 0..5 of column j at col[(3i + j)·R]
            _g6_runs(taps[j * inner :], taps[(3 + j) * inner :], taps[(6 + j) * inner :], col[j * inner :],
                     col[(3 + j) * inner :], col[(6 + j) * inner :], col[(9 + j) * inner :], col[(12 + j) * inner :],
                     col[(15 + j) * inner :], inner)
        at = (o - lo) * inner
        for i in range(6):  # then G across row i
            b = 6 * i * plane + at
            _g6_runs(col[3 * i * inner :], col[(3 * i + 1) * inner :], col[(3 * i + 2) * inner :], u[b:],
                     u[b + plane :], u[b + 2 * plane :], u[b + 3 * plane :], u[b + 4 * plane :], u[b + 5 * plane :],
                     inner)


BY_K_BLOCK = 16
"""Output channels per block of ``forward_by_k``: its GEMMs are 16 × C times C × tiles."""

BY_K_V_BUDGET = 3 << 19
"""At most this many float32 (6 MiB) in ``forward_by_k``'s V: larger batches go in groups of images."""


def by_k_images(x_shape, c_in: int) -> int:
    """Images per group of ``forward_by_k`` (fixed by the shape, not the threads: the same bits at any
    thread count): as many as keep V within ``BY_K_V_BUDGET``, all of a batch of 32 at 512 @4×4 and
    256 @8×8."""
    n, _, h, w = x_shape
    per_image = 36 * c_in * ((h + 3) // 4) * ((w + 3) // 4)
    return max(1, min(n, BY_K_V_BUDGET // per_image))


def by_k_workspace_size(x_shape, w_shape, direction: str, threads: int, block: int = BY_K_BLOCK) -> int:
    """Scratch of ``forward_by_k``: one group's V, and per thread a block's U and M and the buffers."""
    k, c = w_shape[0], w_shape[1]
    c_in, c_out = (k, c) if direction == "data" else (c, k)
    h, wd = x_shape[2], x_shape[3]
    rows = by_k_images(x_shape, c_in) * ((h + 3) // 4)
    cols = rows * ((wd + 3) // 4)
    return 36 * (c_in * cols + SKEW) + threads * _by_k_per_thread(c_in, c_out, wd, rows, block)


def _by_k_per_thread(c_in: int, c_out: int, width: int, rows: int, block: int) -> int:
    cols = rows * ((width + 3) // 4)
    kb = min(block, c_out)
    return 36 * (kb * c_in + SKEW) + 36 * (kb * cols + SKEW) + max(_buffer(width, rows), 24 * cols, 27 * c_in)


def _k_blocks(w, v, out, flipped, r0, nr, first, last, block, mine):
    """Output-channel blocks [first, last) of ``forward_by_k`` for the tile rows [r0, r0 + nr), on the
    calling thread: per block the filter transform of its channels into U (``_filter_rows``), 36 GEMMs
    with all of V's tiles as columns, the output transform of its channels. A Python loop over compiled
    pieces, as ``_rows``."""
    c_in = w.shape[0] if flipped else w.shape[1]
    c_out, height, width = out.shape[1], out.shape[2], out.shape[3]
    cols = nr * ((width + 3) // 4)
    kb = min(block, c_out)
    uplane = kb * c_in + SKEW
    u = mine[: 36 * uplane]
    m = mine[36 * uplane : 36 * (uplane + kb * cols + SKEW)]
    buf = mine[36 * (uplane + kb * cols + SKEW) :]
    dst = out.reshape(out.size)
    vplane = c_in * cols + SKEW
    for b in range(first, last):
        k0 = b * block
        k1 = min(k0 + block, c_out)
        rows = k1 - k0
        _filter_rows(w, k0, k1, u, uplane, flipped, buf)
        # one GEMM per ξ (step = rows), M in ``_output_transform``'s layout for this block's channels
        gemm_list(u, v, m, _gemms(uplane, vplane, rows * cols + SKEW, rows, cols, c_in, rows))
        _output_transform(m, r0, nr, c_out, height, width, dst, buf, k0, k1)


def forward_by_k(x, w, out, flipped: bool, threads: int, scratch, block: int = BY_K_BLOCK) -> None:
    """``forward`` for small planes split by output channel (v34): per group of images
    (``by_k_images``: the whole batch of 32) the threads transform the input by channel into one V,
    then each takes whole blocks of ``block`` output channels and, per block, transforms just those
    channels' filters (``_filter_rows``), runs the 36 GEMMs (``block`` × C times C × every tile of the
    group) and the output transform of those channels.

    Why. At 512 @4×4 U is 36 MiB: ``forward`` wrote it (3.6–6 ms of a 10 ms call, two threads, mostly
    stores: the vectorized transform only halved it) and then every thread's GEMMs read all of it from
    memory again for 16 tiles each; F(2×2) by ξ (v23, 9.9 ms) has half the U and four times the
    tiles. Here U never leaves the cache (a block's is 1.2 MiB), the GEMMs have every tile as columns
    and, at ≤ 10⁶ multiply-adds (16 · 512 · 32 or 16 · 256 · 128), run on OpenBLAS's small-matrix
    kernel. The blocks and groups are fixed by the shape, every output is one GEMM column's dot
    product and one thread's transform: the same bits at any thread count.

    An output-channel split was tried before for F(2×2) and dropped (``conv_study.forward_by_channels``:
    512 @4×4 12.90 → 13.23 ms): it kept the shared U, transformed whole and written to memory by both
    threads, and handed V over per block of tile rows. Here the filter transform is the thread's own
    and in cache, and V is handed over once per call. Batch 32, two threads, ``conv.forward`` /
    ``conv.backward_data`` with v30's and v34's paths alternating, median of 15 calls, ms: 512 @4×4
    10.17 → 6.70 / 10.85 → 7.15, 256 @8×8 8.01 → 5.65 / 8.43 → 5.79, ImageNet's 512 @7×7 36.50 →
    21.38 (F(2×2) before); blocks of 8 / 16 / 32 / 48 channels at 512 @4×4 6.2 / 6.4 / 6.2 / 6.8, at
    256 @8×8 5.2 / 5.0 / 7.2 / 7.4 (above 10⁶ multiply-adds a GEMM packs). On 16×16 and larger planes
    it loses (128 @16×16 8.33 → 8.96, 64 @32×32 6.81 → 12.90: V no longer fits the cache), so those
    keep ``forward``."""
    n, c_in, height, width = x.shape
    c_out = out.shape[1]
    th, tw = (height + 3) // 4, (width + 3) // 4
    images = by_k_images(x.shape, c_in)
    rows = images * th
    vsize = 36 * (c_in * rows * tw + SKEW)
    per_thread = _by_k_per_thread(c_in, c_out, width, rows, block)
    src = x.reshape(x.size)
    blocks = -(-c_out // block)

    def mine(t: int):
        return scratch[vsize + t * per_thread : vsize + (t + 1) * per_thread]

    for n0 in range(0, n, images):
        r0, nr = n0 * th, min(images, n - n0) * th
        v = scratch[: 36 * (c_in * nr * tw + SKEW)]
        run_shares(lambda t, r0=r0, nr=nr, v=v: _input_transform(
            src, r0, nr, c_in, height, width, v, mine(t), t * c_in // threads, (t + 1) * c_in // threads), threads)
        run_shares(lambda t, r0=r0, nr=nr, v=v: _k_blocks(
            w, v, out, flipped, r0, nr, t * blocks // threads, (t + 1) * blocks // threads, block, mine(t)), threads)


# ----------------------------------------------------------------------------------------------
# The weight gradient: dw = Gᵀ [Σ_tiles (A dY Aᵀ) ⊙ (Bᵀ d B)] G
# ----------------------------------------------------------------------------------------------

WEIGHT_TARGET_TILES = 256
"""Tiles per block of the weight gradient. Two threads, batch 32, wall ms, median of 5 rounds of
best-of-5 (AMD EPYC, OpenBLAS), blocks of 128 / 256 / 512 / 1024 tiles: 64 @32×32 11.96 / 11.25 /
11.12 / 12.41; 128 @16×16 9.02 / 9.09 / 9.95 (the last two the same block)."""

WEIGHT_BUDGET_ELEMENTS = 1 << 22
"""At most this many float32 (16 MiB) in the weight gradient's block V and M together."""


def weight_block_rows(x_shape, c_in: int, c_out: int, target_tiles: int = WEIGHT_TARGET_TILES,
                      budget: int = WEIGHT_BUDGET_ELEMENTS) -> int:
    """Tile rows per block of the weight gradient, independent of the thread count (the blocks fix the
    order of every sum: the same bits at any thread count)."""
    n, _, h, w = x_shape
    tw = (w + 3) // 4
    total = n * ((h + 3) // 4)
    wanted = -(-target_tiles // tw)
    fits = max(1, budget // (36 * (c_in + c_out) * tw))
    return max(1, min(total, wanted, fits))


def _weight_buffer(width: int, rows: int) -> int:
    tw = (width + 3) // 4
    return max(_buffer(width, rows), 40 * tw * rows)  # the dout transform's p and A p for the block


def weight_workspace_size(x_shape, w_shape, threads: int, rows: int) -> int:
    """Scratch of the weight gradient: dU (36·K·C), one block's V and M, per thread a row buffer."""
    k, c = w_shape[0], w_shape[1]
    tw = (x_shape[3] + 3) // 4
    return 36 * (k * c + SKEW) + 36 * ((c + k) * rows * tw + 2 * SKEW) + threads * _weight_buffer(x_shape[3], rows)


@njit(cache=True, nogil=True)
def _dout_transform(src, r0, nr, k_lo, k_hi, channels, height, width, m, buf):
    """m[ξ][k][j] = (A dY Aᵀ)[ξ] for the channels [k_lo, k_hi) and the tiles j of tile rows
    [r0, r0 + nr) of dY (flat NCHW, the output plane = the input plane); zeros past the edges.

    A dY has rows y0, y0 + y1 + y2 + y3, y0 − y1 + y2 − y3, y0 + 2y1 + 4y2 + 8y3, y0 − 2y1 + 4y2 − 8y3,
    y3 (the tile's four rows); the same across the columns, which are split into their four phases
    (x mod 4) so both passes are contiguous loops over the tiles.

    Since v23 both passes run over the whole block, as v18's input transform does (tile (r, tx) at
    column tx·nr + r): per channel, the block's four rows per tile row are gathered into
    p[a][q][tx·nr + r] = dY(4ty + a, 4tx + q), A down the rows is six loops of 4·tw·nr, and A across
    the columns six loops of tw·nr per row of A dY, each storing one contiguous run of M. Up to v22
    both ran per tile row (loops of tw = 2–8 iterations and stores nr apart). The same operations
    on the same values: the same bits. One thread, 16 images, ms, per tile row → block-wide: see
    kernels/README.md ("v23")."""
    th, tw = (height + 3) // 4, (width + 3) // 4
    cols = nr * tw
    step = channels * cols + SKEW
    plane = height * width
    row = 4 * cols
    p = buf[: 4 * row]  # p[a][q·cols + tx·nr + r] = dY(4ty + a, 4tx + q)
    t = buf[4 * row : 10 * row]  # A p
    zero = np.float32(0.0)
    for k in range(k_lo, k_hi):
        for r in range(nr):
            n, ty = (r0 + r) // th, (r0 + r) % th
            s0 = (n * channels + k) * plane
            for a in range(4):
                y = 4 * ty + a
                pa = p[a * row + r :]
                if y < height:
                    b = s0 + y * width
                    for q in range(4):
                        for tx in range(tw):
                            x = 4 * tx + q
                            pa[q * cols + tx * nr] = src[b + x] if x < width else zero
                else:
                    for q in range(4):
                        for tx in range(tw):
                            pa[q * cols + tx * nr] = zero
        y0, y1, y2, y3 = p[0:row], p[row : 2 * row], p[2 * row : 3 * row], p[3 * row : 4 * row]
        t0, t1, t2 = t[0:row], t[row : 2 * row], t[2 * row : 3 * row]
        t3, t4, t5 = t[3 * row : 4 * row], t[4 * row : 5 * row], t[5 * row : 6 * row]
        _a_runs(y0, y1, y2, y3, t0, t1, t2, t3, t4, t5, row)
        for i in range(6):
            ti = t[i * row : (i + 1) * row]
            e0, e1, e2, e3 = ti[0:cols], ti[cols : 2 * cols], ti[2 * cols : 3 * cols], ti[3 * cols : 4 * cols]
            b = 6 * i * step + k * cols
            o0, o1, o2 = m[b : b + cols], m[b + step : b + step + cols], m[b + 2 * step : b + 2 * step + cols]
            o3, o4 = m[b + 3 * step : b + 3 * step + cols], m[b + 4 * step : b + 4 * step + cols]
            o5 = m[b + 5 * step : b + 5 * step + cols]
            _a_runs(e0, e1, e2, e3, o0, o1, o2, o3, o4, o5, cols)


@njit(cache=True, nogil=True, inline="always")
def _gt3(x0, x1, x2, x3, x4, x5):
    """Gᵀ applied to six values: three."""
    s, t = np.float32(1.0 / 6.0), np.float32(1.0 / 24.0)
    a, b = x1 + x2, x3 + x4
    return np.float32(0.25) * x0 - s * a + t * b, s * (x2 - x1) + np.float32(1.0 / 12.0) * (x3 - x4), s * (b - a) + x5


@njit(cache=True, nogil=True)
def _filter_backward(du, dw, k_lo, k_hi, plane, k_step, c_step):
    """dw[k, c] = Gᵀ du[·][k, c] G for k in [k_lo, k_hi): 36 read streams, 9 floats out; du[ξ][k, c]
    at du[ξ·plane + (k − k_lo)·k_step + c·c_step] (``backward_weight``: all of dU, [K][C] planes, k_lo's
    row first; ``backward_weight_by_k``: one block's, [C][block])."""
    c = dw.shape[1]
    out = dw.reshape(dw.size)
    cols = np.empty((3, 6), np.float32)
    for kk in range(k_lo, k_hi):
        for cc in range(c):
            at = (kk - k_lo) * k_step + cc * c_step
            for j in range(6):  # Gᵀ down each column j: rows i of dU are the planes 6i + j
                r = _gt3(du[j * plane + at], du[(6 + j) * plane + at], du[(12 + j) * plane + at],
                         du[(18 + j) * plane + at], du[(24 + j) * plane + at], du[(30 + j) * plane + at])
                cols[0, j], cols[1, j], cols[2, j] = r[0], r[1], r[2]
            o = 9 * (kk * c + cc)
            for a in range(3):  # then G across each of the three rows
                r = _gt3(cols[a, 0], cols[a, 1], cols[a, 2], cols[a, 3], cols[a, 4], cols[a, 5])
                out[o + 3 * a], out[o + 3 * a + 1], out[o + 3 * a + 2] = r[0], r[1], r[2]


def backward_weight(x, dout, dw, threads: int, rows: int, scratch) -> None:
    """dw = ∂L/∂w of a 3×3 stride-1 pad-1 convolution by Winograd F(4×4, 3×3): per block of ``rows``
    tile rows the threads transform x (by channel) and dout (by output channel), then run the 36 GEMMs
    dU[ξ] += M[ξ] V[ξ]ᵀ (by ξ); last, dw = Gᵀ dU G (by k). The blocks do not depend on the thread
    count, so every sum runs in the same order at any thread count (``conv_winograd.backward_weight``)."""
    n, c, h, width = x.shape
    k = dw.shape[0]
    tw = (width + 3) // 4
    total = n * ((h + 3) // 4)
    du, v, m, at = block_buffers(scratch, 36, c, k, rows * tw)
    per_thread = _weight_buffer(width, rows)
    src, dsrc = x.reshape(x.size), dout.reshape(dout.size)

    def transforms(t: int, r0: int, nr: int) -> None:
        buf = scratch[at + t * per_thread : at + (t + 1) * per_thread]
        _input_transform(src, r0, nr, c, h, width, v, buf, t * c // threads, (t + 1) * c // threads)
        _dout_transform(dsrc, r0, nr, t * k // threads, (t + 1) * k // threads, k, h, width, m, buf)

    for r0 in range(0, total, rows):
        nr = min(rows, total - r0)
        beta = 0.0 if r0 == 0 else 1.0
        run_shares(lambda t, r0=r0, nr=nr: transforms(t, r0, nr), threads)
        run_shares(lambda t, nr=nr, beta=beta: weight_gemms(
            m, v, du, t * 36 // threads, (t + 1) * 36 // threads, k, c, nr * tw, beta), threads)
    plane = k * c + SKEW

    def filters(t: int) -> None:
        k_lo, k_hi = t * k // threads, (t + 1) * k // threads
        _filter_backward(du[k_lo * c :], dw, k_lo, k_hi, plane, c, 1)

    run_shares(filters, threads)


BY_K_WEIGHT_BUDGET = 6 << 20
"""At most this many float32 (24 MiB, in this machine's 32 MiB L3) in ``backward_weight_by_k``'s V and M
of the whole batch; above it the weight gradient keeps its other path. Two threads, median of 15
alternating calls, ms, the other path → by k: batch 128 at 512 @4×4 (18 MiB) 32.22 → 28.09; ImageNet's
512 @7×7 at batch 32 (18 MiB) 29.38 → 25.24, batch 16 15.54 → 11.09; batch 128 at 256 @8×8 (36 MiB)
stays on F(4×4) by ξ."""


def by_k_weight_fits(x_shape, w_shape) -> bool:
    n, _, h, wd = x_shape
    cols = n * ((h + 3) // 4) * ((wd + 3) // 4)
    return 36 * (w_shape[0] + w_shape[1]) * cols <= BY_K_WEIGHT_BUDGET


def by_k_weight_workspace_size(x_shape, w_shape, threads: int, block: int = BY_K_BLOCK) -> int:
    """Scratch of ``backward_weight_by_k``: V and M of the batch, per thread a block's Mᵀ and dUᵀ and the
    transforms' buffer."""
    k, c = w_shape[0], w_shape[1]
    n, _, h, wd = x_shape
    nr = n * ((h + 3) // 4)
    cols = nr * ((wd + 3) // 4)
    return 36 * ((c + k) * cols + 2 * SKEW) + threads * _by_k_weight_per_thread(c, k, wd, nr, block)


def _by_k_weight_per_thread(c: int, k: int, width: int, rows: int, block: int) -> int:
    cols = rows * ((width + 3) // 4)
    kb = min(block, k)
    return 36 * (kb * cols + SKEW) + 36 * (c * kb + SKEW) + max(_weight_buffer(width, rows), 18 * kb)


@njit(cache=True, nogil=True)
def _filter_backward_lanes(du, dw, k0, rows, plane, cols):
    """dw[k0 + r, c] = Gᵀ du[·][c, r] G for r < ``rows``: ``_filter_backward``'s arithmetic on one block's
    dUᵀ ([C][rows] planes, ``plane`` apart), as loops over r that LLVM vectorizes (16 lanes at 16 rows);
    ``cols``: 18·rows floats of scratch for Gᵀ down the columns."""
    c = dw.shape[1]
    out = dw.reshape(dw.size)
    for cc in range(c):
        base = cc * rows
        for j in range(6):  # Gᵀ down column j: rows i of dU are the planes 6i + j
            c0, c1, c2 = cols[j * rows :], cols[(6 + j) * rows :], cols[(12 + j) * rows :]
            d0, d1, d2 = du[j * plane + base :], du[(6 + j) * plane + base :], du[(12 + j) * plane + base :]
            d3, d4, d5 = du[(18 + j) * plane + base :], du[(24 + j) * plane + base :], du[(30 + j) * plane + base :]
            for r in range(rows):
                y = _gt3(d0[r], d1[r], d2[r], d3[r], d4[r], d5[r])
                c0[r], c1[r], c2[r] = y[0], y[1], y[2]
        for a in range(3):  # then G across each of the three rows
            e = cols[6 * a * rows :]
            o = out[(k0 * c + cc) * 9 + 3 * a :]
            for r in range(rows):
                y = _gt3(e[r], e[rows + r], e[2 * rows + r], e[3 * rows + r], e[4 * rows + r], e[5 * rows + r])
                at = 9 * c * r
                o[at], o[at + 1], o[at + 2] = y[0], y[1], y[2]


@njit(cache=True, nogil=True)
def _weight_block(v, m, mt, du, c, k, k0, rows, cols):
    """One block of ``_weight_k_blocks``: per ξ the block's rows of M transposed into ``mt`` (tiles × rows),
    then dUᵀ[ξ] (C × rows) = V[ξ] (C × tiles) @ Mᵀ[ξ]."""
    scalars = np.empty(2, np.float32)
    vplane, mplane = c * cols + SKEW, k * cols + SKEW
    tplane, uplane = rows * cols + SKEW, c * rows + SKEW
    for xi in range(36):
        src = m[xi * mplane + k0 * cols :]
        dst = mt[xi * tplane :]
        for r in range(rows):
            for j in range(cols):
                dst[j * rows + r] = src[r * cols + j]
        sgemm(False, False, c, rows, cols, v[xi * vplane :], cols, dst, rows, 0.0, du[xi * uplane :], rows, scalars)


def _weight_k_blocks(v, m, dw, cols, first, last, block, mine):
    """Output-channel blocks [first, last) of ``backward_weight_by_k`` on the calling thread: per block,
    its rows of M transposed (tiles × block), the 36 GEMMs dUᵀ[ξ] = V[ξ] (C × tiles) @ Mᵀ[ξ]
    (``_weight_block``), then dw of its channels = Gᵀ dU G. A Python loop over compiled pieces, as ``_rows``."""
    k, c = dw.shape[0], dw.shape[1]
    kb = min(block, k)
    mt = mine[: 36 * (kb * cols + SKEW)]
    du = mine[36 * (kb * cols + SKEW) : 36 * (kb * cols + SKEW) + 36 * (c * kb + SKEW)]
    lanes = mine[36 * (kb * cols + SKEW) + 36 * (c * kb + SKEW) :]
    for b in range(first, last):
        k0 = b * block
        rows = min(block, k - k0)
        _weight_block(v, m, mt, du, c, k, k0, rows, cols)
        _filter_backward_lanes(du, dw, k0, rows, c * rows + SKEW, lanes)


def backward_weight_by_k(x, dout, dw, threads: int, scratch, block: int = BY_K_BLOCK) -> None:
    """``backward_weight`` for small planes split by output channel (v35): the threads transform the
    whole batch, x by channel into V and dout by output channel into M, then each takes whole blocks of
    ``block`` output channels and, per block, runs the 36 GEMMs dUᵀ[ξ] = V[ξ] @ M[ξ]ᵀ with the batch's
    tiles as the inner dimension (its rows of M transposed first, so the GEMMs are plain ones of
    ≤ 10⁶ multiply-adds: OpenBLAS's small-matrix kernel; with Mᵀ read transposed they ran at half
    speed) and dw of its channels from its dU. ``by_k_weight_fits`` says when the batch's V and M are
    small enough.

    Why. ``backward_weight`` splits the 36 GEMMs by ξ: each thread writes its planes of a dU of 36·K·C
    floats (36 MiB at 512 @4×4) to memory and the filter transform reads them back; here a block's dU
    (1.2 MiB) stays in cache. The blocks are fixed by the shape and each dw element is one GEMM's dot
    products over all tiles and one thread's transform: the same bits at any thread count."""
    n, c, h, width = x.shape
    k = dw.shape[0]
    nr = n * ((h + 3) // 4)
    cols = nr * ((width + 3) // 4)
    vsize = 36 * (c * cols + SKEW)
    v = scratch[:vsize]
    m = scratch[vsize : vsize + 36 * (k * cols + SKEW)]
    start = vsize + 36 * (k * cols + SKEW)
    per_thread = _by_k_weight_per_thread(c, k, width, nr, block)
    src, dsrc = x.reshape(x.size), dout.reshape(dout.size)

    def mine(t: int):
        return scratch[start + t * per_thread : start + (t + 1) * per_thread]

    def transforms(t: int) -> None:
        buf = mine(t)
        _input_transform(src, 0, nr, c, h, width, v, buf, t * c // threads, (t + 1) * c // threads)
        _dout_transform(dsrc, 0, nr, t * k // threads, (t + 1) * k // threads, k, h, width, m, buf)

    run_shares(transforms, threads)
    blocks = -(-k // block)
    run_shares(lambda t: _weight_k_blocks(v, m, dw, cols, t * blocks // threads, (t + 1) * blocks // threads, block,
                                          mine(t)), threads)

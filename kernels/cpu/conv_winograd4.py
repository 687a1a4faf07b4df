"""3×3 stride-1 pad-1 convolution as cache-blocked Winograd F(4×4, 3×3): a study version, not in the table.

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
"""

from __future__ import annotations

import numpy as np
from numba import njit

from kernels.cpu.conv_shifted import sgemm
from kernels.cpu.threads import run_shares

SKEW = 16
"""Floats between consecutive ξ planes beyond their size (4 KiB set aliasing: ``conv_winograd.SKEW``)."""


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
    return 36 * ((c_in + c_out) * rows * tw + 2 * SKEW) + 12 * 4 * (tw + 1) + 24 * tw


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
    u[ξ][c, k] = (G w[k, c, ::-1, ::-1] Gᵀ)[ξ] for c in [lo, hi) (planes of C × K)."""
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


@njit(cache=True, nogil=True)
def _input_transform(src, r0, nr, channels, height, width, v, buf):
    """v[ξ][c][j] = (Bᵀ d B)[ξ] for every channel and the tiles j of tile rows [r0, r0 + nr)."""
    th, tw = (height + 3) // 4, (width + 3) // 4
    cols = nr * tw
    ph = tw + 1  # phase length: positions 4m + q, m ≤ tw
    row = 4 * ph
    p = buf[: 6 * row]  # the six input rows, phase-split: p[i][q][m] = d(y_i, x = 4m + q − 1)
    t = buf[6 * row : 12 * row]  # Bᵀ p
    plane = height * width
    step = channels * cols + SKEW
    zero = np.float32(0.0)
    four, five, two = np.float32(4.0), np.float32(5.0), np.float32(2.0)
    for c in range(channels):
        for r in range(nr):
            n, ty = (r0 + r) // th, (r0 + r) % th
            s0 = (n * channels + c) * plane
            for i in range(6):
                y = 4 * ty - 1 + i
                pi = p[i * row : (i + 1) * row]
                if 0 <= y < height:
                    a = s0 + y * width
                    for q in range(4):
                        for m in range(ph):
                            x = 4 * m + q - 1
                            pi[q * ph + m] = src[a + x] if 0 <= x < width else zero
                else:
                    for e in range(row):
                        pi[e] = zero
            d0, d1, d2 = p[0:row], p[row : 2 * row], p[2 * row : 3 * row]
            d3, d4, d5 = p[3 * row : 4 * row], p[4 * row : 5 * row], p[5 * row : 6 * row]
            t0, t1, t2 = t[0:row], t[row : 2 * row], t[2 * row : 3 * row]
            t3, t4, t5 = t[3 * row : 4 * row], t[4 * row : 5 * row], t[5 * row : 6 * row]
            for e in range(row):
                t0[e] = four * d0[e] - five * d2[e] + d4[e]
            for e in range(row):
                t1[e] = d3[e] + d4[e] - four * (d1[e] + d2[e])
            for e in range(row):
                t2[e] = four * (d1[e] - d2[e]) - d3[e] + d4[e]
            for e in range(row):
                t3[e] = two * (d3[e] - d1[e]) - d2[e] + d4[e]
            for e in range(row):
                t4[e] = two * (d1[e] - d3[e]) - d2[e] + d4[e]
            for e in range(row):
                t5[e] = four * d1[e] - five * d3[e] + d5[e]
            j0 = r * tw
            for i in range(6):
                ti = t[i * row : (i + 1) * row]
                e0, e1, e2, e3 = ti[0:ph], ti[ph : 2 * ph], ti[2 * ph : 3 * ph], ti[3 * ph : 4 * ph]
                b = 6 * i * step + c * cols + j0
                o0, o1, o2 = v[b : b + tw], v[b + step : b + step + tw], v[b + 2 * step : b + 2 * step + tw]
                o3, o4 = v[b + 3 * step : b + 3 * step + tw], v[b + 4 * step : b + 4 * step + tw]
                o5 = v[b + 5 * step : b + 5 * step + tw]
                # the tile's six columns: e0[tx], e1[tx], e2[tx], e3[tx], e0[tx + 1], e1[tx + 1]
                for tx in range(tw):
                    o0[tx] = four * e0[tx] - five * e2[tx] + e0[tx + 1]
                for tx in range(tw):
                    o1[tx] = e3[tx] + e0[tx + 1] - four * (e1[tx] + e2[tx])
                for tx in range(tw):
                    o2[tx] = four * (e1[tx] - e2[tx]) - e3[tx] + e0[tx + 1]
                for tx in range(tw):
                    o3[tx] = two * (e3[tx] - e1[tx]) - e2[tx] + e0[tx + 1]
                for tx in range(tw):
                    o4[tx] = two * (e1[tx] - e3[tx]) - e2[tx] + e0[tx + 1]
                for tx in range(tw):
                    o5[tx] = four * e1[tx] - five * e3[tx] + e1[tx + 1]


@njit(cache=True, nogil=True)
def _output_transform(m, r0, nr, channels, height, width, dst, buf):
    """dst[n, k, 4ty + a, 4tx + b] = (Aᵀ M A)[a, b] for the tiles of tile rows [r0, r0 + nr)."""
    th, tw = (height + 3) // 4, (width + 3) // 4
    cols = nr * tw
    stride = channels * cols + SKEW
    plane = height * width
    s = buf[: 24 * tw]  # s[a][j][tx] = Σ_i Aᵀ[a, i] M[(i, j)]
    two, four, eight = np.float32(2.0), np.float32(4.0), np.float32(8.0)
    for k in range(channels):
        for r in range(nr):
            n, ty = (r0 + r) // th, (r0 + r) % th
            b = k * cols + r * tw
            for j in range(6):
                m0, m1 = m[b + j * stride :], m[b + (6 + j) * stride :]
                m2, m3 = m[b + (12 + j) * stride :], m[b + (18 + j) * stride :]
                m4, m5 = m[b + (24 + j) * stride :], m[b + (30 + j) * stride :]
                s0, s1 = s[j * tw : (j + 1) * tw], s[(6 + j) * tw : (7 + j) * tw]
                s2, s3 = s[(12 + j) * tw : (13 + j) * tw], s[(18 + j) * tw : (19 + j) * tw]
                for tx in range(tw):
                    s0[tx] = m0[tx] + m1[tx] + m2[tx] + m3[tx] + m4[tx]
                for tx in range(tw):
                    s1[tx] = m1[tx] - m2[tx] + two * (m3[tx] - m4[tx])
                for tx in range(tw):
                    s2[tx] = m1[tx] + m2[tx] + four * (m3[tx] + m4[tx])
                for tx in range(tw):
                    s3[tx] = m1[tx] - m2[tx] + eight * (m3[tx] - m4[tx]) + m5[tx]
            o = (n * channels + k) * plane
            for a in range(4):
                y = 4 * ty + a
                if y >= height:
                    break
                sa = s[6 * a * tw : 6 * (a + 1) * tw]
                out = dst[o + y * width : o + (y + 1) * width]
                for tx in range(tw):
                    v0, v1, v2 = sa[tx], sa[tw + tx], sa[2 * tw + tx]
                    v3, v4, v5 = sa[3 * tw + tx], sa[4 * tw + tx], sa[5 * tw + tx]
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


@njit(cache=True, nogil=True)
def _rows(x, u, out, first, last, rows, mine):
    """Tile rows [first, last) on the calling thread, ``rows`` at a time: transform, 36 GEMMs, transform."""
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
    scalars = np.empty(2, np.float32)
    plane = c_in * c_out + SKEW
    for r0 in range(first, last, rows):
        nr = min(rows, last - r0)
        cols = nr * tw
        _input_transform(src, r0, nr, c_in, height, width, v, buf)
        for xi in range(36):
            sgemm(False, False, c_out, cols, c_in, u[xi * plane :], c_in, v[xi * (c_in * cols + SKEW) :], cols,
                  0.0, m[xi * (c_out * cols + SKEW) :], cols, scalars)
        _output_transform(m, r0, nr, c_out, height, width, dst, buf)


def forward(x, w, out, flipped: bool, threads: int, rows: int, scratch) -> None:
    """out = conv3×3(x, w), stride 1, pad 1, by Winograd F(4×4, 3×3) (flipped: backward-data, x = dout)."""
    n, c_in, height, width = x.shape
    c_out = out.shape[1]
    total = n * ((height + 3) // 4)
    u = scratch[: 36 * (c_in * c_out + SKEW)]
    outer = w.shape[1] if flipped else w.shape[0]
    run_shares(lambda t: _filter_transform(w, t * outer // threads, (t + 1) * outer // threads, u, flipped), threads)
    per_thread = _per_thread(c_in, c_out, width, rows)
    start = 36 * (c_in * c_out + SKEW)

    def work(t: int) -> None:
        mine = scratch[start + t * per_thread : start + (t + 1) * per_thread]
        _rows(x, u, out, t * total // threads, (t + 1) * total // threads, rows, mine)

    run_shares(work, threads)

"""3×3 stride-1 pad-1 convolution as cache-blocked Winograd F(2×2, 3×3): study versions 10 to 13 (transforms: v18).

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

    U = G g Gᵀ   (4×4 per (k, c), once per call)   G  = [[1, 0, 0], [½, ½, ½], [½, −½, ½], [0, 0, 1]]
    V = Bᵀ d B   (4×4 per (c, tile))                Bᵀ = [[1, 0, −1, 0], [0, 1, 1, 0], [0, −1, 1, 0], [0, 1, 0, −1]]
    M[ξ] = U[ξ] @ V[ξ]  for each of the 16 positions ξ: a (K × C) @ (C × tiles) GEMM
    Y = Aᵀ M A   (2×2 per (k, tile))                Aᵀ = [[1, 1, 1, 0], [0, 1, −1, −1]]

Layout and blocking. Tiles are numbered in raster order over (image, tile row, tile column);
a plane of H × W has ⌈H/2⌉ × ⌈W/2⌉ tiles (odd sizes: the last tile reads zeros past the edge and
its extra outputs are dropped). Thread ``t`` owns the tile rows ``[t·R/T, (t+1)·R/T)`` of the
R = N·⌈H/2⌉ in the batch (a fixed range: the same bits every call at a given thread count) and
walks them in blocks of ``rows`` tile rows (Tb = rows·⌈W/2⌉ tiles; a block crosses image borders,
so the 4-tile planes of 4×4 layers batch many images into one block). Per block:

1. input transform into ``V[ξ][c][j]`` (16 × C × Tb, ``j`` the tile within the block; since v18
   column-major, tile (r, tx) of the block at j = tx·nr + r): per channel, the block's input rows
   copied with even and odd columns apart, then Bᵀ down the rows and B across the columns, each
   one loop per output stream over the whole block (v10–v17 ran both per tile row: loops of
   ⌈W/2⌉ + 1 iterations, whose overhead was most of the transform's time). One thread, 16 images,
   input transform ms, v17 → v18: 512 @4×4 1.03 → 0.92, 256 @8×8 2.57 → 1.39, 128 @16×16 3.23 →
   1.76, 64 @32×32 4.54 → 3.53; the output transform at 512 @4×4 (two threads, ``parts``) 1.28 →
   0.65, the input 2.3 → 2.0, the forward 11.3 / 12.4 → 10.2 / 11.0 (two runs). The forward's bits
   do not change (a GEMM column is the same dot product wherever it sits).
2. 16 GEMMs ``M[ξ] (K × Tb) = U[ξ] (K × C) @ V[ξ] (C × Tb)`` through single-threaded BLAS
   (``conv_shifted.sgemm``: ``numba_xxgemm`` with leading dimensions).
3. output transform ``Aᵀ M[·][k][j] A`` straight into ``out``.

V and M together are 16·(C + K)·Tb floats: ``TARGET_TILES`` = 128 tiles a block, capped at
``BLOCK_BUDGET_ELEMENTS`` (4 MiB: 2 MiB of L2 per core here, the rest in the large L3). The ξ
planes are ``SKEW`` floats apart beyond their size.

Backward-data is the forward convolution of dout with w'[c, k] = w[k, c] flipped. Flipping g
gives G·J·g·J·Gᵀ with J the reversal, and G·J = P·G with P the swap of rows 0 and 3, so
U'[(i, j)] = U[(p(i), p(j))]ᵀ: the forward filter transform, read transposed by the GEMM at the
swapped position. No second filter transform, no transposing copy. Since v13 the table's
backward-data writes that transposed U' directly (``_filter_transform_flipped``, the same scalar
transform with transposed, p-swapped stores; the transform is redone every call anyway) and runs the
forward's GEMMs on it, because sgemm reading A transposed was slower on the deep layers: two
threads, batch 32, AMD EPYC, wall ms, median of 7 rounds of best-of-5, read transposed → written
transposed (the forward for scale): 512 @4×4 12.83 → 12.11 (11.29), 256 @8×8 11.04 → 10.45
(10.63), 128 @16×16 10.41 → 10.10 (10.04), 64 @32×32 10.51 → 10.57 (10.61). The two differ by
GEMM rounding only (max 2.5e-5 on outputs of ~10).

Measured (batch 32, ResNet-18's four 3×3 stride-1 layers, C = K):

- With SciPy's OpenBLAS as the sgemm (with MKL's, merged later, v9 is level with v10 at 32×32 and
  production keeps Winograd to planes ≤ 16×16: ``conv.WINOGRAD_MAX_PIXELS``, kernels/README.md).
  Two threads, wall ms, median of 5 rounds of best-of-5, v9 / v10 / torch alternating with
  ``quiesce()`` before each block (scratch script over ``conv.forward(..., conv_study.V9_PATHS)``,
  this module and ``aten.convolution`` / ``convolution_backward``; other jobs at load 1.6–3):

  | layer | forward v9 / v10 / torch | backward-data v9 / v10 / torch |
  |---|---|---|
  | 64 @32×32 | 11.41 / **8.62** / 13.62 | 11.57 / **8.66** / 14.90 |
  | 128 @16×16 | 9.85 / **7.93** / 7.78 | 10.31 / **7.87** / 7.91 |
  | 256 @8×8 | 10.70 / **7.10** / 7.18 | 11.16 / **7.19** / 7.22 |
  | 512 @4×4 | 11.60 / **9.00** / 7.61 | 11.55 / **9.90** / 6.63 |

- Where the time goes: one thread, its share of 16 images, forward, thread CPU ms, each part
  run alone (``parts``): v9 → v10 (input transform + filter transform and GEMMs + output transform):
  64 @32×32 11.70 → 8.46 (2.33 + 3.64 + 1.47); 128 @16×16 10.66 → 7.85 (1.44 + 5.04 + 0.99);
  256 @8×8 10.46 → 6.75 (1.05 + 4.66 + 0.70); 512 @4×4 10.98 → 9.51 (0.79 + 7.55 + 0.64). The
  GEMMs run at 147 / 107 / 115 / 71 GFLOP/s: at 4×4 a thread has only 64 tiles (Tb = 64), and
  the 16 MiB of transformed filter is packed for 64 columns. The filter transform (inside the
  GEMM figure) is 0.06 ms at 64 channels and 2.2 ms at 512 on one thread: scalar code (its 16
  store streams are more than LLVM's runtime alias checks allow), split over the threads by k.
- Tb (``TARGET_TILES`` × budget), one thread, 16 images, forward ms: 64 / 128 / 256 / 512 tiles
  at a 4 MiB budget: 64 @32×32 10.3 / **9.2** / 12.0 / 11.8; 128 @16×16 8.5 / **8.5** / 8.4 /
  8.3; 256 @8×8 7.9 / **7.5** / 7.5 / 7.3; 512 @4×4 9.6 / **9.2** / 9.9 / 10.2 (before the
  input-transform change): 128 is best or within 3% of it everywhere. A 1 MiB budget (V and M
  inside L2) caps 512 @4×4 at Tb = 16: GEMMs 9.9 ms instead of 7.1, layer 11.9 instead of 9.2;
  16 MiB is no better than 4.

Tried and dropped:

- Planes exactly K·C and C·Tb floats apart: the 16 store streams of the filter transform sit
  4 KiB apart, in one L1 set; 512 ch, one thread: 14.1 ms → 2.2 ms with the skew.
- Channels-last V (``V[ξ][j][c]``, the input staged in a four-row ring with channels last, the
  transforms one loop over the channels per (tile, ξ), GEMM ``M = V @ Uᵀ``): vectorizes whatever
  the plane size, but the staging transposes and the Tb × K GEMMs cost more: forward, one thread,
  16 images, 14.5 / 10.6 / 10.4 / 13.0 ms against this layout's 9.6 / 8.7 / 8.6 / 11.4 (same run).
- Bᵀ as eight one-stream loops, or the output transform as twelve: 1.4–7× slower (the loops are
  ⌈W/2⌉ long, and the split adds array slices per row); the four one-stream loops of B and
  the row loops without a per-column test stayed (input transform 3.4 → 2.3 ms at 64 @32×32).
  On the AMD EPYC those four loops lost below 16 tile columns to one scalar loop (one thread, 16
  images, input transform ms: 256 @8×8 2.57 → 1.87, 128 @16×16 3.23 → 3.05), the first hint that loop
  overhead was the cost; v18's block-wide loops (below) replaced both.
- Each thread its own positions ξ (v18's first try, patch not kept): thread t transformed the input
  for its 8 of the 16 ξ only (all channels, all of a block's tiles) and ran those 8 GEMMs with every
  tile of the batch as columns, reading half of U; the output transform split by output channel.
  Alone, with both threads running, 8 GEMMs of 512 × 512 @ 512 × 128 ran at 83–85 GFLOP/s per thread
  against 72–77 for 16 of 512 × 512 @ 512 × 64 (6.3–6.4 against 7.0–7.4 ms). But whole convolutions
  got slower (two threads, batch 32, wall ms, median of 5 rounds of best-of-5, table → by ξ): 512 @4×4
  forward 10.96 → 11.40, backward-data 11.84 → 11.94; 256 @8×8 forward 13.22 → 14.04 (F(2×2)). The
  input transform is bound by its per-(channel, tile row) overhead, not by its stores, and each thread
  now walked every tile: 2.7–3.4 ms per thread at 512 @4×4 against 2.2 for the tile split. By ξ with
  F(4×4) at 512 @4×4 (18 GEMMs of 32 columns per thread): 15.3 ms. v23 keeps the ξ split for the GEMMs
  on 4×4 planes but splits the transforms by channel (``forward_by_xi``), and that wins there (−4%).
- A vectorizable filter transform (v23 session, not kept): per output channel the nine taps first
  deinterleaved into nine contiguous rows (unsigned indexes, so LLVM gathers), then 16 one-store loops;
  the same bits. One thread, ms, 256×256 0.59 → 0.29, 256×512 1.11 → 0.71, but 512×512, the only F(2×2)
  filter of the table, 2.62 → 2.65 (and the flipped form 3.5 → 7.0: its gathers stride 9·C): at 512
  the 16 MiB of U written is the cost, not the arithmetic (the same loop on a cache-sized 64×64 filter
  runs 8.3 ns a pair, 5.9 staged). The weight gradient's ``_filter_backward`` likewise (16 MiB of dU
  read): 512×512, two threads, 1.21 → 1.96 ms staged; not kept either.

Numerics: the transforms add and subtract inputs (B, A) and halve (G, exact in binary), so the
result differs from a direct sum by rounding only: max abs error against the float64 reference
1.4–2.5e-6 on ResNet-18's layers (v9's: 1.1–2.3e-6; outputs of magnitude ~4).

The weight gradient (v11, ``backward_weight``). dw[k, c] correlates the input with dout over every
output pixel; split dout into the same 2×2 tiles, and each tile's share is F(3×3, 2×2) of the
same 4×4 input tile: ``dw = Gᵀ [Σ_tiles (A dY Aᵀ) ⊙ (Bᵀ d B)] G``, the sum inside the transformed
domain, so per ξ one GEMM ``dU[ξ] (K × C) += M[ξ] (K × Tb) @ V[ξ]ᵀ (Tb × C)`` per block. V is the
forward's input transform (``_input_transform``, here over a thread's channel range), M the
2×2 → 4×4 transform of dout (``_dout_transform``), and ``Gᵀ dU G`` (``_filter_backward``) gives
the 3×3 result once at the end. The blocks (``WEIGHT_TARGET_TILES`` = 512 tiles, V and M within
``WEIGHT_BUDGET_ELEMENTS``) do not depend on the thread count, and within a block the threads split
the transforms by channel and the GEMMs by ξ: every sum runs in the same order at any thread count
(same bits at 1, 2, 3 threads: tested). Used on planes ≤ 16×16 with ≥ 64 channels
(``conv.path``); at 64 @32×32 it was level with the shifted GEMMs (best 13.87 vs 13.98 ms).
Batch 32, two threads, wall ms, median of 9, shifted GEMMs / v11 / torch alternating (AMD Zen 4):
128 @16×16 15.4 / 13.2 / 14.0; 256 @8×8 17.6 / 13.5 / 16.0; 512 @4×4 24.9 / 11.2 / 14.9. One thread
at 512 @4×4: transforms 2.3 ms, GEMMs 7.0 ms (~77 GFLOP/s), filter back-transform 2.2 ms. Blocks of
512–4096 tiles and budgets of 4–32 MiB were within noise of each other.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
from numba import njit

from kernels.cpu.conv_shifted import gemm_list, gemm_table
from kernels.cpu.threads import run_shares

TARGET_TILES = 128
"""Tiles per block (Tb), rounded up to whole tile rows, before the cache budget below."""

BLOCK_BUDGET_ELEMENTS = 1 << 20
"""At most this many float32 (4 MiB) in a block's V and M together (swept: see above)."""

WEIGHT_TARGET_TILES = 512
"""Tiles per block of the weight gradient (its GEMMs sum over the tiles: longer is better for them)."""

WEIGHT_BUDGET_ELEMENTS = 1 << 22
"""At most this many float32 (16 MiB) in the weight gradient's block V and M together."""

SKEW = 16
"""Floats (64 bytes) between consecutive ξ planes of U, V and M beyond their size. Planes of
exactly K·C or C·Tb floats start at multiples of 4 KiB, so the 16 streams of a transform fall into
one L1 set (12 ways) and alias each other's stores."""

def block_buffers(scratch, points: int, c_in: int, c_out: int, columns: int):
    """The front of ``scratch`` as the buffers of a whole-layer Winograd call: the transformed filter
    (U, or the weight gradient's dU: ``points`` × (c_in·c_out + SKEW)), then one block's V (points ×
    (c_in·columns + SKEW)) and M (points × (c_out·columns + SKEW)). Returns (filter, v, m, end): the
    threads' own buffers start at ``end``. One layout for ``forward_by_xi``, both weight gradients
    and the study's ξ split."""
    filt = points * (c_in * c_out + SKEW)
    v_end = filt + points * (c_in * columns + SKEW)
    m_end = v_end + points * (c_out * columns + SKEW)
    return scratch[:filt], scratch[filt:v_end], scratch[v_end:m_end], m_end



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
    """Scratch (float32 elements): the transformed filter U (16·K·C), and per thread a block's V and M
    and the transforms' row buffers."""
    k, c = w_shape[0], w_shape[1]
    c_in, c_out = (k, c) if direction == "data" else (c, k)
    rows = block_rows(x_shape, c_in, c_out, threads, target_tiles)
    return 16 * (k * c + SKEW) + threads * _per_thread(c_in, c_out, x_shape[3], rows)


def _per_thread(c_in: int, c_out: int, width: int, rows: int) -> int:
    """A thread's scratch: a block's V and M, and the transforms' row buffers."""
    tw = (width + 1) // 2
    return 16 * ((c_in + c_out) * rows * tw + 2 * SKEW) + _buffer(width, rows)


def _buffer(width: int, rows: int) -> int:
    """The transforms' buffer for blocks of ``rows`` tile rows: the input's phase-split rows and Bᵀ of
    them (16·(tw + 1)·rows floats), more than the output transform's 8·tw·rows."""
    return 16 * ((width + 1) // 2 + 1) * rows


@njit(cache=True, nogil=True, inline="always")
def _g_row(u, at, plane, x0, x1, x2, half):
    """One row of (G g) times Gᵀ: x0, ½(x0 + x1 + x2), ½(x0 − x1 + x2), x2 into four planes from ``at``."""
    u[at] = x0
    u[plane + at] = half * (x0 + x1 + x2)
    u[2 * plane + at] = half * (x0 - x1 + x2)
    u[3 * plane + at] = x2


@njit(cache=True, nogil=True)
def _filter_transform(w, k_lo, k_hi, u):
    """u[ξ][k, c] = (G w[k, c] Gᵀ)[ξ] for k in [k_lo, k_hi): 16 planes of K × C, each contiguous.

    Scalars only, so the loop over c vectorizes (nine stride-9 gathers, sixteen contiguous stores)."""
    k, c = w.shape[0], w.shape[1]
    plane = k * c + SKEW
    g = w.reshape(w.size)
    half = np.float32(0.5)
    for kk in range(k_lo, k_hi):
        for cc in range(c):
            at = kk * c + cc
            s = 9 * at
            w00, w01, w02 = g[s], g[s + 1], g[s + 2]
            w10, w11, w12 = g[s + 3], g[s + 4], g[s + 5]
            w20, w21, w22 = g[s + 6], g[s + 7], g[s + 8]
            # G g: rows g0, ½(g0 + g1 + g2), ½(g0 − g1 + g2), g2
            b0, b1, b2 = half * (w00 + w10 + w20), half * (w01 + w11 + w21), half * (w02 + w12 + w22)
            c0, c1, c2 = half * (w00 - w10 + w20), half * (w01 - w11 + w21), half * (w02 - w12 + w22)
            # (G g) Gᵀ: the same transform across each of the four rows
            _g_row(u, at, plane, w00, w01, w02, half)
            _g_row(u, 4 * plane + at, plane, b0, b1, b2, half)
            _g_row(u, 8 * plane + at, plane, c0, c1, c2, half)
            _g_row(u, 12 * plane + at, plane, w20, w21, w22, half)


@njit(cache=True, nogil=True, inline="always")
def _g_row_swapped(u, at, plane, x0, x1, x2, half):
    """``_g_row`` with the four planes in p order (p swapping 0 and 3)."""
    u[3 * plane + at] = x0
    u[plane + at] = half * (x0 + x1 + x2)
    u[2 * plane + at] = half * (x0 - x1 + x2)
    u[at] = x2


@njit(cache=True, nogil=True)
def _filter_transform_flipped(w, c_lo, c_hi, u):
    """u[ξ][c, k] = U'[ξ] = U[(p(i), p(j))]ᵀ for c in [c_lo, c_hi): the backward-data filter transform
    written out transposed (16 planes of C × K), so its GEMMs read it as the forward reads U (v13)."""
    k, c = w.shape[0], w.shape[1]
    plane = k * c + SKEW
    g = w.reshape(w.size)
    half = np.float32(0.5)
    for cc in range(c_lo, c_hi):
        for kk in range(k):
            at = cc * k + kk
            s = 9 * (kk * c + cc)
            w00, w01, w02 = g[s], g[s + 1], g[s + 2]
            w10, w11, w12 = g[s + 3], g[s + 4], g[s + 5]
            w20, w21, w22 = g[s + 6], g[s + 7], g[s + 8]
            b0, b1, b2 = half * (w00 + w10 + w20), half * (w01 + w11 + w21), half * (w02 + w12 + w22)
            c0, c1, c2 = half * (w00 - w10 + w20), half * (w01 - w11 + w21), half * (w02 - w12 + w22)
            _g_row_swapped(u, 12 * plane + at, plane, w00, w01, w02, half)  # row 0 of U goes to row p(0) = 3
            _g_row_swapped(u, 4 * plane + at, plane, b0, b1, b2, half)
            _g_row_swapped(u, 8 * plane + at, plane, c0, c1, c2, half)
            _g_row_swapped(u, at, plane, w20, w21, w22, half)


@njit(cache=True, nogil=True, inline="always")
def _split(dst, row, count, nr):
    """dst[m·nr] = row[2m] for m < ``count``: one phase of an input row into a block's column-major rows.

    Views from the first element and no test per column (the edges are set apart by the caller): the input
    transform's phase split took 5.3 of its 7.3 ms (64 @56×56, one thread, 16 images) as a loop over every column
    with an edge test. Same values. One thread, 16 images, the transform, ms, median of 5 alternating rounds:
    64 @56×56 7.02 → 5.83, 128 @28×28 4.49 → 3.79, 64 @32×32 2.11 → 1.96, 256 @14×14 2.34 → 2.39."""
    for m in range(count):
        dst[m * nr] = row[2 * m]


@njit(cache=True, nogil=True)
def _input_transform(src, r0, nr, c_lo, c_hi, channels, height, width, v, tmp):
    """v[ξ][c][j] = (Bᵀ d B)[ξ] for the channels [c_lo, c_hi) and the tiles of tile rows [r0, r0 + nr),
    read from src (flat NCHW; the forward passes all channels, the weight gradient a thread's range);
    tile (r, tx) at column j = tx·nr + r (column-major within the block, v18).

    Per channel, the four input rows of each of the block's tile rows are copied split into their
    even and odd columns, p[a][ev][m·nr + r] = d(2ty − 1 + a, 2m − 1), p[a][od][m·nr + r] = d(·, 2m)
    (zero outside the plane); then Bᵀ down the rows is four loops over the whole block, and B across
    the columns, where tile tx needs ev[tx], od[tx], ev[tx + 1], od[tx + 1], i.e. the same arrays at j
    and j + nr, sixteen loops of tw·nr. Up to v17 both passes ran per tile row (loops of ⌈W/2⌉ + 1
    iterations; ``_rows_bt``): their overhead, not the arithmetic, was the transform's cost."""
    th, tw = (height + 1) // 2, (width + 1) // 2
    cols = nr * tw
    half = tw + 1
    span = half * nr  # one phase (even or odd columns) of one input row over the block
    row = 2 * span
    p = tmp[: 4 * row]
    t = tmp[4 * row : 8 * row]  # Bᵀ p
    plane = height * width
    step = channels * cols + SKEW
    zero = np.float32(0.0)
    for c in range(c_lo, c_hi):
        for r in range(nr):
            n, ty = (r0 + r) // th, (r0 + r) % th
            s0 = (n * channels + c) * plane
            for a in range(4):
                y = 2 * ty - 1 + a
                pe, po = p[a * row + r :], p[a * row + span + r :]
                if 0 <= y < height:
                    b = s0 + y * width
                    pe[0] = zero  # x = −1
                    _split(pe[nr:], src[b + 1 :], width // 2, nr)  # x = 2m − 1 for m = 1 … ⌊W/2⌋
                    _split(po, src[b:], half - 1, nr)  # x = 2m for m < ⌈W/2⌉ = half − 1
                    if width % 2 == 1:  # the last even-phase column lies past the edge
                        pe[(half - 1) * nr] = zero
                    po[(half - 1) * nr] = zero  # x = 2·tw ≥ width
                else:
                    for m in range(half):
                        pe[m * nr] = zero
                        po[m * nr] = zero
        d0, d1, d2, d3 = p[0:row], p[row : 2 * row], p[2 * row : 3 * row], p[3 * row : 4 * row]
        t0, t1, t2, t3 = t[0:row], t[row : 2 * row], t[2 * row : 3 * row], t[3 * row : 4 * row]
        for e in range(row):
            t0[e] = d0[e] - d2[e]
        for e in range(row):
            t1[e] = d1[e] + d2[e]
        for e in range(row):
            t2[e] = d2[e] - d1[e]
        for e in range(row):
            t3[e] = d1[e] - d3[e]
        # B, with t0…t3 the tile's columns ev[tx], od[tx], ev[tx + 1], od[tx + 1]: t0 − t2, t1 + t2, t2 − t1, t1 − t3
        for i in range(4):
            ti = t[i * row : (i + 1) * row]
            e0, o0 = ti[0:cols], ti[span : span + cols]
            e1, o1 = ti[nr : nr + cols], ti[span + nr : span + nr + cols]
            b = 4 * i * step + c * cols
            w0, w1 = v[b : b + cols], v[b + step : b + step + cols]
            w2, w3 = v[b + 2 * step : b + 2 * step + cols], v[b + 3 * step : b + 3 * step + cols]
            for j in range(cols):
                w0[j] = e0[j] - e1[j]
            for j in range(cols):
                w1[j] = o0[j] + e1[j]
            for j in range(cols):
                w2[j] = e1[j] - o0[j]
            for j in range(cols):
                w3[j] = o0[j] - o1[j]


@njit(cache=True, nogil=True)
def _output_transform(m, r0, nr, channels, height, width, dst, tmp, k_lo=0, k_hi=-1):
    """dst[n, k, 2ty + a, 2tx + b] = (Aᵀ M A)[a, b] for the tiles of tile rows [r0, r0 + nr) (tile (r, tx)
    at column tx·nr + r of M, as ``_input_transform`` wrote V) and the channels [k_lo, k_hi), all by
    default.

    Per channel: Aᵀ down each tile's four rows, eight loops over the whole block (s[a][j'] = row a of
    Aᵀ M, column j'), then A across the columns of each tile into ``dst``'s two image rows (the last
    column and row dropped where the plane is odd)."""
    th, tw = (height + 1) // 2, (width + 1) // 2
    cols = nr * tw
    stride = channels * cols + SKEW
    plane = height * width
    s = tmp[: 8 * cols]
    full = width // 2
    for k in range(k_lo, channels if k_hi < 0 else k_hi):
        b = k * cols
        for jj in range(4):
            at = b + jj * stride
            m0, m1 = m[at : at + cols], m[at + 4 * stride : at + 4 * stride + cols]
            m2, m3 = m[at + 8 * stride : at + 8 * stride + cols], m[at + 12 * stride : at + 12 * stride + cols]
            s0, s1 = s[jj * cols : (jj + 1) * cols], s[(4 + jj) * cols : (5 + jj) * cols]
            for e in range(cols):  # Aᵀ on rows: s0 = M0 + M1 + M2, s1 = M1 − M2 − M3
                s0[e] = m0[e] + m1[e] + m2[e]
            for e in range(cols):
                s1[e] = m1[e] - m2[e] - m3[e]
        for r in range(nr):
            n, ty = (r0 + r) // th, (r0 + r) % th
            o = (n * channels + k) * plane + 2 * ty * width
            second = 2 * ty + 1 < height
            for tx in range(tw):
                at = tx * nr + r
                s00, s01, s02, s03 = s[at], s[cols + at], s[2 * cols + at], s[3 * cols + at]
                x = 2 * tx
                dst[o + x] = s00 + s01 + s02
                if tx < full:
                    dst[o + x + 1] = s01 - s02 - s03
                if second:
                    s10, s11, s12, s13 = s[4 * cols + at], s[5 * cols + at], s[6 * cols + at], s[7 * cols + at]
                    dst[o + width + x] = s10 + s11 + s12
                    if tx < full:
                        dst[o + width + x + 1] = s11 - s12 - s13


@lru_cache(maxsize=512)
def _gemms(flipped, c_in, c_out, cols, xi_lo=0, xi_hi=16) -> np.ndarray:
    """The ``gemm_list`` table of a block's GEMMs M[ξ] (K × cols) = U[ξ] (K × C) @ V[ξ] (C × cols) for ξ in [xi_lo,
    xi_hi) (all 16 by default; ``forward_by_xi`` gives each thread its half); flipped (backward-data): U read
    transposed at the swapped position, U'[(i, j)] = U[(p(i), p(j))]ᵀ, p swapping 0 and 3."""
    plane = c_in * c_out + SKEW

    def at(xi: int) -> int:
        if not flipped:
            return xi
        i, j = xi // 4, xi % 4
        return 4 * (3 - i if i == 0 or i == 3 else i) + (3 - j if j == 0 or j == 3 else j)

    return gemm_table(
        (flipped, False, c_out, cols, c_in, at(xi) * plane, c_out if flipped else c_in, xi * (c_in * cols + SKEW), cols,
         0, xi * (c_out * cols + SKEW), cols)
        for xi in range(xi_lo, xi_hi)
    )


def _rows(x, u, out, flipped, first, last, rows, mine, parts):
    """Tile rows [first, last) on the calling thread, ``rows`` at a time: transform, 16 GEMMs, transform.

    ``parts`` (bits 1, 2, 4: input transform, GEMMs, output transform) is 7 except when the study
    times the parts one at a time. A Python loop over compiled pieces (``conv.py``'s module docstring,
    "Compiled pieces, Python drivers"): compiled, it compiled both transforms again (1.0 s of a cold first run)."""
    c_in, height, width = x.shape[1], x.shape[2], x.shape[3]
    c_out = out.shape[1]
    tw = (width + 1) // 2
    tb = rows * tw
    src, dst = x.reshape(x.size), out.reshape(out.size)
    v = mine[: 16 * (c_in * tb + SKEW)]
    m = mine[16 * (c_in * tb + SKEW) : 16 * ((c_in + c_out) * tb + 2 * SKEW)]
    tmp = mine[16 * ((c_in + c_out) * tb + 2 * SKEW) :]
    for r0 in range(first, last, rows):
        nr = min(rows, last - r0)
        cols = nr * tw
        if parts & 1:
            _input_transform(src, r0, nr, 0, c_in, c_in, height, width, v, tmp)
        if parts & 2:
            gemm_list(u, v, m, _gemms(flipped, c_in, c_out, cols))
        if parts & 4:
            _output_transform(m, r0, nr, c_out, height, width, dst, tmp, 0, c_out)


def forward(x, w, out, flipped: bool, threads: int, rows: int, scratch, parts: int = 7,
            transposed: bool = False) -> None:
    """out = conv3×3(x, w), stride 1, pad 1, by Winograd F(2×2, 3×3) (flipped: backward-data, x = dout).

    ``transposed`` (backward-data only, v13): write the flipped filter's transform out transposed
    (``_filter_transform_flipped``) and run the forward's GEMMs on it, instead of reading U transposed."""
    n, c_in, height, _ = x.shape
    c_out = out.shape[1]
    total = n * ((height + 1) // 2)
    u = scratch[: 16 * (c_in * c_out + SKEW)]
    k = w.shape[0]
    if flipped and transposed:
        c = w.shape[1]
        if parts & 2:
            run_shares(lambda t: _filter_transform_flipped(w, t * c // threads, (t + 1) * c // threads, u), threads)
        flipped = False
    elif parts & 2:
        run_shares(lambda t: _filter_transform(w, t * k // threads, (t + 1) * k // threads, u), threads)
    per_thread = _per_thread(c_in, c_out, x.shape[3], rows)
    start = 16 * (c_in * c_out + SKEW)

    def work(t: int) -> None:
        mine = scratch[start + t * per_thread : start + (t + 1) * per_thread]
        _rows(x, u, out, flipped, t * total // threads, (t + 1) * total // threads, rows, mine, parts)

    run_shares(work, threads)


def forward_gemms(u, v, m, xi_lo, xi_hi, c_out, c_in, cols):
    """m[ξ] (K × cols) = u[ξ] (K × C) @ v[ξ] (C × cols) for ξ in [xi_lo, xi_hi) (``forward_by_xi``)."""
    gemm_list(u, v, m, _gemms(False, c_in, c_out, cols, xi_lo, xi_hi))


def by_xi_block_rows(x_shape, c_in: int, c_out: int) -> int:
    """Tile rows per block of ``forward_by_xi``: the weight gradient's blocks (512 tiles within 16 MiB
    of V and M), independent of the thread count; at 512 @4×4, batch 32, the whole batch."""
    return weight_block_rows(x_shape, c_in, c_out)


def by_xi_workspace_size(x_shape, w_shape, direction: str, threads: int) -> int:
    """Scratch of ``forward_by_xi``: U, one block's V and M, per thread a transform buffer."""
    k, c = w_shape[0], w_shape[1]
    c_in, c_out = (k, c) if direction == "data" else (c, k)
    rows = by_xi_block_rows(x_shape, c_in, c_out)
    return weight_workspace_size(x_shape, (c_out, c_in), threads, rows)


def forward_by_xi(x, w, out, flipped: bool, threads: int, rows: int, scratch) -> None:
    """``forward`` (with ``transposed``) split by Winograd position across the threads (v23), for the
    4×4 planes: per block, the threads transform the input by channel, then each runs the GEMMs of its
    ξ with all of the block's tiles as columns, then the output transform by output channel.

    Why. At 512 @4×4 the transformed filter U is 16 MiB, and with the tile split of ``forward`` each
    thread's GEMMs read all of it for its 64 tiles: two threads, batch 32, the filter transform and
    the GEMMs took 10.8 ms (the filter transform 1.2 of it; one thread on all 32 images: 16.7, 2.4),
    i.e. ~56 GFLOP/s per thread with both running against ~75 alone: the two threads stream 32 MiB of
    U between them. By ξ each thread reads its half of U once, for 128 columns. v18's first try at a
    ξ split (the module docstring, "Tried and dropped") had each thread transform every tile for its
    own ξ and lost on that transform; the split by channel here gives each thread half of the
    transform's (channel, tile row) passes, as the weight gradient's transforms are split.
    The blocks do not depend on the thread count, and every output element is one GEMM column's
    dot product and one thread's transform: the same bits at any thread count."""
    n, c_in, height, width = x.shape
    c_out = out.shape[1]
    tw = (width + 1) // 2
    total = n * ((height + 1) // 2)
    u, v, m, at = block_buffers(scratch, 16, c_in, c_out, rows * tw)
    per_thread = _buffer(width, rows)
    src, dst = x.reshape(x.size), out.reshape(out.size)

    def inputs(t: int, r0: int, nr: int) -> None:
        tmp = scratch[at + t * per_thread : at + (t + 1) * per_thread]
        _input_transform(src, r0, nr, t * c_in // threads, (t + 1) * c_in // threads, c_in, height, width, v, tmp)

    def first(t: int, nr: int) -> None:  # the first block's input transform, then the filter's
        inputs(t, 0, nr)
        if flipped:
            _filter_transform_flipped(w, t * c_out // threads, (t + 1) * c_out // threads, u)
        else:
            _filter_transform(w, t * c_out // threads, (t + 1) * c_out // threads, u)

    def outputs(t: int, r0: int, nr: int) -> None:
        tmp = scratch[at + t * per_thread : at + (t + 1) * per_thread]
        _output_transform(m, r0, nr, c_out, height, width, dst, tmp, t * c_out // threads,
                          (t + 1) * c_out // threads)

    for r0 in range(0, total, rows):
        nr = min(rows, total - r0)
        if r0 == 0:
            run_shares(lambda t, nr=nr: first(t, nr), threads)
        else:
            run_shares(lambda t, r0=r0, nr=nr: inputs(t, r0, nr), threads)
        run_shares(lambda t, nr=nr: forward_gemms(
            u, v, m, t * 16 // threads, (t + 1) * 16 // threads, c_out, c_in, nr * tw), threads)
        run_shares(lambda t, r0=r0, nr=nr: outputs(t, r0, nr), threads)


# ----------------------------------------------------------------------------------------------
# The weight gradient (study version 11)
# ----------------------------------------------------------------------------------------------


def weight_block_rows(x_shape, c_in: int, c_out: int, target_tiles: int = WEIGHT_TARGET_TILES,
                      budget: int = WEIGHT_BUDGET_ELEMENTS) -> int:
    """Tile rows per block of the weight gradient: ``target_tiles`` tiles within ``budget`` floats of V
    and M, ≤ the batch. Independent of the thread count (the blocks fix the order of the sums)."""
    n, _, h, w = x_shape
    tw = (w + 1) // 2
    total = n * ((h + 1) // 2)
    wanted = -(-target_tiles // tw)
    fits = max(1, budget // (16 * (c_in + c_out) * tw))
    return max(1, min(total, wanted, fits))


def weight_workspace_size(x_shape, w_shape, threads: int, rows: int) -> int:
    """Scratch of the weight gradient: dU (16·K·C), one block's V and M, per thread a row buffer."""
    k, c = w_shape[0], w_shape[1]
    tw = (x_shape[3] + 1) // 2
    return 16 * (k * c + SKEW) + 16 * ((c + k) * rows * tw + 2 * SKEW) + threads * _buffer(x_shape[3], rows)


@njit(cache=True, nogil=True, inline="always")
def _a_row(m, at, step, a, b):
    """One row (a, b) of A dY times Aᵀ: a, a + b, a − b, −b into four planes from ``at``."""
    m[at] = a
    m[at + step] = a + b
    m[at + 2 * step] = a - b
    m[at + 3 * step] = -b


@njit(cache=True, nogil=True)
def _dout_transform(src, r0, nr, k_lo, k_hi, channels, height, width, m):
    """m[ξ][k][j] = (A dY Aᵀ)[ξ] for the channels [k_lo, k_hi) and the tiles j of tile rows
    [r0, r0 + nr) of dY (flat NCHW, the output plane = the input plane); zeros past an odd edge.

    A dY has rows y0, y0 + y1, y0 − y1, −y1 (y0, y1 the tile's two output rows); Aᵀ does the
    same across the columns. Scalar code: 4 loads and 16 stores per tile, a tenth of the GEMMs."""
    th, tw = (height + 1) // 2, (width + 1) // 2
    cols = nr * tw
    step = channels * cols + SKEW
    plane = height * width
    zero = np.float32(0.0)
    full = width // 2
    for k in range(k_lo, k_hi):
        for r in range(nr):
            n, ty = (r0 + r) // th, (r0 + r) % th
            s = (n * channels + k) * plane + 2 * ty * width
            second = 2 * ty + 1 < height
            b = k * cols + r  # tile (r, tx) at column tx·nr + r, as the input transform writes V
            for tx in range(tw):
                x = 2 * tx
                a0 = src[s + x]
                b0 = src[s + x + 1] if tx < full else zero
                a1, b1 = zero, zero
                if second:
                    a1 = src[s + width + x]
                    b1 = src[s + width + x + 1] if tx < full else zero
                at = b + tx * nr
                _a_row(m, at, step, a0, b0)
                _a_row(m, at + 4 * step, step, a0 + a1, b0 + b1)
                _a_row(m, at + 8 * step, step, a0 - a1, b0 - b1)
                _a_row(m, at + 12 * step, step, -a1, -b1)


def weight_gemms(m, v, du, xi_lo, xi_hi, c_out, c_in, cols, beta):
    """du[ξ] (K × C) = β·du[ξ] + m[ξ] (K × cols) @ v[ξ]ᵀ (cols × C) for ξ in [xi_lo, xi_hi): the weight
    gradient's GEMMs of F(2×2) (16 planes) and F(4×4) (36, ``conv_winograd4``), planes ``SKEW`` apart."""
    gemm_list(m, v, du, _weight_gemms(xi_lo, xi_hi, c_out, c_in, cols, beta != 0))


@lru_cache(maxsize=512)
def _weight_gemms(xi_lo, xi_hi, c_out, c_in, cols, beta) -> np.ndarray:
    plane = c_out * c_in + SKEW
    return gemm_table(
        (False, True, c_out, c_in, cols, xi * (c_out * cols + SKEW), cols, xi * (c_in * cols + SKEW), cols, beta,
         xi * plane, c_in)
        for xi in range(xi_lo, xi_hi)
    )


@njit(cache=True, nogil=True, inline="always")
def _gt(x0, x1, x2, x3, half):
    """Gᵀ applied to four values: x0 + ½(x1 + x2), ½(x1 − x2), ½(x1 + x2) + x3."""
    s = half * (x1 + x2)
    return x0 + s, half * (x1 - x2), s + x3


@njit(cache=True, nogil=True)
def _filter_backward(du, dw, k_lo, k_hi):
    """dw[k, c] = Gᵀ du[·][k, c] G for k in [k_lo, k_hi): 16 contiguous read streams, 9 floats out."""
    k, c = dw.shape[0], dw.shape[1]
    plane = k * c + SKEW
    out = dw.reshape(dw.size)
    half = np.float32(0.5)
    for kk in range(k_lo, k_hi):
        for cc in range(c):
            at = kk * c + cc
            # Gᵀ down each of the four columns j: rows 0…3 of dU are planes 4i + j
            a0, a1, a2 = _gt(du[at], du[4 * plane + at], du[8 * plane + at], du[12 * plane + at], half)
            b0, b1, b2 = _gt(du[plane + at], du[5 * plane + at], du[9 * plane + at], du[13 * plane + at], half)
            c0, c1, c2 = _gt(du[2 * plane + at], du[6 * plane + at], du[10 * plane + at], du[14 * plane + at], half)
            d0, d1, d2 = _gt(du[3 * plane + at], du[7 * plane + at], du[11 * plane + at], du[15 * plane + at], half)
            # then G across each of the three rows
            o = 9 * at
            out[o], out[o + 1], out[o + 2] = _gt(a0, b0, c0, d0, half)
            out[o + 3], out[o + 4], out[o + 5] = _gt(a1, b1, c1, d1, half)
            out[o + 6], out[o + 7], out[o + 8] = _gt(a2, b2, c2, d2, half)


def backward_weight(x, dout, dw, threads: int, rows: int, scratch) -> None:
    """dw = ∂L/∂w of a 3×3 stride-1 pad-1 convolution by Winograd F(2×2, 3×3) (module docstring, "The
    weight gradient"): per block of ``rows`` tile rows, the threads transform x (by channel) and dout
    (by output channel), then run the 16 GEMMs dU[ξ] += M[ξ] V[ξ]ᵀ (by ξ); last, dw = Gᵀ dU G (by k)."""
    n, c, h, width = x.shape
    k = dw.shape[0]
    tw = (width + 1) // 2
    total = n * ((h + 1) // 2)
    du, v, m, at = block_buffers(scratch, 16, c, k, rows * tw)
    per_thread = _buffer(width, rows)
    src, dsrc = x.reshape(x.size), dout.reshape(dout.size)

    def transforms(t: int, r0: int, nr: int) -> None:
        tmp = scratch[at + t * per_thread : at + (t + 1) * per_thread]
        _input_transform(src, r0, nr, t * c // threads, (t + 1) * c // threads, c, h, width, v, tmp)
        _dout_transform(dsrc, r0, nr, t * k // threads, (t + 1) * k // threads, k, h, width, m)

    for r0 in range(0, total, rows):
        nr = min(rows, total - r0)
        beta = 0.0 if r0 == 0 else 1.0
        run_shares(lambda t, r0=r0, nr=nr: transforms(t, r0, nr), threads)
        run_shares(lambda t, nr=nr, beta=beta: weight_gemms(
            m, v, du, t * 16 // threads, (t + 1) * 16 // threads, k, c, nr * tw, beta), threads)
    run_shares(lambda t: _filter_backward(du, dw, t * k // threads, (t + 1) * k // threads), threads)

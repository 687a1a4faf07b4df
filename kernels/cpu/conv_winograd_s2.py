"""3×3 stride-2 pad-1 convolution by a polyphase Winograd transform: the forward v28 (``conv.Paths.winograd_s2``),
backward-data and the weight gradient v32 (``conv.Paths.winograd_s2_backward``, its section at the end).

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

Layout, blocks and threads (v28). Tiles in raster order over (image, tile row, tile column): block
column j = i·T + ty·tw + tx for image n0 + i of a block of whole images (T = tiles per image); thread
``t`` owns the images ``[t·N/T, (t+1)·N/T)`` and walks them in blocks of ``block_images`` images
(``TARGET_TILES`` tiles within ``BLOCK_BUDGET_ELEMENTS``); per block the input transform into V, the 16
GEMMs (``conv_shifted.sgemm``, single-threaded BLAS), the output transform straight into ``out``. The
filter transform is split over the threads by output channel, before. On 8×8 inputs (``by_channel``)
thread ``t`` owns output channels instead: it transforms its rows of U, then every image in blocks of
``BY_CHANNEL_TARGET_TILES`` tiles, multiplying by its rows of U only. Each output element is one GEMM column's
dot products and one thread's output transform: the same bits for the same thread count (tested at 1, 2
and 3).

Both transforms run as flat loops over a whole block of tiles, which LLVM vectorizes, instead of tile by
tile. Input: per channel, the five row positions of every tile row (e0 = row 4ty, e1 = row 4ty + 2,
m1 = row 4ty − 1 − row 4ty + 1, m2 = row 4ty + 1, m3 = row 4ty + 3 − row 4ty + 1) are copied as runs of W
into five arrays p[ra][(i·th + ty)·W + x]; since (i·th + ty)·W + 4tx = 4j, column j's five inputs are
then p[ra][4j − 1 … 4j + 3], and the columns' transform is one loop over the block per row position that
reads the whole interleave group 4j … 4j + 3 (wide loads and ``vpermt2ps`` shuffles), with d0 (the
previous column's d4, zero at tx = 0) in a second, contiguous loop. Output: per channel, A across the
columns is one loop over the block per row position into z[ra][2j + b] (an interleaved store), then Aᵀ
down the rows is runs of OW = 2tw straight into ``dst``. Planes must be multiples of 4 (every stride-2
3×3 layer of ResNet-18); the input tile then only crosses the top and left edges (the padding).

Measured (AMD EPYC Zen 4, OpenBLAS). One thread, 16 images, ms, each part alone (filter transform, input
transform, output transform), v26's module → v28: 64→128 @32×32 0.06 / 1.23 / 0.88 → 0.06 / 0.46–0.52 /
0.39; 128→256 @16×16 0.24 / 0.66 / 0.51 → 0.24 / 0.26 / 0.24; 256→512 @8×8 1.05 / 0.47 / 0.31 → 1.05 /
0.20 / 0.19. The 16 GEMMs are unchanged (~4.5–5.4 ms of a thread's 16 images at 64→128 and 128→256).
Whole convolutions, two threads, batch 32, wall ms, median of 5 alternating rounds of best-of-7 in one
process (``quiesce`` before each block), the table (im2col, v26) / v26's module / v28, one sitting: 64→128
@32×32 8.21 / 7.59 / **6.52**; 128→256 @16×16 7.27 / 6.45 / **6.10**; 256→512 @8×8 (split by channel, below)
6.93 / — / **6.33**.
``conv.WINOGRAD_S2_MIN_PIXELS`` has the records against PyTorch and the cold compile.
Max abs error against a float64 reference, relative to the largest output: ≤ 3.4e-7.

Tried and dropped:

- v26's version of this module (the same transform and GEMMs; tiles column-major within a block of tile
  rows, j = tx·nr + r, the input's phase split as 5·(W + 1) scalar copies per tile row, the output's Aᵀ
  one tile at a time): the part times above. Before it, one tile at a time (25 scalar loads, 25 scalar
  stores) in both transforms: input 1.23–1.31 ms, output 1.50 ms at 64→128.
- v28's loops over one plane at a time (the same loops with T instead of a block's columns): the 8×8
  planes' 4 tiles are shorter than one 16-lane vector, so they ran scalar (input 0.63, output 0.51 ms at
  256→512 against 0.20 and 0.19 over a block).
- The interleaved reads as single strided loads (one loop per V row, reading 2 of the 4 members of the
  group): LLVM made them ``vgatherqps`` gathers, input 1.05 ms at 64→128 against 0.46–0.52.
- The transforms on flat ``uint64`` offsets into the scratch instead of one slice per stream: input 0.73,
  output 1.19 ms at 64→128 (against 0.50, 0.39: a store and its loads in one array defeat the vectorizer's
  alias checks), and no cheaper to compile.
- The filter transform copying w[k] tap-major first, then 16 contiguous loops over C: 1.13 ms against
  1.05 at 256→512 (it writes an 8 MiB U and is bound by memory, not by its scalar loop), and 1.9 s more
  cold compile (``ug[:] = t`` slice assignments pull in Numba's shape-error formatting).
- 256→512 @8×8 split by images like the larger planes (a thread's 64 tiles after a U shared by both): level
  with im2col (two threads, ms, im2col / tiles: 7.38 / 7.47, 6.85 / 6.74). Its 16 GEMMs ran at ~77 GFLOP/s
  (one thread, 16 distinct U and V, M 512 × K 256 × 64 columns) where the same GEMM repeated on one U and V
  (both in cache) runs at 98.5: the 8 MiB U, written by the filter transform and read by both threads, is what
  costs, not the GEMM's shape (64 × 512 instead of 512 × 64: 86.8). Hence the split by output channel on 8×8
  inputs (``by_channel``): each thread writes and reads only its half of U, in one parallel region, for every
  thread transforming every image's input (0.2 ms per 16 images). Two threads, batch 32, ms, median of 5–7
  alternating rounds of best-of-7, im2col / by channel in blocks of 4, 8, 16, 27 images: 6.85 / 6.25 (16);
  7.16 / 7.05, 6.50, 6.99, 7.66; 6.93 / 6.33 (8), 6.54 (16). 16×16 inputs keep the image split (5.66 against
  5.80–6.09 by channel).
- v26's notes: blocks of 64 or 256 tiles instead of 128, and the threads sharing each block (by channel and
  position group, three barriers per block) did not pay.

**v32: backward-data and the weight gradient** (``conv.Paths.winograd_s2_backward``). Until v30 both ran on im2col,
and three of their records were below 0.9× PyTorch (issue 13: weight 64→128 0.79–0.84, 128→256 0.86–0.91, data
128→256 0.73–0.87, 256→512 0.78–0.96 in this session's runs). Where the time went, one thread, 16 images, ms: the
im2col weight gradient of 64→128 is 1.37 of im2col (per image) and 6.26 of GEMM (``dW (128 × 576) += dout_n @
cols_nᵀ``, 97 GFLOP/s); cut into OpenBLAS small-kernel blocks (32 × 36 of dW, idea (b) of the issue) the GEMM
took 5.97 (−5%); backward-data's ``dcols = Wᵀ dout`` 6.22, in row blocks of ≤ 10⁶ multiply-adds 5.49, and col2im
1.68. Every one of the three layers is 1.21 GFLOP per call, ~6 ms of GEMM at ~100 GFLOP/s on two threads, about
torch's whole time: no blocking of the im2col GEMM reaches 0.9× with room. So both directions take the same
transform as the forward, transposed, for the same 25 instead of 36 multiplies per tile:

- backward-data (``backward_data``): dM = A dout Aᵀ per 2×2 gradient tile (``_dout_transform``: per dimension
  (y0, y1) → (e0, e1, m1, m2, m3) = (y0, y1, y0, y0 + y1, y1), copies and one add, tiles do not overlap), the 16
  GEMMs dV[g] (C × L) = U[g]ᵀ dM[g] on the forward's U read transposed (the same filter transform), and dx = B dV
  Bᵀ (``_scatter_transform``: per dimension the tile's inputs 4tx − 1 … 4tx + 3 get (m1, e0, −m1 + m2 − m3, e1,
  m3); the overlapping column 4tx − 1 is summed with the previous tile's m3 in the transform, so every dx element is
  written once, no scatter-add). U is built by all threads first, then the images go in chunks
  (``threads.run_chunks``, as the im2col path) in blocks of ``data_block_images`` (dM and dV ≤ 1.25 MiB).
- weight gradient (``backward_weight``): V = the forward's ``_input_transform`` of x, dM as above, dU[g] (K × C) =
  Σ dM[g] V[g]ᵀ over the tiles (each group's positions side by side: one GEMM of depth mult·Tb), in sub-blocks of
  ≤ 32 × (1200 / 32) of dU (OpenBLAS's small kernel for a transposed-A-only call), β = 1 after a thread's first
  block; dw = Gᵀ dU G (``_filter_gradient``: (w0, w1, w2) = (m1 + m2, e, m2 + m3) per dimension). A dU of ≤ 2¹⁸
  floats (64→128) is summed by image shares, one partial dU per extra thread added in thread order; larger ones
  (128→256) split by output channel, each thread transforming every image's input (``weight_by_images``).

Bits: each dx element is one GEMM column's dot products and one thread's transform; each dw element's partial sums
are added in a fixed order: the same bits for the same thread count (tested at 1, 2 and 3 threads and both splits).
Max abs error against the float64-accumulated reference, relative to the largest value: dx ≤ 1.1e-6, dw ≤ 7.3e-7.

Measured (two threads, batch 32, wall ms; A/B scripts alternating the table's v30 and v32 paths call by call in
one process under the CPU lock, median of 15 unless said):

- Blocks. The forward's 8 MiB blocks (128 tiles) ran backward-data slower than blocks that stay in L2. Images per
  block (median of 11): 128→256 1 / 2 / 4 / 8: 6.48 / **6.12** / 6.57 / 8.45 (im2col 9.15); 256→512 1 / 2 / 4:
  6.42 / 8.04 / **6.13** (im2col 8.29; 8 and 16 images 9.51 and 8.96 in another run); 64→128 1 / 2: **5.70** /
  6.06 (im2col 8.01): hence ``DATA_BUDGET_ELEMENTS``. The weight gradient (dU is summed over the blocks, so larger
  blocks pay): 64→128 by channel / by images, 1 image 7.70 / 7.04, 2 images 6.83 / 6.83 (im2col 8.36); 128→256 2
  images 8.51 / 8.49, 4 7.08 / 7.28, 8 **6.73** / 7.75 (im2col 8.30); 256→512 by channel 8, 16, 32 images 9.76,
  8.85, 8.01, by images 11.88, 9.99, 10.04, against im2col's 7.86: its weight gradient stays on im2col
  (``conv.WINOGRAD_S2_WEIGHT_MIN_PIXELS``).
- Small GEMMs (``conv_pointwise.SMALL_GEMM_MNK``), with the forward's blocks, one GEMM → blocks: data 64→128 9.16
  → 7.45, 128→256 9.28 → 8.45, 256→512 11.66 → 8.96; weight 64→128 by channel 9.41 → 8.31, by images 8.36 → 8.21,
  128→256 by channel 8.42 → 8.16.
- The final paths, v30 → v32: data 64→128 8.40 → 6.13, 128→256 7.84 → 5.39, 256→512 8.41 → 6.20; weight 64→128
  8.47 → 6.88, 128→256 8.19 → 7.02. In ``engine kernels``' conditions (a 1024² NumPy sgemm on all threads and
  ``quiesce`` before each best-of-7, five alternating rounds): data 7.85 → 5.64, 7.14 → 4.80, 7.96 → 5.45.
- ``engine kernels --models resnet18 --ops conv2d --compare torch --no-versions --repeat 7``, the session's start
  (a8fad6a) and v32 alternating, three pairs (the third with the final tree; ms, ratio torch / ours): data 64→128
  7.60, 7.94, 7.85 → 5.70, 5.59, 5.27 (2.07, 2.14, 2.22 → 2.49, 2.60, 2.93); data 128→256 8.15, 7.17, 7.26 → 5.36,
  5.19, 4.86 (0.73, 0.87, 0.90 → 1.22, 1.20, 1.26); data 256→512 7.33, 7.82, 7.52 → 6.83, 7.14, 5.47 (0.83, 0.96,
  0.79 → 1.16, 0.96, 1.08); weight 64→128 8.22, 8.42, 8.40 → 6.31, 6.24, 5.55 (0.83, 0.79, 0.76 → 1.07, 1.03,
  1.12); weight 128→256 7.14, 7.52, 7.39 → 6.25, 5.91, 5.40 (0.91, 0.95, 0.97 → 1.14, 1.19, 1.16); weight 256→512
  (im2col in both) 7.11, 7.80, 7.87 → 7.87, 7.59, 6.95 (0.99, 0.95, 0.92 → 0.94, 0.98, 1.00). Two more v32 runs
  alone: data 256→512 5.35 and 5.43 ms (1.13, 1.14): its record moves most from run to run.

Cold compile (empty ``NUMBA_CACHE_DIR``, CPU s, each function's first call in one process): ``_dout_transform``
0.52, ``_scatter_transform`` 0.84, ``_data_images`` 1.10, ``_weight_images`` 1.15 (1.98–2.14 with the input
transform inlined: now one compile shared with the forward, ``_input_transform``), ``_filter_gradient`` 0.65–0.95:
~4.3 s; as warm-up jobs (``engine.warmup.run_job``, input transform inlined) backward-data 3.27 s, the weight
gradient 2.94 s. ResNet-18's warm-up has two more jobs (21 → 23); its pool of two workers on an empty cache
(``engine.warmup.ensure_compiled``, the session's start and v32 alternating, four pairs): 13.46 → 15.67, 13.11 →
16.13 (input transform inlined), 13.11 → 15.36, 13.16 → 15.86 s: **+2.2 to +2.7 s** on the first run, against the
≤ 15 s cold − warm goal it was ~13.5–14.5 s from. ``Paths(winograd_s2_backward=False)`` gives it back.

Tried and dropped:

- Backward-data on 8×8 inputs split by input channel (as the forward's ``by_channel``: each thread transforms its
  columns of U and every image's gradient): 6.82 and 6.76 ms against 6.13 and 6.27 split by images.
- A transposed U for backward-data (NN GEMMs instead of Uᵀ): one thread, 16 images, the GEMMs alone 3.76 against
  3.93 ms at 256→512 and level at 64→128 and 128→256, with L2-sized blocks; not worth another filter transform.
- Fixed shares instead of chunks for backward-data: level (5.45 vs 5.52 ms at 256→512 in the conditions above);
  chunks as the im2col path, which gives a late pool thread less to hold up.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
from numba import njit, uint64

from kernels.cpu.conv_shifted import gemm_list, gemm_table, row_block
from kernels.cpu.threads import chunk_count, run_chunks, run_shares

TARGET_TILES = 128
"""Tiles per block (Tb), rounded up to whole images, before the cache budget below."""

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


BY_CHANNEL_MAX_PIXELS = 64
"""Inputs of at most this many pixels (8×8: ResNet-18's 256→512) split the threads by output channel
(``forward``'s ``by_channel``), in blocks of ``BY_CHANNEL_TARGET_TILES``."""

BY_CHANNEL_TARGET_TILES = 32


def by_channel(x_shape) -> bool:
    """Whether ``forward`` splits the threads by output channel (small planes) rather than by image."""
    return x_shape[2] * x_shape[3] <= BY_CHANNEL_MAX_PIXELS


def block_images(x_shape, c_in: int, c_out: int, threads: int, target_tiles: int = 0) -> int:
    """Images per block: ``target_tiles`` tiles (0: ``TARGET_TILES``, or ``BY_CHANNEL_TARGET_TILES`` on
    small planes), within the budget, ≤ a thread's share (all images when split by channel)."""
    n, _, h, w = x_shape
    tiles = (h // 4) * (w // 4)
    split = by_channel(x_shape)
    target_tiles = target_tiles or (BY_CHANNEL_TARGET_TILES if split else TARGET_TILES)
    share = n if split else -(-n // threads)
    wanted = -(-target_tiles // tiles)
    fits = max(1, BLOCK_BUDGET_ELEMENTS // (POSITIONS * (c_in + c_out) * tiles))
    return max(1, min(share, wanted, fits))


def _filter_size(c_in: int, c_out: int) -> int:
    return GROUPS * (c_in * c_out + SKEW)


def _per_thread(c_in: int, c_out: int, height: int, width: int, images: int) -> int:
    """A thread's scratch: a block's V and M, and the transforms' buffer (5 row-position arrays of th × W)."""
    cols = images * (height // 4) * (width // 4)
    return POSITIONS * (c_in + c_out) * cols + 2 * GROUPS * SKEW + 5 * (4 * cols + 16) + cols


def workspace_size(x_shape, w_shape, threads: int) -> int:
    """Scratch (float32 elements) of ``forward``: U (16 groups of K × C), per thread a block's V and M."""
    k, c = w_shape[0], w_shape[1]
    images = block_images(x_shape, c, k, threads)
    return _filter_size(c, k) + threads * _per_thread(c, k, x_shape[2], x_shape[3], images)


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


@njit(cache=True, nogil=True, inline="always")
def _runs(a, offsets, ra, row, cols):
    """Row position ``ra`` (0 … 4) of channel row ``row`` in a block's V or M (``_group_offsets``' layout): its five
    runs of ``cols`` (e0, e1, m1, m2, m3). The 16 groups are (a, b) position pairs; a row position's e runs sit in
    group 4·ga with two columns per channel (sa = 0, 1 for ra < 2), its m runs in the next three groups. The
    input, output, dout and scatter transforms all read or write their block through it."""
    ga, sa = (0, ra) if ra < 2 else (ra - 1, 0)
    r = row * (2 if ra < 2 else 1) + sa
    g0 = 4 * ga
    e = offsets[g0] + r * 2 * cols
    m1 = offsets[g0 + 1] + r * cols
    m2 = offsets[g0 + 2] + r * cols
    m3 = offsets[g0 + 3] + r * cols
    return a[e : e + cols], a[e + cols : e + 2 * cols], a[m1 : m1 + cols], a[m2 : m2 + cols], a[m3 : m3 + cols]


@njit(cache=True, nogil=True)  # not inlined since v32: _images and _weight_images share one compile (below)
def _input_transform(src, n0, images, channels, height, width, v, offsets, cols, p):
    """V[(a, b)][c][(sa, sb)][j] = (Bᵀ d B) of the 5×5 input tile d of block column j = i·T + ty·tw + tx
    (image n0 + i, tile row ty, tile column tx), channel c. Bᵀ's rows: d1, d3, d0 − d2, d2, d4 − d2.

    Per channel, rows first: the five row positions of every tile row of the block's images,
    p[ra][(i·th + ty)·W + x] (e0 = row 4ty, e1 = row 4ty + 2, m1 = row 4ty − 1 − row 4ty + 1, m2 = row
    4ty + 1, m3 = row 4ty + 3 − row 4ty + 1), runs of W. Then columns, one flat loop over the block's
    columns per row position: column j's five inputs are p[ra][4j − 1 … 4j + 3] ((i·th + ty)·W + 4tx =
    4j); the loop reads the whole interleave group 4j + 0 … 3 (wide loads and shuffles, not gathers),
    keeps d4, and the column −1 (d0: the previous column's d4, zero at tx = 0) is a second, contiguous loop.

    Compiled on its own, not inlined: inlined into ``_images`` alone it saved 0.26 s of cold CPU (3.70 → 3.44 s,
    v28), but since v32 ``_weight_images`` calls it too, and one compile for both took the four functions' cold CPU
    in one process from 6.53 to 5.64 s (the forward's time level: 6.63 / 6.74 / 6.26 and 6.31 / 6.29 / 6.16 ms
    inlined, 6.57 / 6.22 / 6.25 and 6.34 / 6.87 / 5.79 called, the three shapes, median of 15, processes
    alternating)."""
    th, tw = height // 4, width // 4
    span = cols * 4 + 16
    plane = height * width
    pe0 = p[:span]
    pe1 = p[span : 2 * span]
    pm1 = p[2 * span : 3 * span]
    pm2 = p[3 * span : 4 * span]
    pm3 = p[4 * span : 5 * span]
    d4 = p[5 * span : 5 * span + cols]
    for c in range(channels):
        for i in range(images):
            s0 = ((n0 + i) * channels + c) * plane
            for ty in range(th):
                r0 = src[s0 + 4 * ty * width : s0 + (4 * ty + 1) * width]
                r1 = src[s0 + (4 * ty + 1) * width : s0 + (4 * ty + 2) * width]
                r2 = src[s0 + (4 * ty + 2) * width : s0 + (4 * ty + 3) * width]
                r3 = src[s0 + (4 * ty + 3) * width : s0 + (4 * ty + 4) * width]
                d = uint64((i * th + ty) * width)
                for x in range(width):
                    pe0[d + uint64(x)] = r0[x]
                for x in range(width):
                    pe1[d + uint64(x)] = r2[x]
                for x in range(width):
                    pm2[d + uint64(x)] = r1[x]
                for x in range(width):
                    pm3[d + uint64(x)] = r3[x] - r1[x]
                if ty == 0:
                    for x in range(width):
                        pm1[d + uint64(x)] = -r1[x]
                else:
                    rm = src[s0 + (4 * ty - 1) * width : s0 + 4 * ty * width]
                    for x in range(width):
                        pm1[d + uint64(x)] = rm[x] - r1[x]
        for ra in range(5):
            q = p[ra * span : (ra + 1) * span]  # q[4j + φ] = column 4tx + φ of column j's tile row
            ve0, ve1, vm1, vm2, vm3 = _runs(v, offsets, ra, c, cols)
            for j in range(cols):
                ve0[j] = q[uint64(4 * j)]
                vm2[j] = q[uint64(4 * j + 1)]
                ve1[j] = q[uint64(4 * j + 2)]
                d4[j] = q[uint64(4 * j + 3)]
            for j in range(cols):
                vm3[j] = d4[j] - vm2[j]
            vm1[0] = -vm2[0]
            for j in range(1, cols):
                vm1[j] = d4[j - 1] - vm2[j]
            for row in range(images * th):
                vm1[row * tw] = -vm2[row * tw]


@njit(cache=True, nogil=True)
def _output_transform(m, n0, images, k_lo, k_hi, channels, height, width, dst, offsets, cols, z):
    """dst[n0 + i, k, 2ty + a, 2tx + b] = (Aᵀ M A)[a, b] of block column j = i·T + ty·tw + tx. A's rows:
    e0 + m1 + m2 and e1 + m2 + m3.

    Per channel, columns first, one flat loop over the block's columns per row position: z[ra][2j + b]
    (= z[ra][(i·th + ty)·OW + 2tx + b], OW = 2tw the output row; an interleaved store); then rows, runs of
    OW per tile row, straight into ``dst``."""
    th, tw = height // 4, width // 4
    ow = 2 * tw
    span = 2 * cols
    out_plane = 4 * th * tw
    z0, z1, z2 = z[:span], z[span : 2 * span], z[2 * span : 3 * span]
    z3, z4 = z[3 * span : 4 * span], z[4 * span : 5 * span]
    for k in range(k_lo, k_hi):
        for ra in range(5):
            me0, me1, mm1, mm2, mm3 = _runs(m, offsets, ra, k - k_lo, cols)  # M holds the channels [k_lo, k_hi)
            zr = z[ra * span : (ra + 1) * span]
            for j in range(cols):
                zr[uint64(2 * j)] = me0[j] + mm1[j] + mm2[j]
                zr[uint64(2 * j + 1)] = me1[j] + mm2[j] + mm3[j]
        for i in range(images):
            o = ((n0 + i) * channels + k) * out_plane
            for ty in range(th):
                r = uint64((i * th + ty) * ow)
                top = dst[o + 2 * ty * ow : o + (2 * ty + 1) * ow]
                bottom = dst[o + (2 * ty + 1) * ow : o + (2 * ty + 2) * ow]
                for x in range(ow):
                    top[x] = z0[r + uint64(x)] + z2[r + uint64(x)] + z3[r + uint64(x)]
                for x in range(ow):
                    bottom[x] = z1[r + uint64(x)] + z3[r + uint64(x)] + z4[r + uint64(x)]


def _widths(cols: int) -> list[int]:
    """Each position group's columns in a block of ``cols`` tiles: mult(a)·mult(b)·cols (mult(e) = 2)."""
    return [(2 if g < 4 else 1) * (2 if g % 4 == 0 else 1) * cols for g in range(GROUPS)]


def _group_offsets(channels: int, cols: int) -> list[int]:
    """Where each position group g = 4a + b starts in a block's V or M ([channel][position][tile]), and (the 17th)
    where the array ends: the layout every transform reads through ``_runs`` and every ``gemm_list`` table uses."""
    starts, at = [], 0
    for wide in _widths(cols):
        starts.append(at)
        at += channels * wide + SKEW
    return [*starts, at]


@lru_cache(maxsize=512)
def _forward_gemms(plane, k_lo, c_out, c_in, cols, limit) -> np.ndarray:
    """The ``gemm_list`` table of one block's 16 GEMMs M[g] = U[g] (rows [k_lo, k_lo + c_out)) @ V[g], each in row
    blocks of ≤ ``limit`` multiply-adds when ``limit`` > 0."""
    v_at, m_at, rows = _group_offsets(c_in, cols), _group_offsets(c_out, cols), []
    for g, wide in enumerate(_widths(cols)):
        step = row_block(c_out, c_in, wide, limit)
        rows += [(False, False, min(step, c_out - r0), wide, c_in, g * plane + (k_lo + r0) * c_in, c_in, v_at[g], wide,
                  0, m_at[g] + r0 * wide, wide) for r0 in range(0, c_out, step)]
    return gemm_table(rows)


class _Blocks:
    """A thread's block buffers for one call: a block's two transformed arrays side by side at the front of its
    scratch (V and M, or M and dV), the rest after them, and each one's group offsets (``_group_offsets``); made
    once per distinct block size (the full block and the last), not once per block."""

    def __init__(self, mine, first_channels: int, second_channels: int) -> None:
        self.mine, self.first, self.second = mine, first_channels, second_channels
        self.made: dict[int, tuple] = {}

    def __call__(self, cols: int) -> tuple:
        """(first, second, rest, first's offsets, second's offsets) for blocks of ``cols`` tiles."""
        if cols not in self.made:
            first = np.array(_group_offsets(self.first, cols), np.int64)
            second = np.array(_group_offsets(self.second, cols), np.int64)
            end, size = int(first[GROUPS]), int(second[GROUPS])
            self.made[cols] = (self.mine[:end], self.mine[end : end + size], self.mine[end + size :], first, second)
        return self.made[cols]


def _images(x, u, out, first, last, block, mine, k_lo, k_hi, limit):
    """Images [first, last) on the calling thread, ``block`` at a time: transform, 16 GEMMs (each in row
    blocks of ≤ ``limit`` multiply-adds when ``limit`` > 0), transform.

    A Python loop over compiled pieces, not one compiled driver (``conv.py``'s module docstring, "Compiled
    pieces, Python drivers"): compiled, it linked both transforms in and compiled them again (1.61 s of a cold
    first run's CPU)."""
    c_in, height, width = x.shape[1], x.shape[2], x.shape[3]
    c_out = k_hi - k_lo
    tiles = (height // 4) * (width // 4)
    src, dst = x.reshape(x.size), out.reshape(out.size)
    plane = c_in * out.shape[1] + SKEW  # U's group stride: all K output channels
    blocks = _Blocks(mine, c_in, c_out)
    for n0 in range(first, last, block):
        images = min(block, last - n0)
        cols = images * tiles
        v, m, tmp, v_offsets, m_offsets = blocks(cols)
        _input_transform(src, n0, images, c_in, height, width, v, v_offsets, cols, tmp)
        gemm_list(u, v, m, _forward_gemms(plane, k_lo, c_out, c_in, cols, limit))
        _output_transform(m, n0, images, k_lo, k_hi, out.shape[1], height, width, dst, m_offsets, cols, tmp)


def forward(x, w, out, threads: int, block: int, scratch, limit: int = 0) -> None:
    """out = conv3×3(x, w), stride 2, pad 1 (``supported`` shapes), by the polyphase Winograd transform.

    ``limit`` > 0 (v29): each of the 16 GEMMs in blocks of output channels of ≤ ``limit`` multiply-adds,
    where SciPy's OpenBLAS takes its small-matrix kernel and packs nothing (``conv_pointwise``'s
    ``SMALL_GEMM_MNK``, found on the 1×1 layers). The same bits as one GEMM (checked on the three
    ResNet-18 shapes). Batch 32, two threads, median of 15 alternating calls, ms, one GEMM → blocks
    of ≤ 10⁶ → ≤ 2·10⁶, two sittings: 256→512 @8×8 6.93 → 5.70 → 7.33 and 8.43 → 6.80 → 8.72;
    128→256 @16×16 6.61 → 6.70 → 7.77 and 8.19 → 7.95 → 8.65; 64→128 @32×32 7.05 → 6.16 → 7.41 and
    8.41 → 7.23 → 8.89 (A/B of the table's forward with the limit switched, in one process).

    Split by output channel (``by_channel``: small planes), each thread transforms and multiplies its own
    output channels for all images (its share of U written and read by itself, no barrier, but every
    thread transforms every image's input); else each thread its images, after a U shared by all."""
    n, c_in, height, width = x.shape
    c_out = out.shape[1]
    start = _filter_size(c_in, c_out)
    u = scratch[:start]
    per_thread = _per_thread(c_in, c_out, height, width, block)
    if by_channel(x.shape):

        def own(t: int) -> None:
            k_lo, k_hi = t * c_out // threads, (t + 1) * c_out // threads
            _filter_transform(w, k_lo, k_hi, u)
            _images(x, u, out, 0, n, block, scratch[start + t * per_thread : start + (t + 1) * per_thread], k_lo, k_hi,
                    limit)

        run_shares(own, threads)
        return
    run_shares(lambda t: _filter_transform(w, t * c_out // threads, (t + 1) * c_out // threads, u), threads)

    def work(t: int) -> None:
        mine = scratch[start + t * per_thread : start + (t + 1) * per_thread]
        _images(x, u, out, t * n // threads, (t + 1) * n // threads, block, mine, 0, c_out, limit)

    run_shares(work, threads)


# ----------------------------------------------------------------------------------------------
# v32: backward-data and the weight gradient by the same transform, transposed
# ----------------------------------------------------------------------------------------------


@njit(cache=True, nogil=True)
def _dout_transform(src, n0, images, k_lo, k_hi, channels, height, width, m, offsets, cols, q):
    """dM[(a, b)][k − k_lo][(sa, sb)][j] = (A g Aᵀ)[(a, sa), (b, sb)] of the 2×2 gradient tile g of block column
    j = i·T + ty·tw + tx (image n0 + i; ``height`` × ``width`` the conv's input plane, ``channels`` dout's): the
    transpose of the forward's output transform. Per dimension A maps (y0, y1) to (e0, e1, m1, m2, m3) =
    (y0, y1, y0, y0 + y1, y1).

    Per channel, rows first: three arrays over the block's tile rows, q[y0 | y1 | y0 + y1][(i·th + ty)·OW + x]
    (OW = 2tw, runs of OW); then per row position one flat loop over the block's columns reading q[2j] and
    q[2j + 1] (column j's pair)."""
    th, tw = height // 4, width // 4
    ow = 2 * tw
    span = 2 * cols
    out_plane = 4 * th * tw
    q0, q1, qs = q[:span], q[span : 2 * span], q[2 * span : 3 * span]
    for k in range(k_lo, k_hi):
        for i in range(images):
            s0 = ((n0 + i) * channels + k) * out_plane
            for ty in range(th):
                top = src[s0 + 2 * ty * ow : s0 + (2 * ty + 1) * ow]
                bottom = src[s0 + (2 * ty + 1) * ow : s0 + (2 * ty + 2) * ow]
                d = uint64((i * th + ty) * ow)
                for x in range(ow):
                    q0[d + uint64(x)] = top[x]
                for x in range(ow):
                    q1[d + uint64(x)] = bottom[x]
                for x in range(ow):
                    qs[d + uint64(x)] = top[x] + bottom[x]
        for ra in range(5):
            zr = q0 if ra == 0 or ra == 2 else (q1 if ra == 1 or ra == 4 else qs)
            me0, me1, mm1, mm2, mm3 = _runs(m, offsets, ra, k - k_lo, cols)
            for j in range(cols):
                a = zr[uint64(2 * j)]
                b = zr[uint64(2 * j + 1)]
                me0[j] = a
                me1[j] = b
                mm1[j] = a
                mm2[j] = a + b
                mm3[j] = b


@njit(cache=True, nogil=True)
def _scatter_transform(v, n0, images, c_lo, c_hi, channels, height, width, dst, offsets, cols, z):
    """dx[n0 + i, c] = the transpose of the forward's input transform of dV (channels [c_lo, c_hi), V's rows
    from 0): per dimension Bᵀ's transpose gives the tile's five inputs d0 … d4 (columns 4tx − 1 … 4tx + 3) as
    (m1, e0, −m1 + m2 − m3, e1, m3); d0 is the previous tile's d4 column (its m3 plus this m1) and the one at
    column −1 (tx = 0) is the padding, dropped. Each dx element is written once (no scatter-add into dx).

    Per channel, columns first, one flat loop over the block per row position into z[ra][4j + φ] (φ = 0 … 3:
    columns 4tx … 4tx + 3), the column-3 sum in a second loop (m1 of column j + 1, but not across a tile row's
    end); then rows, runs of W straight into ``dst``: rows 4ty … 4ty + 3 from (e0), (−m1 + m2 − m3), (e1),
    (m3 + the next tile row's m1)."""
    th, tw = height // 4, width // 4
    span = 4 * cols
    plane = height * width
    for c in range(c_lo, c_hi):
        for ra in range(5):
            ve0, ve1, vm1, vm2, vm3 = _runs(v, offsets, ra, c - c_lo, cols)
            zr = z[ra * span : (ra + 1) * span]
            for j in range(cols):
                zr[uint64(4 * j)] = ve0[j]
                zr[uint64(4 * j + 1)] = vm2[j] - vm1[j] - vm3[j]
                zr[uint64(4 * j + 2)] = ve1[j]
                zr[uint64(4 * j + 3)] = vm3[j]
            for j in range(cols - 1):
                zr[uint64(4 * j + 3)] += vm1[j + 1]
            for r in range(1, images * th):  # a tile row's last column takes nothing from the next row's first
                j = r * tw - 1
                zr[uint64(4 * j + 3)] = vm3[j]
        z0, z1, z2 = z[:span], z[span : 2 * span], z[2 * span : 3 * span]
        z3, z4 = z[3 * span : 4 * span], z[4 * span : 5 * span]
        for i in range(images):
            o = ((n0 + i) * channels + c) * plane
            for ty in range(th):
                r = uint64((i * th + ty) * width)
                row0 = dst[o + 4 * ty * width : o + (4 * ty + 1) * width]
                row1 = dst[o + (4 * ty + 1) * width : o + (4 * ty + 2) * width]
                row2 = dst[o + (4 * ty + 2) * width : o + (4 * ty + 3) * width]
                row3 = dst[o + (4 * ty + 3) * width : o + (4 * ty + 4) * width]
                for x in range(width):
                    row0[x] = z0[r + uint64(x)]
                for x in range(width):
                    row1[x] = z3[r + uint64(x)] - z2[r + uint64(x)] - z4[r + uint64(x)]
                for x in range(width):
                    row2[x] = z1[r + uint64(x)]
                if ty + 1 < th:
                    nxt = r + uint64(width)
                    for x in range(width):
                        row3[x] = z4[r + uint64(x)] + z2[nxt + uint64(x)]
                else:
                    for x in range(width):
                        row3[x] = z4[r + uint64(x)]


@lru_cache(maxsize=512)
def _data_gemms(plane, c_lo, c_out, c_all, k_all, cols, limit) -> np.ndarray:
    """The ``gemm_list`` table of one block's 16 GEMMs dV[g] = U[g]ᵀ (columns [c_lo, c_lo + c_out)) dM[g], rows of
    dV in blocks of ≤ ``limit`` multiply-adds when ``limit`` > 0."""
    m_at, v_at, rows = _group_offsets(k_all, cols), _group_offsets(c_out, cols), []
    for g, wide in enumerate(_widths(cols)):
        step = row_block(c_out, k_all, wide, limit)
        rows += [(True, False, min(step, c_out - r0), wide, k_all, g * plane + c_lo + r0, c_all, m_at[g], wide, 0,
                  v_at[g] + r0 * wide, wide) for r0 in range(0, c_out, step)]
    return gemm_table(rows)


def _data_images(dout, u, dx, first, last, block, mine, c_lo, c_hi, limit):
    """dx for images [first, last) and input channels [c_lo, c_hi) on the calling thread, ``block`` images at a
    time: the gradient transform (all K channels), 16 GEMMs dV[g] = U[g]ᵀ dM[g] (rows of dV in blocks of ≤
    ``limit`` multiply-adds when ``limit`` > 0), the scatter transform straight into ``dx``. A Python loop over
    compiled pieces, as ``_images``."""
    k_all, c_all, height, width = dout.shape[1], dx.shape[1], dx.shape[2], dx.shape[3]
    c_out = c_hi - c_lo
    tiles = (height // 4) * (width // 4)
    src, dst = dout.reshape(dout.size), dx.reshape(dx.size)
    plane = c_all * k_all + SKEW  # U's group stride
    blocks = _Blocks(mine, k_all, c_out)
    for n0 in range(first, last, block):
        images = min(block, last - n0)
        cols = images * tiles
        m, v, tmp, m_offsets, v_offsets = blocks(cols)
        _dout_transform(src, n0, images, 0, k_all, k_all, height, width, m, m_offsets, cols, tmp)
        gemm_list(u, m, v, _data_gemms(plane, c_lo, c_out, c_all, k_all, cols, limit))
        _scatter_transform(v, n0, images, c_lo, c_hi, c_all, height, width, dst, v_offsets, cols, tmp)


def backward_data(dout, w, dx, threads: int, block: int, scratch, limit: int = 0) -> None:
    """dx = the gradient of the stride-2 conv's input (``supported`` shapes) by the transposed polyphase
    transform: dM = A dout Aᵀ per 2×2 gradient tile, dV[g] = U[g]ᵀ dM[g] (the forward's U), dx = B dV Bᵀ.
    Each thread its images, after a U shared by all (the filter transform split by output channel)."""
    n = dx.shape[0]
    c_in, c_out = dx.shape[1], dout.shape[1]  # the conv's input (dx) and output (dout) channels
    start = _filter_size(c_in, c_out)
    u = scratch[:start]
    per_thread = _per_thread(c_out, c_in, dx.shape[2], dx.shape[3], block)
    run_shares(lambda t: _filter_transform(w, t * c_out // threads, (t + 1) * c_out // threads, u), threads)

    chunks = chunk_count(n, block, threads)

    def work(c: int, slot: int) -> None:
        mine = scratch[start + slot * per_thread : start + (slot + 1) * per_thread]
        _data_images(dout, u, dx, c * n // chunks, (c + 1) * n // chunks, block, mine, 0, c_in, limit)

    run_chunks(work, chunks, threads)


@lru_cache(maxsize=512)
def _weight_gemms(plane, k_lo, k_out, c_in, cols, k_step, c_step, beta) -> np.ndarray:
    """The ``gemm_list`` table of one block's 16 GEMMs dU[g][k_lo:k_lo + k_out] (+)= dM[g] V[g]ᵀ (β = ``beta``) in
    sub-blocks of ``k_step`` × ``c_step`` of dU."""
    m_at, v_at, rows = _group_offsets(k_out, cols), _group_offsets(c_in, cols), []
    for g, wide in enumerate(_widths(cols)):
        rows += [(False, True, min(k_step, k_out - k0), min(c_step, c_in - c0), wide, m_at[g] + k0 * wide, wide,
                  v_at[g] + c0 * wide, wide, beta, g * plane + (k_lo + k0) * c_in + c0, c_in)
                 for k0 in range(0, k_out, k_step) for c0 in range(0, c_in, c_step)]
    return gemm_table(rows)


def _weight_images(x, dout, du, first, last, block, mine, k_lo, k_hi, k_step, c_step):
    """dU[g][k_lo:k_hi] = Σ over images [first, last) of dM[g] V[g]ᵀ on the calling thread, ``block`` at a time:
    the forward's input transform of x (all C channels), the gradient transform of dout's channels [k_lo, k_hi),
    16 GEMMs (β = 1 after the first block) in sub-blocks of ``k_step`` × ``c_step`` of dU. A Python loop over
    compiled pieces, as ``_images``."""
    n, c_in, height, width = x.shape
    k_all = dout.shape[1]
    k_out = k_hi - k_lo
    tiles = (height // 4) * (width // 4)
    src, grad = x.reshape(x.size), dout.reshape(dout.size)
    plane = c_in * k_all + SKEW
    if first >= last:
        for g in range(GROUPS):
            du[g * plane + k_lo * c_in : g * plane + k_hi * c_in] = 0.0
    blocks = _Blocks(mine, c_in, k_out)
    for n0 in range(first, last, block):
        images = min(block, last - n0)
        cols = images * tiles
        v, m, tmp, v_offsets, m_offsets = blocks(cols)
        _input_transform(src, n0, images, c_in, height, width, v, v_offsets, cols, tmp)
        _dout_transform(grad, n0, images, k_lo, k_hi, k_all, height, width, m, m_offsets, cols, tmp)
        gemm_list(m, v, du, _weight_gemms(plane, k_lo, k_out, c_in, cols, k_step, c_step, n0 != first))


@njit(cache=True, nogil=True)
def _filter_gradient(du, slots, k_lo, k_hi, dw):
    """dw[k, c] = Gᵀ dU[k, c] G for k in [k_lo, k_hi) (the filter transform's transpose), dU the sum of
    ``slots`` consecutive partial dU (added into the first, slot after slot): per dimension (dU_e, dU_m1, dU_m2,
    dU_m3) give (w0, w1, w2) = (m1 + m2, e, m2 + m3). Scalar code (8 MiB of dU at most, read once)."""
    k, c = dw.shape[0], dw.shape[1]
    plane = k * c + SKEW
    size = GROUPS * plane
    out = dw.reshape(dw.size)
    for s in range(1, slots):
        part = s * size
        for g in range(GROUPS):
            lo = g * plane + k_lo * c
            for i in range(lo, lo + (k_hi - k_lo) * c):
                du[i] += du[part + i]
    for at in range(k_lo * c, k_hi * c):
        for r in range(3):  # G's rows holding tap r: r = 0 in m1, m2; r = 1 in e; r = 2 in m2, m3
            ra, rb = (1, 2) if r == 0 else ((0, 0) if r == 1 else (2, 3))
            t0 = du[4 * ra * plane + at]
            t1 = du[(4 * ra + 1) * plane + at]
            t2 = du[(4 * ra + 2) * plane + at]
            t3 = du[(4 * ra + 3) * plane + at]
            if r != 1:
                t0 += du[4 * rb * plane + at]
                t1 += du[(4 * rb + 1) * plane + at]
                t2 += du[(4 * rb + 2) * plane + at]
                t3 += du[(4 * rb + 3) * plane + at]
            o = 9 * at + 3 * r
            out[o] = t1 + t2
            out[o + 1] = t0
            out[o + 2] = t2 + t3


WEIGHT_BY_IMAGES_MAX = 1 << 18
"""dU of at most this many float32 (16·K·C: 64→128) is summed by image shares, one partial dU per extra thread;
larger ones split by output channel (``weight_by_images``)."""


def weight_by_images(w_shape) -> bool:
    """Whether ``backward_weight`` splits the threads by images (partial dU per extra thread) rather than by
    output channel (every thread transforms every image's input)."""
    return GROUPS * w_shape[0] * w_shape[1] <= WEIGHT_BY_IMAGES_MAX


def weight_block_images(x_shape, w_shape, threads: int, target_tiles: int = 0) -> int:
    """Images per block of ``backward_weight``: ``target_tiles`` tiles (0: ``TARGET_TILES``) within the budget
    for V (all C channels) and dM (all K, or a thread's K / threads when split by channel), ≤ a thread's images."""
    n, _, h, w = x_shape
    c_out, c_in = w_shape[0], w_shape[1]
    tiles = (h // 4) * (w // 4)
    split = weight_by_images(w_shape)
    k_share = c_out if split else -(-c_out // threads)
    share = -(-n // threads) if split else n
    wanted = -(-(target_tiles or TARGET_TILES) // tiles)
    fits = max(1, BLOCK_BUDGET_ELEMENTS // (POSITIONS * (c_in + k_share) * tiles))
    return max(1, min(share, wanted, fits))


def weight_workspace_size(x_shape, w_shape, threads: int) -> int:
    """Scratch of ``backward_weight``: dU (16 groups of K × C; one per thread when split by images), per
    thread a block's V and dM (its share of K when split by channel) and the transforms' buffer."""
    k, c = w_shape[0], w_shape[1]
    images = weight_block_images(x_shape, w_shape, threads)
    split = weight_by_images(w_shape)
    k_share = k if split else -(-k // threads)
    per_thread = _per_thread(c, k_share, x_shape[2], x_shape[3], images)
    return (threads if split else 1) * _filter_size(c, k) + threads * per_thread


DATA_BUDGET_ELEMENTS = 320 * 1024
"""At most this many float32 (1.25 MiB) in a block's dM and dV together (25·(C + K)·Tb) of ``backward_data``:
its blocks stay in the 2 MiB L2 beside the U they stream through (the forward's 8 MiB blocks ran it slower)."""


def data_block_images(x_shape, w_shape, threads: int) -> int:
    """Images per block of ``backward_data``: as many as ``DATA_BUDGET_ELEMENTS`` holds (≥ 1), ≤ a thread's share."""
    n, _, h, w = x_shape
    tiles = (h // 4) * (w // 4)
    fits = DATA_BUDGET_ELEMENTS // (POSITIONS * (w_shape[0] + w_shape[1]) * tiles)
    return max(1, min(-(-n // threads), fits))


def data_workspace_size(x_shape, w_shape, threads: int) -> int:
    """Scratch of ``backward_data``: U (16 groups of K × C), per thread a block's dM and dV."""
    k, c = w_shape[0], w_shape[1]
    images = data_block_images(x_shape, w_shape, threads)
    return _filter_size(c, k) + threads * _per_thread(k, c, x_shape[2], x_shape[3], images)


WEIGHT_K_STEP = 32
WEIGHT_ELEMENTS = 1200
"""The weight gradient's GEMMs in sub-blocks of dU of ≤ 32 rows and ≤ 1200 elements (OpenBLAS's small-matrix
kernel for a transposed-A-only call: M·N ≤ 1200, K ≥ 32, MNK ≤ 10⁶; ``conv_pointwise.weight_steps``)."""


def weight_steps(k_share: int, c_in: int, depth: int, limit: int) -> tuple[int, int]:
    """Sub-blocks (rows of dU, columns of dU) for GEMMs of depth ``depth``; ``limit`` ≤ 0: one GEMM."""
    if limit <= 0:
        return k_share, c_in
    k_step = row_block(k_share, 1, 1, WEIGHT_K_STEP)
    most = max(1, min(WEIGHT_ELEMENTS // k_step, limit // (k_step * depth)))
    return k_step, row_block(c_in, 1, 1, most)


def backward_weight(x, dout, dw, threads: int, block: int, scratch, limit: int = 0) -> None:
    """dw of the stride-2 conv (``supported`` shapes) by the polyphase transform: dU[g] = Σ dM[g] V[g]ᵀ over
    every tile (V the forward's input transform, dM = A dout Aᵀ), dw = Gᵀ dU G. Thread t owns output channels
    [t·K/T, (t+1)·K/T) of dU and dw: it transforms every image's input (as the forward's ``by_channel``) and its
    channels of dout; no partial sums, no barrier."""
    n, c_in, k = x.shape[0], x.shape[1], dw.shape[0]
    split = weight_by_images(dw.shape)
    size = _filter_size(c_in, k)
    start = (threads if split else 1) * size
    du = scratch[:start]
    k_share = k if split else -(-k // threads)
    per_thread = _per_thread(c_in, k_share, x.shape[2], x.shape[3], block)
    depth = 4 * block * (x.shape[2] // 4) * (x.shape[3] // 4)
    k_step, c_step = weight_steps(k_share, c_in, depth, limit)
    if split:

        def images(t: int) -> None:
            mine = scratch[start + t * per_thread : start + (t + 1) * per_thread]
            _weight_images(x, dout, du[t * size : (t + 1) * size], t * n // threads, (t + 1) * n // threads, block,
                           mine, 0, k, k_step, c_step)

        run_shares(images, threads)
        run_shares(lambda t: _filter_gradient(du, threads, t * k // threads, (t + 1) * k // threads, dw), threads)
        return

    def own(t: int) -> None:
        k_lo, k_hi = t * k // threads, (t + 1) * k // threads
        mine = scratch[start + t * per_thread : start + (t + 1) * per_thread]
        _weight_images(x, dout, du, 0, n, block, mine, k_lo, k_hi, k_step, c_step)
        _filter_gradient(du, 1, k_lo, k_hi, dw)

    run_shares(own, threads)

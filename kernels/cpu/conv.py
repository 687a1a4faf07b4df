"""Convolution on the CPU, the production path: the kernel table's ``conv2d_*`` entries.

Why this shape. A convolution is a matrix product once the input is unrolled into columns
(im2col): ``out[K, pixels] = w[K, C·R·S] @ cols[C·R·S, pixels]``. The GEMM is where the flops are,
and BLAS (SciPy's OpenBLAS, reached through Numba's ``numba_xxgemm``: ``conv_shifted.sgemm``) runs it at
100+ GFLOP/s per core here. Each call opens one parallel region; every Numba thread takes a contiguous share
of the images and builds its own column *tiles* (blocks of images small enough to stay in cache,
wide enough to give the GEMM ≥ ``TARGET_COLUMNS`` columns) in its slice of the caller's
``scratch``, then runs a single-threaded GEMM on them (SciPy's BLAS is held at one thread for the
call, so the two thread pools never compete). Special shapes take faster paths:

- **3×3, stride 1, pad 1, groups 1** (ResNet-18's 3×3 layers but the stride-2 ones), forward and
  backward-data with ≥ ``WINOGRAD_MIN_CHANNELS`` channels in and out on planes of ≤ 16×16
  (``WINOGRAD_MAX_PIXELS``; ≤ 32×32 when the sgemm is OpenBLAS, v12: ``winograd_max_pixels``):
  cache-blocked Winograd
  F(2×2, 3×3), 2.25× fewer multiplies (``conv_winograd.py``, v10), and since v11 their weight
  gradient too (≤ 16×16). Since v14 (v15: the weight gradient too), with OpenBLAS, 64–256
  channels on 16×16 to 32×32 planes (the weight gradient from 8×8, and since v18 forward and
  backward-data too) take Winograd F(4×4, 3×3)
  instead (``conv_winograd4.py``, ``WINOGRAD4_MIN_PIXELS``); since v34 forward and backward-data on
  4×4 to 8×8 planes (512 channels too) run F(4×4) with the threads splitting the output channels, each
  block's filters transformed where its GEMMs read them (``conv_winograd4.forward_by_k``,
  ``WINOGRAD4_BY_K_MIN_PIXELS``), and since v35 their weight gradient when the batch's transforms fit
  (``conv_winograd4.backward_weight_by_k``). Larger planes and narrower layers,
  on planes of ≥ ``SHIFTED_MIN_PIXELS`` pixels:
  no im2col; three shifted GEMMs per tile over a row-expanded copy of the input
  (``conv_shifted.py``), except convolutions of < ``SHIFTED_MIN_CHANNELS`` input channels (the
  stems), which stay on im2col (the weight gradient since v11, forward and backward-data since v17);
  since v36 the stems' forward and weight gradient run their own small im2col and one sgemm per image
  (``conv_stem.py``: the general im2col drivers were the largest compile jobs of a cold first run), and since v39
  the ImageNet stems' (7×7 and 3×3 stride 2, ≤ 4 input channels) in blocks of output rows, since v47 copied from
  each image split into its stride² phases.
- **3×3, stride 2, pad 1** forward with ≥ 64 channels in and out on inputs of ≥ 8×8 (v28): the
  polyphase Winograd transform, 25 instead of 36 multiplies per 2×2 output tile (``conv_winograd_s2.py``,
  ``WINOGRAD_S2_MIN_PIXELS``); since v32 backward-data of the same layers and their weight gradient on
  inputs of ≥ 16×16 too, by the transform transposed (``WINOGRAD_S2_WEIGHT_MIN_PIXELS``); since v40 on planes
  that are not multiples of 4 too (ImageNet's 256→512 @14×14), embedded in zeros (``s2_padded``).
- **depthwise 3×3 pad 1** (``groups == C == K``): flat vector runs across channel planes on small
  planes, plane by plane with the weights in registers from 16×16, the weight gradient by image
  groups from 8×8 (v21; ``conv_depthwise.py``); since v25 the 4×4, 8×8, 16×16 and 32×32 planes (stride 1
  and 2, all three directions) with whole planes in vector registers (``conv_depthwise_regs.py``);
  other depthwise shapes: the direct loops below.
- **1×1**: smaller tiles (``POINTWISE_TARGET_COLUMNS``); stride 1 without padding skips im2col,
  the image already *is* its column matrix. Its weight gradient on planes of ≥ 64 pixels is one
  β = 1 GEMM per image straight into dw (v16, ``_pointwise_weight_in_place``); so is every other
  im2col weight gradient with output planes of ≥ 16×16 (v20, ``_im2col_weight_in_place``: the stems,
  the stride-2 layers on 32×32 inputs), one image's columns at a time.
  Since v27 a plain 1×1 (stride 1, groups 1) runs in ``conv_pointwise``: forward and backward-data one
  sgemm per image per block of output rows, each ≤ 10⁶ multiply-adds, where SciPy's OpenBLAS takes its
  small-matrix kernel (1.35× over the 20 MobileNetV2 shapes); the weight gradient on ≥ 16×16 planes
  with each thread owning a block of dW, in ≤ 32 × 1200 sub-blocks (``Paths.pointwise_small_gemms``,
  ``Paths.pointwise_weight_split``). Since v31 its weight gradient on planes under 16×16 too: each thread a
  range of dW's larger side, the smaller side transposed per image so that every GEMM is NN (the transposed-A
  GEMM ``dout_n @ x_nᵀ`` missed OpenBLAS's small-matrix kernel), 1.12–1.35× on the 11 MobileNetV2 shapes
  (``Paths.pointwise_weight_transposed``, ``conv_pointwise.backward_weight_transposed``).
  Since v33 a 1×1 stride-2 conv (pad 0, groups 1: ResNet-18's downsample shortcuts) runs there too, in every
  direction, on its kept pixels: the forward gathers them (256 KiB of images at a time) for v27's per-image
  GEMMs, backward-data scatters each image's GEMM result into dx with its zeros, the weight gradient sums
  256-deep GEMMs of images side by side (``Paths.pointwise_strided``; figures in ``conv_pointwise``).

Since v38 (``ENGINE_CONV``, ``CONV_MODES``) the **forward** of a 3×3 stride-1 conv never takes F(4×4) by default
(``Paths.float32_forward``): F(4×4)'s forward rounds 3.8–9.6× more than a float32 GEMM at ResNet-18's shapes and
moved ~6 ReLU masks per step of a CIFAR ResNet-18 at batch 8 (1 with float32-level forwards, the same as
PyTorch's), so the layers it took run F(2×2) forward ("winograd", 1.1–2.0× a GEMM's error), on 4×4 planes too
(tiles, not v23's split by ξ: 4% slower on 512 @4×4, one warm-up job fewer; since v43 by ξ again on ≤ 7×7,
``WINOGRAD_BY_XI_FORWARD_MAX_PIXELS``), while backward-data and the weight
gradient keep F(4×4). ``ENGINE_CONV=fast`` gives v37's forward back, ``exact`` takes F(4×4) off every direction.
Errors per path and mode: kernels/README.md, "Rounding per path".

Backward to data is the transposed product, ``dcols = w.T @ dout``, then col2im adds each column
back into the pixels it came from (one thread owns a whole plane: no races). Backward to weights
accumulates ``dw += dout_tile @ cols_tile.T`` tile after tile; the per-thread partial sums are
added in thread order.

The numbered versions that led here (v1 direct loops … v8 this module), with what each bought,
live in ``conv_study.py``; ``engine kernels`` times and checks them all.

Determinism: each output element is written by exactly one thread, weight gradients are summed
tile after tile and thread after thread in a fixed order, and a single-threaded BLAS call splits
its work the same way every time: the same bits for the same thread count.

Compiled pieces, Python drivers (issue 32, the first run). A compiled function that calls another compiled
function links the callee's code into its own module, and Numba optimizes that module and emits its machine
code again, callee included: a transform compiled on its own (it is also called from Python) and called by a
compiled block driver was compiled twice. So the block loops of the Winograd paths (``conv_winograd._rows``,
``conv_winograd4._rows``, ``_k_blocks``, ``_weight_k_blocks``, ``conv_winograd_s2._images``, ``_data_images``,
``_weight_images``), the im2col drivers and the strided 1×1 gathers (``conv_pointwise.move_kept``,
``strided_weight``) are Python loops that call the transforms and ``conv_shifted.gemm_list`` (a block's GEMMs from a
cached table; im2col's one GEMM a tile through ``conv_shifted.gemm``), ~1 µs a call. Helpers that are
``inline="always"`` (Numba inlines their IR into each caller: compiled
once per caller, never on their own) stay inside the compiled pieces; so do the stems' columns, inlined into one
compiled driver for both directions (``conv_stem._images``, ``_strided_images``: compiled once, and no dispatch per
image). Measured (2026-11-28, quiet): the CIFAR ResNet-18 warm-up's jobs in one process on an empty cache 27.8 →
18.6–19.6 s of CPU; the README's main command cold − warm 14.43–15.48 → 9.39–11.03 s over five sittings (``python
benchmarks/first_run.py --runs 2 --baseline <the tree before>``, two pairs each, alternating; kernels/README.md, "The
first run, 2026-11-28"); ResNet-18's 23 conv calls at 32×32 (batch 32, two threads, best of 7, median of three
alternating rounds) 142.1 → 143.9 ms in all with the stems' loops in Python too (their weight gradient +0.47 ms, which
the one compiled stem driver takes back), the 224 calls 457.8 → 452.0 ms.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import numpy as np
import scipy.linalg.cython_blas  # noqa: F401  the BLAS numba_xxgemm calls: loaded now so it can be found
from numba import get_num_threads, njit, prange, uint64
from threadpoolctl import ThreadpoolController

from kernels.cpu import (
    blas,
    conv_depthwise,
    conv_depthwise_regs,
    conv_pointwise,
    conv_shifted,
    conv_stem,
    conv_winograd,
    conv_winograd4,
    conv_winograd_s2,
)
from kernels.cpu.columns import row_same
from kernels.cpu.conv_shifted import gemm, sgemm
from kernels.cpu.threads import chunk_count, run_chunks, run_shares
from kernels.reference.conv import check_conv2d_shapes

TARGET_COLUMNS = 1024
"""A tile holds whole images until its GEMM has at least this many columns (pixels): v3–v6."""

SMALL_TARGET_COLUMNS = 256
"""v7's target for forward and backward-data (``Paths.small_tiles``): a 16×16 output image is then
a tile by itself, whose GEMM writes straight into ``out`` with no scatter. One thread, thread CPU
ms, forward / backward-data at 1024 → 256 columns: 64→128 3×3 stride 2 @32×32 19.8 / 15.0 →
14.4 / 12.5; 128→256 stride 2 @16×16 15.6 / 12.3 → 14.2 / 11.8; 256→512 stride 2 @8×8 and 512 ch
@4×4 within noise (their tiles are bounded by ``TILE_BUDGET_ELEMENTS`` anyway)."""

WEIGHT_TARGET_COLUMNS = 4096
"""The weight gradient sums over a tile's columns inside the GEMM and adds tiles outside it:
longer tiles mean fewer partial sums to add (it pays most where C·R·S is small: 1×1 and the stem)."""

POINTWISE_TARGET_COLUMNS = 256
POINTWISE_WEIGHT_TARGET_COLUMNS = 1024
"""Targets for 1×1 convolutions. Their GEMMs are thin (C·R·S = C), so the column tile and the
result tile, not the weights, are what must stay in cache: smaller tiles ran the 1×1 stride-2
downsample forward 20-30% faster here, and a 32×32 image (1024 columns) then is a tile by itself,
used in place with no gather or scatter."""

TILE_BUDGET_ELEMENTS = 1 << 20
"""At most this many float32 (4 MiB) in one column tile, so it stays in the L2/L3 caches."""

SHIFTED_MIN_PIXELS = 64
"""3×3 stride-1 convolutions on planes of at least this many pixels (8×8) take the shifted-GEMM
path. On 4×4 planes its zero separator rows waste a quarter of the GEMM and im2col stayed faster
(512 ch @4×4, one thread, CPU ms: forward 28.4 vs 24.4, backward-data 32.2 vs 28.4)."""

SHIFTED_MIN_CHANNELS = 8
"""A 3×3 conv with fewer input channels (ResNet-18's and MobileNetV2's 3-channel stems) runs on
im2col. The weight gradient since v11: the shifted path's three GEMMs ``dW_dy (K × 3C) += D @ P3ᵀ``
are 9 columns wide there and read ``dout`` three times, where im2col reads it once for a K × 27
result. One thread, 16 images, thread CPU ms shifted / im2col (AMD Zen 4): 3→64 @32×32 3.14 / 1.83,
3→32 1.55 / 0.95, 8→64 2.28 / 2.15, 16→64 3.72 / 4.19, 32→64 6.88 / 7.72.

Forward and backward-data since v17, for the first run rather than the step: once F(4×4) took the
64-channel 32×32 layers (v14, v15), the stem's forward was the only call of ResNet-18 and MobileNetV2
on the shifted path, and its warm-up job cost 1.7 s of compile CPU of a cold start, for a layer
that runs 0.94 ms on it against 1.27 ms on im2col (3→64 @32×32, batch 32, two threads, median of
25; a stem needs no backward-data). 0.3 ms a step is 15 ms over the README's one-epoch command."""

WINOGRAD_MIN_CHANNELS = 64
WINOGRAD_MAX_PIXELS = 256
"""3×3 stride-1 forward and backward-data (v10) and weight gradient (v11) with at least
``WINOGRAD_MIN_CHANNELS`` input and output channels on planes of at most ``WINOGRAD_MAX_PIXELS``
(16×16) take the Winograd path; the weight gradient's figures are in ``conv_winograd``'s docstring.
Two threads, batch 32, wall ms v9 / v10 with MKL's sgemm (kernels/README.md): 128 @16×16 forward
7.37 / 6.26, backward-data 7.47 / 6.55; 256 @8×8 8.84 / 5.96, 9.34 / 6.16; 512 @4×4 9.05 / 7.02,
9.43 / 7.55; but 64 @32×32 7.63 / 7.97, 8.04 / 8.09 (on OpenBLAS it was 11.4 / 8.6: v9's GEMMs
gained more from MKL than the transforms allow Winograd to), so 32×32 and larger planes (not
measured) keep the shifted GEMMs, as do narrower layers (ResNet's 3-channel stem)."""

WINOGRAD_MAX_PIXELS_OPENBLAS = 1024
"""v12: forward and backward-data take Winograd up to 32×32 planes when the kernels' sgemm is OpenBLAS
(``blas.select_sgemm``: ``ENGINE_BLAS=auto`` on AMD, or ``ENGINE_BLAS=openblas``). Whether Winograd
wins at 32×32 is a question of how fast the shifted path's GEMMs run, i.e. of the BLAS, not of the
CPU's vendor as such: on the Intel machine of earlier sessions v9 / v10 at 64 @32×32 was 11.41 /
8.62 ms forward and 11.57 / 8.66 backward-data on OpenBLAS but 7.63 / 7.97 and 8.04 / 8.09 on MKL
(kernels/README.md). On the AMD EPYC (Zen 4, OpenBLAS), two threads, batch 32, wall ms, median of
7 rounds of best-of-5, shifted / Winograd / torch alternating (``quiesce`` before each block):
forward 15.35 / **9.68** / 16.46, backward-data 15.35 / **9.56** / 16.93; the weight gradient
15.24 / 15.16 / 18.95 (level: it keeps the shifted GEMMs, ``WINOGRAD_MAX_PIXELS``). Larger planes
were not measured and keep the shifted GEMMs."""

WINOGRAD4_MIN_PIXELS = 256
WINOGRAD4_MAX_CHANNELS = 256
"""v14: forward and backward-data of 3×3 stride-1 convs with 64–256 channels in and out on planes of
16×16 to 32×32 run Winograd F(4×4, 3×3) (``conv_winograd4.py``: 2.25 multiplies per output instead
of F(2×2)'s 4) when the sgemm is OpenBLAS (measured there only). Two threads, batch 32, AMD EPYC,
wall ms, median of 5 rounds of best-of-5, F(2×2) v13 → F(4×4): 64 @32×32 forward 10.19 → 7.67,
backward-data 10.49 → 7.79; 128 @16×16 9.86 → 7.95, 9.33 → 7.84; but 256 @8×8 9.57 → 9.04,
9.62 → 9.29 (within this machine's noise: stays F(2×2)) and 512 @4×4 10.76 → 14.74, 11.44 → 14.94
(36 GEMMs against a 36 MiB U). Its rounding error is larger: max abs error against the float64
reference, batch 2, outputs of magnitude ~5: 2.9e-5 / 3.7e-5 at 64 @32×32 / 128 @16×16, against
F(2×2)'s 1.7e-6 / 2.2e-6 (relative ~7e-6: still far inside float32 training noise).
v15: the weight gradient of the same layers too (``conv_winograd4.backward_weight``): 64 @32×32
15.51 → 11.25 ms (it was on the shifted GEMMs), 128 @16×16 10.56 → 9.09 (F(2×2))."""

WINOGRAD_LARGE_MAX_PIXELS = 56 * 56
"""v41 (issue 32), ``Paths.winograd_large_planes``: 3×3 stride-1 planes up to 56×56 (ImageNet ResNet-18's four
64-channel layer1 convolutions, ~25% of its step's flops, on the shifted GEMMs before) take F(2×2) forward and
backward-data and F(4×4) weight gradient, with OpenBLAS. The 32×32 limit was the largest plane measured (v12, v14), not
a measured loss; the transforms are blocked by tile rows and take any plane.

Measured (``benchmarks/conv_ab.py --models resnet18 --image-size 224 --versions 40 40 --set winograd_large_planes=1
[winograd4=0] --threads 2``; batch 32, 2026-11-27, AMD EPYC, quiet, ms per call, shifted → new): forward 45.8 → 28.5
(F(2×2)); backward-data 46.2 → 20.0 (F(4×4)) or 44.8 → 27.3 (F(2×2)); weight 45.9 → 25.6 (F(4×4)); the four layers'
share of a step 551.6 → 296.0 ms with F(4×4) backward-data. Backward-data stays on F(2×2) (unless
``Paths.winograd4_large_data``: ``ENGINE_CONV=fast``): F(4×4)'s backward-data is what carries ``auto``'s gradient error
(``CONV_MODES``), and at 224 ``auto`` sits at issue 32's 2× goal already; 28 ms a step is the price."""

STEM_STRIDED_MIN_KERNEL = 7
"""v42 (issue 32): the ImageNet stems' own columns (v39, path "stem-strided") are kept for the 7×7 forward only, and
the padded polyphase transform (v40) for forward and backward-data only; the other directions went back to im2col.
Measured, ``benchmarks/conv_ab.py --image-size 224 --versions 38 39`` / ``39 40`` (batch 32, two threads, ms per call,
2026-11-27, AMD EPYC, quiet), im2col → v39/v40: ResNet-18 3→64 7×7 s2 forward 75.6 → 70.1 (kept), weight 68.0 → 83.0;
MobileNetV2 3→32 3×3 s2 forward 8.8 → 11.5, weight 12.1 → 14.5; 256→512 3×3 s2 @14 forward 22.7 → 23.3 (kept: level,
and its compile job is the transform's, which the layer's backward-data needs anyway), backward-data 23.0 → 21.1 (kept),
weight 21.4 → 27.5. PyTorch's on the same records (``engine kernels --ops conv2d --compare torch --image-size 224``):
7×7 weight 71.7, 3×3 stem 35.6 / 21.4, 256→512 weight 20.2. The price: the 224 warm-up compiles im2col's forward and
weight-gradient jobs again (the weight job 4.9 s of a worker's CPU, ``benchmarks/first_run.py --jobs --imagenet``): the
ImageNet first run, cold − warm, 18.2 → 19.35 s (``first_run.py --runs 2 --imagenet``, same day), paid back after ~50
steps of ResNet-18 at batch 32 (~24 ms a step).

v47 (``Paths.stem_phases``): with the columns copied from a phase-split image and the weight gradient in one transposed
sgemm per block (``conv_stem._phase_images``) both stems' weight gradients take "stem-strided" again (7×7 69.1 → 50.3
ms, 3×3 12.2 → 11.4 ms against im2col); the 3×3 stem's forward stays on im2col (9.3 against 11.0 ms), so this limit
now holds for the forward only."""

WINOGRAD4_WEIGHT_MIN_PIXELS = 64
"""The F(4×4) weight gradient also wins on 8×8 planes, where forward and backward-data do not: 256 @8×8,
two threads, wall ms, F(2×2) → F(4×4) (torch), two runs: 10.30 → 9.23, 10.21 → 8.93 (11.64); forward
9.57 → 9.04 and 10.14 → 10.43 (9.64), backward-data 9.62 → 9.29 and 11.37 → 13.33 (10.53)."""

WINOGRAD4_MIN_PIXELS_8X8 = 64
"""v18: forward and backward-data take F(4×4) on 8×8 planes too (``Paths.winograd4_8x8``), once its
input and output transforms ran over a whole block of tiles instead of one tile row at a time
(``conv_winograd4._input_transform``: the input transform, one thread, 16 images, 4.5 → 2.1 ms at
64 @32×32, 4.1 → 1.3 at 128 @16×16, 3.4 → 0.9 at 256 @8×8). Two threads, batch 32, AMD EPYC
(OpenBLAS), wall ms, median of 7 rounds of best-of-5, the table (F(2×2)) against F(4×4) alternating:
256 @8×8 forward 10.35 → 7.46, backward-data 10.38 → 7.95; 512 @4×4 still F(2×2): 11.06 → 13.00 and
12.15 → 13.58 (36 GEMMs of 16 columns per thread against a 36 MiB U)."""


WINOGRAD4_BY_K_MIN_PIXELS = 16
WINOGRAD4_BY_K_MAX_PIXELS = 64
"""v34: forward and backward-data of 3×3 stride-1 convs with ≥ 64 channels on planes of 4×4 to 8×8
run F(4×4) split by output channel (``conv_winograd4.forward_by_k``), each block's filters transformed
where its GEMMs read them. Measurements in ``forward_by_k``'s docstring and kernels/README.md."""


WINOGRAD_BY_XI_MAX_PIXELS = 16
"""v23: forward and backward-data of F(2×2) on planes of at most this many pixels (4×4: ResNet-18's
512-channel layers) split the work across the threads by Winograd position ξ instead of by tiles
(``conv_winograd.forward_by_xi``: each thread reads half of the 16 MiB U once, for all 128 tiles,
instead of all of it for its 64). Two threads, batch 32, 512 @4×4, wall ms, median of 15 calls, four
alternating rounds, two runs, tiles → by ξ: forward 9.71 → 9.35, 9.37 → 8.97, 9.51 → 9.05,
9.49 → 9.12, 9.38 → 9.00, 9.90 → 9.11, 9.65 → 9.27, 9.57 → 9.25; backward-data 10.07 → 9.47,
9.89 → 9.52, 9.77 → 9.63, 9.87 → 9.65, 10.33 → 9.85, 10.07 → 9.58, 10.23 → 9.86, 10.04 → 9.61
(−4%). On 8×8 planes it lost (256 @8×8 F(2×2), forward 7.42–7.79 → 7.85–8.62 ms): there U is 4 MiB
and the tile split's GEMMs already read it from cache."""

WINOGRAD_BY_XI_FORWARD_MAX_PIXELS = 49
"""The F(2×2) forward splits by ξ (``conv_winograd.forward_by_xi``) on planes of at most this many pixels: 4×4 and
7×7, the 512-channel layers of ResNet-18 at 32×32 and at 224×224, where U is 16 MiB. Same bits as the tiles (each
output is one GEMM column's dot product). Two threads, ms, median of 5 rounds of best-of-15 (2026-11-28, quiet),
tiles → by ξ: batch 32 512 @4×4 9.86 → 9.38, 512 @7×7 32.51 → 29.07; batch 128 34.92 → 33.70 and 123.73 → 112.24;
batch 8 at 7×7 9.57 → 8.95 (one round). Its scratch at 7×7, batch 32: 24 → 32 MiB (one block of 16 MiB of V and M,
``by_xi_block_rows``). v38 had taken the forward off it to save a compile job; since the block loops are Python loops
over compiled pieces (the module docstring) it compiles nothing the tiles do not (its GEMMs are ``gemm_list``)."""

WINOGRAD_S2_MIN_PIXELS = 64
"""v28 (``Paths.winograd_s2``): the stride-2 3×3 forward with ≥ ``WINOGRAD_MIN_CHANNELS`` channels in and out on
input planes of at least this many pixels (8×8: ResNet-18's 64→128, 128→256 and 256→512) by the polyphase
Winograd transform (``conv_winograd_s2``: 25 instead of 36 multiplies per 2×2 output tile, the transforms as
flat loops over a block of tiles; on 8×8 inputs the threads split by output channel), with OpenBLAS.

Two threads, batch 32, wall ms, median of 5–7 alternating rounds of best-of-7, im2col (v26) → v28: 64→128
@32×32 8.21 → 6.52, 128→256 @16×16 7.27 → 6.10, 256→512 @8×8 6.93 → 6.33. Against PyTorch
(``engine kernels --ops conv2d --compare torch --no-versions --repeat 7 --models resnet18``, main and this
tree alternating): kernels/README.md's v28 row.

Cold compile (fresh ``NUMBA_CACHE_DIR``, the path's first call alone): 3.24–3.44 s of CPU (``_images`` with both
transforms inlined 2.63–2.77 s, ``_filter_transform`` 0.31 s), against 3.26–3.41 s for v26's slower module, whose
3.2 s for −5 to −10% kept it off then. Of it, the input transform's row copies cost ~0.75 s and the output
transform ~0.7 s (each compiled out, one at a time): vectorized loops are what LLVM spends its time on. ResNet-18's
first-run warm-up pool (``engine.warmup.ensure_compiled`` of its 20 → 21 jobs, empty cache, two workers,
alternating): 11.75, 11.94, 12.36 s → 13.31, 14.12, 14.16 s, i.e. +1.6 to +2.2 s on the README command's
cold − warm, which was ~14 s against a goal of ≤ 15 s. Exported all the same: the merged tree's README command
measured cold − warm 14.88 and 15.35 s against 12.22 and 13.12 s for the session's start (alternating, one
sitting), a cost paid once against 1–1.5 ms on each of three layers in every step (kernels/README.md, "The records
and the first run with v27–v30"); ``Paths(winograd_s2=False)`` gives the seconds back. The warm-up's workers
now start at the top of ``engine train`` (``engine.warmup.start_workers``): cold − warm median 13.6 s."""


WINOGRAD_S2_WEIGHT_MIN_PIXELS = 256
"""v32 (``Paths.winograd_s2_backward``): backward-data of the same stride-2 layers as v28's forward, and their weight
gradient on inputs of at least this many pixels (16×16: 64→128 and 128→256), by the polyphase transform transposed
(``conv_winograd_s2.backward_data``, ``backward_weight``); 256→512 @8×8's weight gradient (1.16× torch on im2col)
was not faster on it and stayed on im2col. Figures in ``conv_winograd_s2``'s v32 section.

v37 (``Paths.winograd_s2_weight_8x8``) takes that weight gradient onto the polyphase transform too, from
``WINOGRAD_S2_MIN_PIXELS`` like the forward: measured again after v33–v35 it is level or ahead (two threads,
median of 5 rounds of best-of-7 after ``quiesce``, ms, im2col → polyphase: batch 32 7.10 → 6.98, batch 128
28.08 → 25.20), and with v36 it leaves ResNet-18 with no layer on im2col, so a first run compiles none of its
drivers (kernels/README.md's v37 row)."""


def s2_padded(x_shape, w_shape, stride: int, pad: int, groups: int) -> bool:
    """v40: a 3×3 stride-2 pad-1 conv whose planes are not multiples of 4 (ImageNet ResNet-18's 256→512 @14×14), run
    by the polyphase transform on the input embedded in the next multiple of 4 (16×16) with zeros.

    Why it is exact: output (oy, ox) reads input rows and columns 2·oy − 1 … 2·oy + 1 ≤ H for oy < OH, and rows ≥ H
    are the padding's zeros in both problems, so the padded conv's first OH × OW outputs are the conv's; backward-data
    keeps dx's first H × W of the padded dx (the rest lands on the zeros), the weight gradient sums over zero douts
    beyond OH × OW. The copies are NumPy slices into the caller's scratch: nothing new to compile (the transform's
    kernels are those of the layers on multiples of 4, whose warm-up job ResNet-18 has at every size).

    What it is for: 256→512 @14×14 was ResNet-18's (224×224) last layer on im2col, whose three jobs (forward,
    backward-data, weight gradient) are the largest compile work of a cold first run (kernels/README.md, v36, v37).
    Cost: the GEMMs run on 8×8 outputs instead of 7×7 (1.31× the tiles) at 25/36 of im2col's multiplies (0.91×
    im2col's work), plus three to four copies of the batch's planes. Whether that is at least level with im2col on the
    step is for ``benchmarks/conv_ab.py --image-size 224 --versions 39 40`` to say on a quiet machine."""
    return (
        groups == 1 and stride == 2 and pad == 1 and w_shape[2] == 3 and w_shape[3] == 3
        and (x_shape[2] % 4 != 0 or x_shape[3] % 4 != 0) and x_shape[2] >= 2 and x_shape[3] >= 2
    )


def _s2_padded_shapes(x_shape, w_shape) -> tuple[tuple, tuple]:
    """(the input's, the output's) shapes on the padded planes (``s2_padded``)."""
    height, width = -(-x_shape[2] // 4) * 4, -(-x_shape[3] // 4) * 4
    return (x_shape[0], x_shape[1], height, width), (x_shape[0], w_shape[0], height // 2, width // 2)


def _s2_pad(scratch, x_shape, w_shape):
    """The padded input-side and output-side arrays at the start of ``scratch``, and the rest of it."""
    padded, out_padded = _s2_padded_shapes(x_shape, w_shape)
    a, b = int(np.prod(padded)), int(np.prod(out_padded))
    return scratch[:a].reshape(padded), scratch[a : a + b].reshape(out_padded), scratch[a + b :]


def _embed(src, dst) -> None:
    """dst = src in its top-left corner, zeros elsewhere."""
    h, w = src.shape[2], src.shape[3]
    dst[:, :, :h, :w] = src
    dst[:, :, h:, :] = 0.0
    dst[:, :, :h, w:] = 0.0


@dataclass(frozen=True)
class Paths:
    """Which fast paths a call may take (the study versions switch them off one by one)."""

    depthwise_flat: bool = True
    pointwise_tiles: bool = True
    shifted: bool = True
    depthwise_kept_only: bool = True
    small_tiles: bool = True
    pointwise_per_image: bool = True
    pointwise_gather: bool = True
    winograd: bool = True
    winograd_weight: bool = True
    narrow_weight_im2col: bool = True
    winograd_32x32_openblas: bool = True
    winograd_data_transposed: bool = True
    winograd4: bool = True
    winograd4_weight: bool = True
    pointwise_weight_in_place: bool = True
    narrow_im2col: bool = True
    winograd4_8x8: bool = True
    im2col_weight_in_place: bool = True
    depthwise_weight_groups: bool = True
    depthwise_planes: bool = True
    winograd_by_xi: bool = True
    depthwise_registers: bool = True
    winograd_s2: bool = True  # v28 (off before: WINOGRAD_S2_MIN_PIXELS says why)
    stem_weight_split: bool = True
    pointwise_weight_split: bool = True
    pointwise_small_gemms: bool = True
    winograd_s2_small_gemms: bool = True
    winograd4_small_gemms: bool = True
    pointwise_weight_transposed: bool = True  # v31
    winograd4_by_k: bool = True  # v34
    winograd4_weight_by_k: bool = True  # v35
    winograd_s2_backward: bool = True  # v32
    pointwise_strided: bool = True  # v33
    stem_columns: bool = True  # v36
    winograd_s2_weight_8x8: bool = True  # v37
    float32_forward: bool = True  # v38: no F(4×4) forward (``CONV_MODES``)
    stem_strided: bool = True  # v39: the ImageNet stems on their own columns (``conv_stem``)
    winograd_s2_padded: bool = True  # v40: the polyphase transform on planes that are not multiples of 4
    winograd_large_planes: bool = True  # v41: 3×3 stride-1 planes up to 56×56 on Winograd (``WINOGRAD_LARGE_…``)
    winograd4_large_data: bool = False  # with it, F(4×4) backward-data on them too (``ENGINE_CONV=fast``)
    imagenet_measured: bool = True  # v42: v39/v40 directions that lost to im2col go back (``STEM_STRIDED_…``)
    winograd_by_xi_forward: bool = True  # v43: the F(2×2) forward by ξ on ≤ 7×7 (``WINOGRAD_BY_XI_FORWARD_MAX_PIXELS``)
    depthwise_planes_large_s2: bool = True  # v44: depthwise stride-2 forwards on ≥ 80×80 plane by plane, not direct
    depthwise_imagenet_planes: bool = True  # v45: depthwise plane by plane from 14×14, weight by groups from 7×7
    pointwise_pixel_blocks: bool = True  # v46: 1×1 GEMMs on ≥ 56×56 planes cut into pixels (all directions)
    stem_phases: bool = True  # v47: the strided stems' columns from a phase-split image; their weight gradients too


CONV_MODES = ("auto", "exact", "fast")
"""``ENGINE_CONV``'s values: which rounding the 3×3 stride-1 convolutions may trade for speed.

- ``auto`` (the default): every **forward** is float32-GEMM-level (v38: F(2×2) Winograd, the shifted GEMMs,
  im2col or the polyphase stride-2 transform, never F(4×4)); backward-data and the weight gradient keep F(4×4)
  where it is fastest. The forward decides every ReLU mask and max-pool winner, backward decides none: this is
  the precision promise of the design (DESIGN.md, "Precision": F(4×4) only where its error cannot change a
  decision of the forward pass).
- ``exact``: no F(4×4) in any direction; every conv is float32-GEMM-level forward *and* backward (backward-data and
  weight gradient on F(2×2), the shifted GEMMs or im2col). For comparing gradients against another float32
  framework or a float64 run term by term.
- ``fast``: F(4×4) wherever it is fastest, forward included (v34–v37's paths): its forward rounds 4–10× more
  than a float32 GEMM and flips a few ReLU masks per ResNet-18 step whose inputs lie within its rounding of 0.

"float32-GEMM-level" here: relative error (‖y − y₆₄‖ / ‖y₆₄‖ against float64) at most 2× that of a float32
im2col GEMM on the same data, at ResNet-18's layer shapes (``tests/kernels/cpu/test_conv_precision.py``;
measured 1.0–1.9× for F(2×2), 0.8–1.0× for the shifted and polyphase paths, 4.0–9.6× for F(4×4): the table in
kernels/README.md, "Rounding per path", from ``benchmarks/conv_precision.py``).

Why ``auto`` is the default: it keeps the design's precision promise at the least cost. F(2×2)'s forward was
measured 1.3× F(4×4)'s on the layers it takes back (batch 32, two threads, v14/v18's figures in
``WINOGRAD4_MIN_PIXELS`` and ``WINOGRAD4_MIN_PIXELS_8X8``: 64 @32×32 10.19 vs 7.67 ms, 128 @16×16 9.86 vs 7.95,
256 @8×8 10.35 vs 7.46), i.e. ~+30 ms on a CIFAR ResNet-18 step of ~440 ms if all four stages pay it; what it
costs at batch 32 and at 224×224 next to PyTorch is for the quiet machine's ``bench_train`` and
``conv_precision --time`` to confirm (kernels/README.md gives the commands). ``exact`` costs more (F(4×4)'s
backward-data and weight gradients were 1.2–1.4× faster than F(2×2)'s and the shifted GEMMs'), ``fast`` less.
A cold first run: ``auto`` compiles one job more than ``fast`` (the F(2×2) forward), ``exact`` the fewest
(kernels/README.md, "What each mode compiles"): if the step shows ``exact`` within the speed goals, it is the better
default (the gradients' goal too), and this function's default is the one line to change.

Which F(4×4) direction carries ``auto``'s gradient error (issue 32's goal: one ResNet-18 step's gradients against
float64 with the engine's own ReLU masks, ≤ 2× PyTorch float32's error; ``benchmarks/conv_precision.py --gradients
--modes …``, the table in kernels/README.md, "Rounding per path"): **backward-data**. CIFAR, batch 8, three seeds:
``auto`` 3.66–3.69×, F(4×4) in backward-data only 3.36–3.40×, in the weight gradient only 1.89–1.90×, ``exact``
1.23–1.25×; batch 32: 3.38×, 3.17×, 1.46×, 0.85×. A backward-data error reaches every gradient below its layer (the
worst tensor is the stem's BN), a weight gradient's stays in its tensor; no backward-data layer can keep F(4×4) (its
by-k layers alone 3.17×, its tiled ones alone 3.57×). At ImageNet sizes ``auto`` is at the goal's edge (112×112,
batch 8 1.96×; 224×224 batch 4 2.04×, batch 8 1.73×; 2026-11-28, with the twin's max pool taking the engine's
winners, batch 4, three seeds: 2.02–2.10×, 1.71–1.79× with 512 @7's backward-data off F(4×4), kernels/README.md),
F(4×4) in the weight gradient only 0.83–1.16×: PyTorch float32's own error is larger there and 64 @56 never takes
F(4×4) backward-data (v41: 2.09× with 64 @56 on Winograd, 2.04× without, batch 4). The mix "F(4×4) in the weight
gradient only" (``Paths(winograd4=False, winograd4_by_k=False)``) meets the goal everywhere measured, and gives up
F(4×4)'s backward-data: 13 calls of a CIFAR step (64 @32, 128 @16, 256 @8, 512 @4), 9 at 224 (128 @28, 256 @14, 512 @7),
estimated from the per-layer figures above at ~+40 ms on a ~600 ms CIFAR step at batch 32 (half of ``exact``'s
cost). Timed (``bench_train --conv-paths auto|weight4|exact``, ResNet-18 batch 32, quiet, medians; kernels/README.md
has the runs): 32×32 73.2 / 68.8 / 61.1 img/s (PyTorch 50.65: 0.69×, 0.74×, 0.83× its step), 224×224 16.9 / 15.35 /
15.45 (PyTorch 14.3). weight4 would take the CIFAR step past issue 32's 0.70× goal, so ``auto`` keeps F(4×4) backward.

Tried and dropped: other interpolation points for F(4×4, 3×3) than Lavin's 0, ±1, ±2. A float32 simulation of 2-D
tiles (64 channels, |N(0, 1)| half-zero inputs, He weights; error × a float32 direct sum's): Lavin's 4.1×;
0, ±1, ±1/2 4.4×; 0, ±1, 1/2, −2 2.9×; 0, ±1, 2, −1/2 3.1×; 0, ±1/2, ±2 3.0×; 0, ±1, ±3/2 4.8×; 0, ±1, ±2/3 4.9×: at
best ~30% less error, nowhere near float32's, not worth rewriting ``conv_winograd4``'s hand-unrolled transforms."""


MODE_SUMMARY = {
    "auto": "float32-GEMM-level forwards, F(4×4) backward where fastest",
    "exact": "float32-GEMM-level in every direction",
    "fast": "F(4×4) wherever fastest, forward included",
}
"""One line per ``CONV_MODES`` value, for ``engine info``."""


def conv_mode() -> str:
    """``ENGINE_CONV`` (``CONV_MODES``; unset or empty: ``auto``): the one place it is read."""
    from kernels.errors import SettingError

    wanted = os.environ.get("ENGINE_CONV", "auto").strip().lower() or "auto"
    if wanted not in CONV_MODES:
        raise SettingError(f"ENGINE_CONV={wanted!r} is not one of {', '.join(CONV_MODES)}: set one of those, "
                           "or unset it for auto")
    return wanted


def paths_for(mode: str) -> Paths:
    """The paths the kernel table runs in ``mode`` (``CONV_MODES``)."""
    if mode == "fast":
        return Paths(float32_forward=False, winograd4_large_data=True)
    if mode == "exact":
        return Paths(winograd4=False, winograd4_weight=False, winograd4_by_k=False, winograd4_weight_by_k=False)
    if mode == "auto":
        return Paths()
    raise ValueError(f"{mode!r} is not one of {', '.join(CONV_MODES)}")


MODE = conv_mode()
"""This process's ``ENGINE_CONV`` (read once, at import: the kernels' paths may not change under a plan)."""

EXPORTED = paths_for(MODE)
"""What the kernel table runs: every function with a ``paths`` argument reads it when given none, at the call
(``use_paths``)."""


def use_paths(paths: Paths) -> None:
    """Make ``paths`` the kernel table's from now on, in this process only: for benchmarks that compare mixes of
    paths which are no ``ENGINE_CONV`` mode (``benchmarks/conv_precision.py --gradients``: F(4×4) in one backward
    direction only). Call it before a network plans its workspaces: scratch sized for other paths fails its check.
    Everything that routes a conv without naming its paths follows it (``path``, ``workspace_size``, the warm-up's
    jobs, the kernels themselves)."""
    global EXPORTED
    EXPORTED = paths


# ----------------------------------------------------------------------------------------------
# Planning: which path, how many images per tile, and how much scratch that needs
# ----------------------------------------------------------------------------------------------


def images_per_tile(
    x_shape, w_shape, stride: int, pad: int, groups: int, target_columns: int = TARGET_COLUMNS, threads: int = 1
) -> int:
    """Images unrolled together into one column tile (1 = one image at a time)."""
    n = -(-x_shape[0] // threads)
    oh, ow = check_conv2d_shapes(x_shape, w_shape, stride, pad, groups)
    rows = w_shape[1] * w_shape[2] * w_shape[3]
    pixels = oh * ow
    wanted = -(-target_columns // pixels)
    fits = max(1, TILE_BUDGET_ELEMENTS // (rows * pixels))
    return max(1, min(n, wanted, fits))


def is_depthwise(x_shape, w_shape, groups: int) -> bool:
    return groups > 1 and groups == x_shape[1] and groups == w_shape[0]


def _is_plain_1x1(w_shape, stride: int, pad: int) -> bool:
    return w_shape[2] == 1 and stride == 1 and pad == 0


def _is_strided_1x1(w_shape, stride: int, pad: int, groups: int) -> bool:
    """v33's shapes: a 1×1 conv (groups 1, pad 0) at stride 2, ResNet's downsample shortcuts."""
    return groups == 1 and w_shape[2] == 1 and w_shape[3] == 1 and stride == 2 and pad == 0


def path(x_shape, w_shape, stride: int, pad: int, groups: int, direction: str, paths: Paths | None = None) -> str:
    """The kernel a call runs: "depthwise-registers" (v25), "depthwise-planes", "depthwise-groups",
    "depthwise-flat", "depthwise-direct", "winograd4", "winograd4-by-k" (v34), "winograd4-weight-by-k" (v35),
    "winograd-s2" (v28; backward-data and weight gradient v32), "winograd", "winograd-by-xi" (v23), "shifted",
    "pointwise" (v27:
    forward and backward-data of a 1×1 stride-1 conv in row blocks), "pointwise-weight-split" (v27: its
    weight gradient on ≥ 16×16 planes split over dW, ``conv_pointwise``), "pointwise-weight-transposed" (v31:
    that weight gradient on smaller planes as NN GEMMs), "pointwise-strided" (v33: a 1×1 stride-2 conv in every
    direction on its kept pixels, ``conv_pointwise``), "stem" (v36: the forward and weight gradient of a 3×3
    stride-1 conv of ≤ 4 input channels, ``conv_stem``), "stem-strided" (v39: those of a strided conv of ≤ 4 input
    channels, the ImageNet stems, ``conv_stem``) or "gemm" (im2col).

    The three depthwise kernels of ``conv_depthwise`` are separate paths (warm-up compiles one job per
    path and direction): "depthwise-planes" (forward and backward-data plane by plane, ≥ 16×16),
    "depthwise-groups" (the weight gradient by image groups, ≥ 8×8), "depthwise-flat" (chunk runs);
    "depthwise-registers" takes the 4×4 to 32×32 square planes before them all (``conv_depthwise_regs``)."""
    paths = EXPORTED if paths is None else paths  # read at the call: ``use_paths``
    if is_depthwise(x_shape, w_shape, groups):
        if paths.depthwise_registers and conv_depthwise_regs.supported(x_shape, w_shape, stride, pad):
            return "depthwise-registers"
        planes_s2 = paths.depthwise_planes and paths.depthwise_planes_large_s2  # v44: large s2 forwards plane by plane
        if paths.depthwise_flat and conv_depthwise.supported(x_shape, w_shape, stride, pad, direction, planes_s2):
            imagenet = paths.depthwise_imagenet_planes  # v45
            if (direction == "weight" and paths.depthwise_weight_groups
                    and conv_depthwise.by_groups(x_shape, stride, imagenet)):
                return "depthwise-groups"
            if (direction != "weight" and paths.depthwise_planes
                    and conv_depthwise.plane_by_plane(x_shape, stride, imagenet)):
                return "depthwise-planes"
            return "depthwise-flat"
        return "depthwise-direct"
    if direction != "weight" and paths.pointwise_small_gemms and groups == 1 and _is_plain_1x1(w_shape, stride, pad):
        return "pointwise"
    if direction != "data" and paths.stem_columns and conv_stem.supported(x_shape, w_shape, stride, pad, groups):
        return "stem"
    if (
        direction != "data" and paths.stem_strided
        and conv_stem.strided_supported(x_shape, w_shape, stride, pad, groups)
        and not (paths.imagenet_measured and w_shape[2] < STEM_STRIDED_MIN_KERNEL and direction == "forward")
        and not (paths.imagenet_measured and not paths.stem_phases and direction == "weight")
    ):
        return "stem-strided"
    if paths.pointwise_strided and _is_strided_1x1(w_shape, stride, pad, groups):
        return "pointwise-strided"
    if (
        direction == "weight" and paths.pointwise_weight_transposed
        and groups == 1 and _is_plain_1x1(w_shape, stride, pad)
        and conv_pointwise.takes_transposed(x_shape)
    ):
        return "pointwise-weight-transposed"
    if (
        direction == "weight" and paths.pointwise_weight_split
        and x_shape[2] * x_shape[3] >= conv_pointwise.WEIGHT_SPLIT_MIN_PIXELS
        and _pointwise_weight_in_place(x_shape, w_shape, stride, pad, groups)
    ):
        return "pointwise-weight-split"
    if (
        conv_winograd4.supported(x_shape, w_shape, stride, pad, groups)
        and WINOGRAD_MIN_CHANNELS <= min(w_shape[0], w_shape[1])
        and WINOGRAD4_BY_K_MIN_PIXELS <= x_shape[2] * x_shape[3] <= WINOGRAD4_BY_K_MAX_PIXELS
        and blas.select_sgemm() == blas.OPENBLAS
    ):  # F(4×4) by output channel: forward and backward-data (v34), the weight gradient where it fits (v35)
        if direction != "weight" and paths.winograd4_by_k and not (direction == "forward" and paths.float32_forward):
            return "winograd4-by-k"
        if direction == "weight" and paths.winograd4_weight_by_k and conv_winograd4.by_k_weight_fits(x_shape, w_shape):
            return "winograd4-weight-by-k"
    if (
        (paths.winograd4_weight if direction == "weight"
         else paths.winograd4 and not (direction == "forward" and paths.float32_forward))
        and conv_winograd4.supported(x_shape, w_shape, stride, pad, groups)
        and WINOGRAD_MIN_CHANNELS <= min(w_shape[0], w_shape[1])
        and max(w_shape[0], w_shape[1]) <= WINOGRAD4_MAX_CHANNELS
        and (WINOGRAD4_WEIGHT_MIN_PIXELS if direction == "weight"
             else WINOGRAD4_MIN_PIXELS_8X8 if paths.winograd4_8x8 else WINOGRAD4_MIN_PIXELS)
        <= x_shape[2] * x_shape[3]
        <= (WINOGRAD_LARGE_MAX_PIXELS
            if paths.winograd_large_planes and (direction != "data" or paths.winograd4_large_data)
            else WINOGRAD_MAX_PIXELS_OPENBLAS)
        and blas.select_sgemm() == blas.OPENBLAS
    ):
        return "winograd4"
    if (
        (paths.winograd_s2 if direction == "forward" else paths.winograd_s2_backward)
        and (conv_winograd_s2.supported(x_shape, w_shape, stride, pad, groups)
             or paths.winograd_s2_padded and not (paths.imagenet_measured and direction == "weight")
             and s2_padded(x_shape, w_shape, stride, pad, groups))
        and min(w_shape[0], w_shape[1]) >= WINOGRAD_MIN_CHANNELS
        and x_shape[2] * x_shape[3]
        >= (WINOGRAD_S2_MIN_PIXELS if direction != "weight" or paths.winograd_s2_weight_8x8
            else WINOGRAD_S2_WEIGHT_MIN_PIXELS)
        and blas.select_sgemm() == blas.OPENBLAS
    ):
        return "winograd-s2"
    if (
        (paths.winograd_weight if direction == "weight" else paths.winograd)
        and conv_winograd.supported(x_shape, w_shape, stride, pad, groups)
        and min(w_shape[0], w_shape[1]) >= WINOGRAD_MIN_CHANNELS
        and x_shape[2] * x_shape[3] <= winograd_max_pixels(direction, paths)
    ):
        if paths.winograd_by_xi and x_shape[2] * x_shape[3] <= _by_xi_max_pixels(direction, paths):
            return "winograd-by-xi"
        return "winograd"
    if (
        paths.shifted
        and conv_shifted.supported(x_shape, w_shape, stride, pad, groups)
        and x_shape[2] * x_shape[3] >= SHIFTED_MIN_PIXELS
        and (
            x_shape[1] >= SHIFTED_MIN_CHANNELS
            or not (paths.narrow_weight_im2col if direction == "weight" else paths.narrow_im2col)
        )
    ):
        return "shifted"
    return "gemm"


def _by_xi_max_pixels(direction: str, paths: Paths) -> int:
    """The largest plane an F(2×2) call splits by ξ (v23) in ``direction`` (-1: none): backward-data ≤ 4×4; forward ≤
    7×7 since v43 (``WINOGRAD_BY_XI_FORWARD_MAX_PIXELS``), none in v38–v42 (``float32_forward``), ≤ 4×4 before."""
    if direction == "data":
        return WINOGRAD_BY_XI_MAX_PIXELS
    if direction == "forward" and paths.winograd_by_xi_forward:
        return WINOGRAD_BY_XI_FORWARD_MAX_PIXELS
    return WINOGRAD_BY_XI_MAX_PIXELS if direction == "forward" and not paths.float32_forward else -1


def winograd_max_pixels(direction: str, paths: Paths | None = None, sgemm: str | None = None) -> int:
    """The largest plane (pixels) a 3×3 stride-1 conv takes Winograd on: 32×32 for forward and
    backward-data when the kernels' sgemm (``sgemm``, default the process's) is OpenBLAS
    (``WINOGRAD_MAX_PIXELS_OPENBLAS``), else 16×16 (``WINOGRAD_MAX_PIXELS``)."""
    paths = EXPORTED if paths is None else paths  # read at the call: ``use_paths``
    if direction != "weight" and paths.winograd_32x32_openblas:
        if (sgemm if sgemm is not None else blas.select_sgemm()) == blas.OPENBLAS:
            return WINOGRAD_LARGE_MAX_PIXELS if paths.winograd_large_planes else WINOGRAD_MAX_PIXELS_OPENBLAS
    return WINOGRAD_MAX_PIXELS


def gemm_tile_images(
    x_shape, w_shape, stride, pad, groups, direction: str, threads: int, target: int, per_image: bool = True,
    weight_in_place: bool = False, im2col_in_place: bool = False,
) -> int:
    """Images per column tile of the im2col path for one thread's share of the batch."""
    if per_image and _pointwise_per_image(x_shape, w_shape, stride, pad, groups, direction):
        return 1
    if weight_in_place and direction == "weight" and _pointwise_weight_in_place(x_shape, w_shape, stride, pad, groups):
        return 1
    if im2col_in_place and direction == "weight" and _im2col_weight_in_place(x_shape, w_shape, stride, pad, groups):
        return 1
    tile = images_per_tile(x_shape, w_shape, stride, pad, groups, target, threads)
    images_per_set = -(-x_shape[0] // threads)
    if direction == "weight" and tile < images_per_set:
        # a second tile needs a dw-sized partial sum; when that is bigger than the columns of the
        # whole set (deep layers: 512·4608 weights, 16 pixels an image), take the whole set at once
        oh, ow = check_conv2d_shapes(x_shape, w_shape, stride, pad, groups)
        rows = w_shape[1] * w_shape[2] * w_shape[3]
        if (w_shape[0] // groups) * rows >= rows * oh * ow * images_per_set:
            tile = images_per_set
    return tile


def _pointwise_per_image(x_shape, w_shape, stride, pad, groups, direction: str) -> bool:
    """A 1×1 stride-1 conv as one GEMM per image, in place on NCHW (no gather, no scatter), where that
    measured faster than stacking images into a tile: the side the tile copies is the wide one.

    Forward (out = W·x, C the reduction): when C ≥ 4K; backward-data (dx = Wᵀ·dout, dx the C-row
    side the tile scatters): when C ≥ 2K; both only on planes of ≥ 64 pixels. Two threads, batch 32,
    median of 7 calls, ms, tiles → per image: forward 384→64 @8×8 0.89 → 0.75, 384→96 @8×8 1.04 →
    0.91, but 96→576 @8×8 1.23 → 2.13 and 960→160 @4×4 1.08 → 1.14; backward-data 384→64 @8×8
    1.16 → 0.65, 384→96 1.34 → 0.84. Rechecked with idle threads before each timing (best of 7,
    median of 3 alternating rounds): forward 384→64 0.87 → 0.67, 384→96 0.99 → 0.84; backward-data
    192→64 0.63 → 0.27, 384→64 1.14 → 0.59, 384→96 1.23 → 0.84, 576→96 1.78 → 1.13.
    On 4×4 planes (16-column GEMMs) backward-data went both ways: 960→160 2.01 → 1.48 and 576→160
    1.24 → 0.89, but 960→320 2.63 → 5.01 and 320→1280 2.28 → 3.69, so 4×4 keeps its tiles. The
    weight gradient was slower per image everywhere (its inner dimension is the plane), so it
    keeps its tiles.
    """
    if groups != 1 or not _is_plain_1x1(w_shape, stride, pad):
        return False
    k, c, pixels = w_shape[0], w_shape[1], x_shape[2] * x_shape[3]
    if pixels < 64:
        return False
    if direction == "forward":
        return c >= 4 * k
    return direction == "data" and c >= 2 * k


def _pointwise_weight_in_place(x_shape, w_shape, stride, pad, groups) -> bool:
    """The weight gradient of a 1×1 stride-1 conv on planes of ≥ 64 pixels as one GEMM per image,
    ``dW += dout_n @ x_nᵀ`` (β = 1, ``conv_shifted.sgemm``) read in place from NCHW (v16).

    Why. The tiles (v5–v11) gathered x and dout into [C, 1024-column] tiles (a copy of both inputs)
    and added each tile's GEMM result into dW from a partial (np.dot has no β); per image, BLAS
    accumulates and nothing is copied. One thread, 16 images, ms, tiles → per image (GFLOP/s):
    144→32 @16×16 0.89 → 0.37, 32→192 @16×16 0.69 → 0.33, 384→64 @8×8 0.51 → 0.34, 384→96 @8×8
    0.62 → 0.46, 24→144 @32×32 (one-image tiles already: the partial add only) 1.18 → 1.08; but
    4×4 planes (a 16-deep GEMM per image) lost: 960→160 0.49 → 0.55, 160→960 0.49 → 0.47,
    320→1280 1.18 → 1.26, so they keep their tiles (same process, alternating, AMD EPYC Zen 4).
    One-image tiles of larger planes take β = 1 too (no partial to add)."""
    return groups == 1 and _is_plain_1x1(w_shape, stride, pad) and x_shape[2] * x_shape[3] >= 64


IM2COL_WEIGHT_IN_PLACE_MIN_PIXELS = 256
"""v20: the im2col weight gradient (not a plain 1×1) with output planes of at least this many pixels."""


def _im2col_weight_in_place(x_shape, w_shape, stride, pad, groups) -> bool:
    """The weight gradient of an im2col conv (groups 1, not a plain 1×1) whose output plane has ≥ 256
    pixels (16×16) as one image's im2col then one β = 1 sgemm into dW per image (v20), as v16 does
    for plain 1×1: no gathered dout tile, no partial sum to add per tile.

    Why. Tiles of several images (``WEIGHT_TARGET_COLUMNS``, 4096 columns) copied dout into the tile
    and added each tile's K × C·R·S result from a partial; on the stems (27 columns of result) the
    GEMM is small and those copies were most of the call. One thread, 16 images, median of 5 rounds of
    best-of-7, ms, tiles → per image: 3→32 3×3 @32×32 0.86 → 0.34, 3→64 1.28 → 1.16, 64→128 1×1 s2
    @32×32 1.31 → 1.13, 64→128 3×3 s2 @32×32 8.23 → 7.94; but on 8×8 outputs (64-deep GEMMs per
    image) it lost: 128→256 1×1 s2 @16×16 0.88 → 0.90, 256→512 1×1 s2 @8×8 0.79 → 1.03, 128→256 3×3
    s2 @16×16 7.45 → 8.06, 256→512 3×3 s2 @8×8 7.37 → 10.03, so those keep their tiles. Batch 32,
    two threads, median of 7 alternating rounds of best-of-7, ms v17 → v20: 3→32 @32×32 1.24 → 0.67,
    3→64 1.51 → 1.41, 64→128 1×1 s2 @32×32 1.30 → 1.22, 64→128 3×3 s2 @32×32 8.57 → 8.62 (level)."""
    if groups != 1 or _is_plain_1x1(w_shape, stride, pad):
        return False
    oh, ow = check_conv2d_shapes(x_shape, w_shape, stride, pad, groups)
    return oh * ow >= IM2COL_WEIGHT_IN_PLACE_MIN_PIXELS


STEM_WEIGHT_K_BLOCK = 32
STEM_WEIGHT_MAX_ROWS = 32


def stem_weight_k_block(x_shape, w_shape, stride, pad, groups) -> int:
    """v26: output channels per sgemm of the in-place im2col weight gradient (0: all in one), 32 where the
    GEMM's result is narrow (C·R·S ≤ ``STEM_WEIGHT_MAX_ROWS``: the 3-channel stems, 27 columns).

    Why. ``dW (K × 27) += dout_n (K × P) @ cols_nᵀ`` ran at ~100 GFLOP/s with K = 32 but ~56 with K = 64
    or 128 (OpenBLAS, one thread, P = 1024, the same call split into 32-row GEMMs: 99.7 and 100.4),
    so ResNet-18's 3→64 stem weight gradient took 1.33 ms (two threads, batch 32) against PyTorch's
    0.84. Two threads, batch 32, wall ms, median of 5–9 alternating rounds of best-of-7, v23 → v26, four
    sittings: 1.295 → 0.755, 1.332 → 0.759, 1.333 → 0.780, 1.332 → 0.780. Not wider results: every in-place
    im2col weight gradient in 32-channel GEMMs lost (64→128 1×1 s2 @32×32, 64 columns, 1.20 → 1.43; 64→128
    3×3 s2, 576 columns, 8.31 → 10.49), and 16-channel GEMMs for the stems were no better (3→64 0.78).
    3→32 (MobileNetV2's stem) is one 32-channel GEMM already; its record (0.47–0.74 ms in one sitting, the
    same code) moves with where the pool's thread lands, not with the kernel. The same signature of
    ``_backward_weight_images`` as before (one more int64 argument): no new compilation."""
    if groups != 1 or w_shape[1] * w_shape[2] * w_shape[3] > STEM_WEIGHT_MAX_ROWS:
        return 0
    return STEM_WEIGHT_K_BLOCK if w_shape[0] > STEM_WEIGHT_K_BLOCK else 0


def gemm_workspace_size(
    x_shape, w_shape, stride, pad, groups, direction: str, threads: int, tile: int, weight_in_place: bool = False,
    im2col_in_place: bool = False,
) -> int:
    """Scratch of the im2col path: per thread a column tile, a K-side tile (when it holds several
    images) and, for the weight gradient, a partial dw when a thread has several tiles (none where
    a 1×1 one-image tile accumulates in place); plus one dw-sized partial sum per extra thread."""
    oh, ow = check_conv2d_shapes(x_shape, w_shape, stride, pad, groups)
    rows = w_shape[1] * w_shape[2] * w_shape[3]
    k_group = w_shape[0] // groups
    columns = tile * oh * ow
    cols = 0 if (_is_plain_1x1(w_shape, stride, pad) and tile == 1) else rows * columns
    k_side = k_group * columns if tile > 1 else 0
    size = cols + k_side
    if direction == "weight":
        images_per_set = -(-x_shape[0] // threads)
        in_place = tile == 1 and (
            (weight_in_place and _is_plain_1x1(w_shape, stride, pad))
            or (im2col_in_place and _im2col_weight_in_place(x_shape, w_shape, stride, pad, groups))
        )
        size += k_group * rows if tile < images_per_set and not in_place else 0
        return threads * size + (threads - 1) * int(np.prod(w_shape))
    return threads * size


def _target(w_shape, direction: str, paths: Paths) -> int:
    if paths.pointwise_tiles and w_shape[2] == 1 and w_shape[3] == 1:
        return POINTWISE_WEIGHT_TARGET_COLUMNS if direction == "weight" else POINTWISE_TARGET_COLUMNS
    if direction == "weight":
        return WEIGHT_TARGET_COLUMNS
    return SMALL_TARGET_COLUMNS if paths.small_tiles else TARGET_COLUMNS


def workspace_size(
    x_shape, w_shape, stride: int, pad: int, groups: int, direction: str, paths: Paths | None = None
) -> int:
    """Scratch (float32 elements) for one direction ("forward", "data", "weight") of the chosen path."""
    paths = EXPORTED if paths is None else paths  # read at the call: ``use_paths``
    x_shape, w_shape = tuple(x_shape), tuple(w_shape)
    kind = path(x_shape, w_shape, stride, pad, groups, direction, paths)
    threads = get_num_threads()
    if kind == "depthwise-groups":
        return conv_depthwise.weight_workspace_size(x_shape, stride)
    if kind in ("depthwise-flat", "depthwise-planes"):
        return conv_depthwise.workspace_size(x_shape, stride)
    if kind in ("depthwise-direct", "depthwise-registers", "pointwise", "pointwise-weight-split"):
        return 0
    if kind == "pointwise-weight-transposed":
        return conv_pointwise.transposed_workspace_size(x_shape, w_shape, threads)
    if kind == "pointwise-strided":
        return conv_pointwise.strided_workspace_size(x_shape, w_shape, stride, direction, threads)
    if kind in ("stem", "stem-strided"):
        partials = (threads - 1) * int(np.prod(w_shape)) if direction == "weight" else 0
        return conv_stem.workspace_size(x_shape, threads, w_shape, stride, pad) + partials
    if kind == "winograd" and direction == "weight":
        rows = conv_winograd.weight_block_rows(x_shape, w_shape[1], w_shape[0])
        return conv_winograd.weight_workspace_size(x_shape, w_shape, threads, rows)
    if kind == "winograd":
        return conv_winograd.workspace_size(x_shape, w_shape, direction, threads)
    if kind == "winograd-by-xi":
        return conv_winograd.by_xi_workspace_size(x_shape, w_shape, direction, threads)
    if kind == "winograd-s2" and s2_padded(x_shape, w_shape, stride, pad, groups):
        padded, out_padded = _s2_padded_shapes(x_shape, w_shape)
        inner = workspace_size(padded, w_shape, stride, pad, groups, direction, paths)
        return inner + int(np.prod(padded)) + int(np.prod(out_padded))
    if kind == "winograd-s2" and direction == "data":
        return conv_winograd_s2.data_workspace_size(x_shape, w_shape, threads)
    if kind == "winograd-s2" and direction == "weight":
        return conv_winograd_s2.weight_workspace_size(x_shape, w_shape, threads)
    if kind == "winograd-s2":
        return conv_winograd_s2.workspace_size(x_shape, w_shape, threads)
    if kind == "winograd4-by-k":
        return conv_winograd4.by_k_workspace_size(x_shape, w_shape, direction, threads)
    if kind == "winograd4-weight-by-k":
        return conv_winograd4.by_k_weight_workspace_size(x_shape, w_shape, threads)
    if kind == "winograd4" and direction == "weight":
        rows = conv_winograd4.weight_block_rows(x_shape, w_shape[1], w_shape[0])
        return conv_winograd4.weight_workspace_size(x_shape, w_shape, threads, rows)
    if kind == "winograd4":
        c_in, c_out = (w_shape[0], w_shape[1]) if direction == "data" else (w_shape[1], w_shape[0])
        rows = conv_winograd4.block_rows(x_shape, c_in, c_out, threads)
        return conv_winograd4.workspace_size(x_shape, w_shape, direction, threads, rows)
    if kind == "shifted":
        return conv_shifted.workspace_size(x_shape, w_shape, direction, threads)
    tile = gemm_tile_images(
        x_shape, w_shape, stride, pad, groups, direction, threads, _target(w_shape, direction, paths),
        paths.pointwise_per_image, paths.pointwise_weight_in_place, paths.im2col_weight_in_place,
    )
    return gemm_workspace_size(
        x_shape, w_shape, stride, pad, groups, direction, threads, tile, paths.pointwise_weight_in_place,
        paths.im2col_weight_in_place,
    )


def conv2d_forward_workspace_size(x_shape, w_shape, stride: int, pad: int, groups: int) -> int:
    """Scratch (float32 elements) for ``conv2d_forward``."""
    return workspace_size(x_shape, w_shape, stride, pad, groups, "forward")


def conv2d_backward_data_workspace_size(x_shape, w_shape, stride: int, pad: int, groups: int) -> int:
    """Scratch for ``conv2d_backward_data``."""
    return workspace_size(x_shape, w_shape, stride, pad, groups, "data")


def conv2d_backward_weight_workspace_size(x_shape, w_shape, stride: int, pad: int, groups: int) -> int:
    """Scratch for ``conv2d_backward_weight`` (includes a dw-sized partial sum per extra thread)."""
    return workspace_size(x_shape, w_shape, stride, pad, groups, "weight")


# ----------------------------------------------------------------------------------------------
# Tile movers: im2col, col2im, gather and scatter between NCHW and a [channels, tile pixels] tile
# ----------------------------------------------------------------------------------------------


@njit(cache=True, nogil=True, inline="always")
def valid_outputs(size: int, out_size: int, offset: int, stride: int, pad: int) -> tuple[int, int]:
    """Output positions o in [lo, hi) whose input o·stride + offset − pad lies inside [0, size)."""
    lo = 0
    shift = pad - offset
    if shift > 0:
        lo = (shift + stride - 1) // stride
    hi = (size - 1 + pad - offset) // stride + 1 if size - 1 + pad - offset >= 0 else 0
    if hi > out_size:
        hi = out_size
    if hi < lo:
        hi = lo
    return lo, hi


@njit(cache=True, nogil=True, inline="always")
def im2col_row(x, n0, images, c0, stride, pad, kernel, out_h, out_w, cols, row):
    """One row of the column tile: channel c, offset (r, s), for every output pixel of every image.

    Flat views and unsigned offsets, as in the depthwise kernels: no wrap-around checks, so the
    stride-1 copy vectorizes. A row start may be "−1" (column s − pad < 0); unsigned arithmetic
    wraps modulo 2⁶⁴ and the first valid column (x_lo ≥ 1 there) brings it back in range.
    """
    channels, height, width = x.shape[1], x.shape[2], x.shape[3]
    pixels = out_h * out_w
    c = row // (kernel * kernel)
    r = (row // kernel) % kernel
    s = row % kernel
    y_lo, y_hi = valid_outputs(height, out_h, r, stride, pad)
    x_lo, x_hi = valid_outputs(width, out_w, s, stride, pad)
    src, dst = x.reshape(x.size), cols.reshape(cols.size)
    line0 = uint64(row * cols.shape[1])
    if stride == 1 and out_w == width and y_lo < y_hi and x_lo < x_hi:
        row_same(src, dst, n0, images, channels, c0 + c, height, width, r - pad, s - pad, line0, pixels)
        return
    for i in range(images):
        plane = uint64(((n0 + i) * channels + c0 + c) * height * width)
        line = line0 + uint64(i * pixels)
        for y in range(out_h):
            out_row = line + uint64(y * out_w)
            if y < y_lo or y >= y_hi:
                for ox in range(out_w):
                    dst[out_row + uint64(ox)] = 0.0
                continue
            in_row = plane + uint64((y * stride + r - pad) * width + s - pad)
            for ox in range(x_lo):
                dst[out_row + uint64(ox)] = 0.0
            if stride == 1:
                for ox in range(x_lo, x_hi):
                    dst[out_row + uint64(ox)] = src[in_row + uint64(ox)]
            else:
                for ox in range(x_lo, x_hi):
                    dst[out_row + uint64(ox)] = src[in_row + uint64(ox * stride)]
            for ox in range(x_hi, out_w):
                dst[out_row + uint64(ox)] = 0.0


@njit(cache=True, nogil=True, inline="always")
def col2im_plane(dcols, n0, c0, stride, pad, kernel, out_h, out_w, dx, c, i):
    """dx[n0 + i, c0 + c] = the sum of the R·S column rows that read from this plane, in a fixed order.

    Overwrites the entries of ``dcols`` that fall off the plane (scratch, read by no one after)."""
    channels, height, width = dx.shape[1], dx.shape[2], dx.shape[3]
    pixels = out_h * out_w
    src, dst = dcols.reshape(dcols.size), dx.reshape(dx.size)
    plane = uint64(((n0 + i) * channels + c0 + c) * height * width)
    for k in range(height * width):
        dst[plane + uint64(k)] = 0.0
    same = stride == 1 and out_w == width
    for r in range(kernel):
        y_lo, y_hi = valid_outputs(height, out_h, r, stride, pad)
        for s in range(kernel):
            x_lo, x_hi = valid_outputs(width, out_w, s, stride, pad)
            line = uint64(((c * kernel + r) * kernel + s) * dcols.shape[1] + i * pixels)
            if same and y_lo < y_hi and x_lo < x_hi:
                # As in columns.row_same: one flat run per offset. The wrapped-around column's
                # entries (taps off the plane) are zeroed in dcols first, so they add nothing.
                for y in range(y_lo, y_hi):
                    row_start = line + uint64(y * width)
                    for ox in range(x_lo):
                        src[row_start + uint64(ox)] = 0.0
                    for ox in range(x_hi, width):
                        src[row_start + uint64(ox)] = 0.0
                first = y_lo * width + x_lo
                last = (y_hi - 1) * width + x_hi
                read_from = line + uint64(first)
                add_to = plane + uint64(first + (r - pad) * width + s - pad)
                for q in range(last - first):
                    dst[add_to + uint64(q)] += src[read_from + uint64(q)]
                continue
            for y in range(y_lo, y_hi):
                in_row = line + uint64(y * out_w)
                out_row = plane + uint64((y * stride + r - pad) * width + s - pad)
                if stride == 1:
                    for ox in range(x_lo, x_hi):
                        dst[out_row + uint64(ox)] += src[in_row + uint64(ox)]
                else:
                    for ox in range(x_lo, x_hi):
                        dst[out_row + uint64(ox * stride)] += src[in_row + uint64(ox)]


@njit(cache=True, nogil=True)
def im2col_tile_serial(x, n0, images, c0, stride, pad, kernel, out_h, out_w, cols):
    """im2col of images [n0, n0 + images), channels from c0, into ``cols`` on the calling thread (``im2col_row``
    inlined: compiled here once, not on its own and again in each caller)."""
    for row in range(cols.shape[0]):
        im2col_row(x, n0, images, c0, stride, pad, kernel, out_h, out_w, cols, row)


@njit(cache=True, nogil=True)
def col2im_tile_serial(dcols, n0, images, c0, channels, stride, pad, kernel, out_h, out_w, dx):
    """col2im of a tile into dx, plane by plane on the calling thread (``col2im_plane`` inlined)."""
    for job in range(channels * images):
        col2im_plane(dcols, n0, c0, stride, pad, kernel, out_h, out_w, dx, job // images, job % images)


@njit(cache=True, nogil=True)
def gather_tile(a, n0, images, k0, tile):
    """tile[k, i·P + p] = a[n0 + i, k0 + k, p] (a seen as N×K×P): channels of several images side by side.

    Flat loops rather than slice assignment: a slice assignment pulls in Numba's shape-mismatch
    error formatting, 2.3 s of compilation on a cold cache for this four-line function."""
    channels, pixels = a.shape[1], a.shape[2] * a.shape[3]
    src, dst = a.reshape(a.size), tile.reshape(tile.size)
    width = uint64(tile.shape[1])
    for k in range(tile.shape[0]):
        for i in range(images):
            s0 = uint64(((n0 + i) * channels + k0 + k) * pixels)
            d0 = uint64(k) * width + uint64(i * pixels)
            for p in range(pixels):
                dst[d0 + uint64(p)] = src[s0 + uint64(p)]


@njit(cache=True, nogil=True)
def scatter_tile(tile, n0, images, k0, a):
    """The inverse of gather_tile: a[n0 + i, k0 + k, p] = tile[k, i·P + p]."""
    channels, pixels = a.shape[1], a.shape[2] * a.shape[3]
    src, dst = tile.reshape(tile.size), a.reshape(a.size)
    width = uint64(tile.shape[1])
    for k in range(tile.shape[0]):
        for i in range(images):
            d0 = uint64(((n0 + i) * channels + k0 + k) * pixels)
            s0 = uint64(k) * width + uint64(i * pixels)
            for p in range(pixels):
                dst[d0 + uint64(p)] = src[s0 + uint64(p)]


@njit(parallel=True, cache=True, nogil=True)
def add_bias(out, bias):
    n, k = out.shape[0], out.shape[1]
    for job in prange(n * k):
        plane = out[job // k, job % k]
        plane += bias[job % k]


@njit(parallel=True, cache=True, nogil=True)
def bias_gradient(dout, dbias):
    """dbias[k] = Σ_{n, p} dout[n, k, p]: one channel per parallel iteration, summed in a fixed order."""
    n, k = dout.shape[0], dout.shape[1]
    for kk in prange(k):
        total = 0.0
        for i in range(n):
            total += dout[i, kk].sum()
        dbias[kk] = total


# ----------------------------------------------------------------------------------------------
# The im2col path: one parallel region per call, each thread owns a share of the images and its tiles
# ----------------------------------------------------------------------------------------------


def _forward_images(x, w, out, stride, pad, groups, first, last, tile_images, scratch, gather=True):
    """Images [first, last) on the calling thread: serial im2col, single-threaded GEMM. A Python loop over
    compiled pieces (the module docstring, "Compiled pieces, Python drivers")."""
    k_total, c_group, kernel = w.shape[0], w.shape[1], w.shape[2]
    out_h, out_w = out.shape[2], out.shape[3]
    pixels = out_h * out_w
    k_group = k_total // groups
    rows = c_group * kernel * kernel
    plain_1x1 = kernel == 1 and stride == 1 and pad == 0
    gathered = plain_1x1 and gather  # v9: a 1×1 tile is a gather/scatter, not im2col/col2im
    for n0 in range(first, last, tile_images):
        images = min(tile_images, last - n0)
        columns = images * pixels
        for g in range(groups):
            w_g = w[g * k_group : (g + 1) * k_group].reshape(k_group, rows)
            if plain_1x1 and images == 1:
                cols = x[n0, g * c_group : (g + 1) * c_group].reshape(c_group, pixels)
            elif gathered:  # every column is one pixel: a gather (v9)
                cols = scratch[: rows * columns].reshape(rows, columns)
                gather_tile(x, n0, images, g * c_group, cols)
            else:
                cols = scratch[: rows * columns].reshape(rows, columns)
                im2col_tile_serial(x, n0, images, g * c_group, stride, pad, kernel, out_h, out_w, cols)
            if images == 1:
                gemm(w_g, cols, out[n0, g * k_group : (g + 1) * k_group].reshape(k_group, pixels))
            else:
                start = rows * columns
                result = scratch[start : start + k_group * columns].reshape(k_group, columns)
                gemm(w_g, cols, result)
                scatter_tile(result, n0, images, g * k_group, out)


def gemm_forward(x, w, out, stride, pad, groups, tile_images, threads, scratch, gather: bool = True) -> None:
    """Chunk c: images [c·N/C, (c+1)·N/C), run by whichever thread is free, with that thread's scratch
    slice (``threads.run_chunks``; C from ``threads.chunk_count``)."""
    n_images, share = x.shape[0], scratch.size // threads
    chunks = chunk_count(n_images, tile_images, threads)

    def work(c: int, slot: int) -> None:
        first, last = c * n_images // chunks, (c + 1) * n_images // chunks
        mine = scratch[slot * share : (slot + 1) * share]
        _forward_images(x, w, out, stride, pad, groups, first, last, tile_images, mine, gather)

    run_chunks(work, chunks, threads)


def _backward_data_images(dout, w, dx, stride, pad, groups, first, last, tile_images, scratch, gather=True):
    """dx of images [first, last) on the calling thread: GEMM, then col2im (a scatter for 1×1). A Python loop over
    compiled pieces, as ``_forward_images``."""
    k_total, c_group, kernel = w.shape[0], w.shape[1], w.shape[2]
    out_h, out_w = dout.shape[2], dout.shape[3]
    pixels = out_h * out_w
    k_group = k_total // groups
    rows = c_group * kernel * kernel
    plain_1x1 = kernel == 1 and stride == 1 and pad == 0
    gathered = plain_1x1 and gather  # v9: a 1×1 tile is a gather/scatter, not im2col/col2im
    for n0 in range(first, last, tile_images):
        images = min(tile_images, last - n0)
        columns = images * pixels
        for g in range(groups):
            w_g = w[g * k_group : (g + 1) * k_group].reshape(k_group, rows)
            if images == 1:
                d_tile = dout[n0, g * k_group : (g + 1) * k_group].reshape(k_group, pixels)
            else:
                d_tile = scratch[: k_group * columns].reshape(k_group, columns)
                gather_tile(dout, n0, images, g * k_group, d_tile)
            if plain_1x1 and images == 1:
                gemm(w_g, d_tile, dx[n0, g * c_group : (g + 1) * c_group].reshape(c_group, pixels), trans_a=True)
            else:
                start = k_group * columns if images > 1 else 0
                dcols = scratch[start : start + rows * columns].reshape(rows, columns)
                gemm(w_g, d_tile, dcols, trans_a=True)
                if gathered:  # every column is one pixel: a scatter, not a sum (v9)
                    scatter_tile(dcols, n0, images, g * c_group, dx)
                else:
                    col2im_tile_serial(dcols, n0, images, g * c_group, c_group, stride, pad, kernel, out_h, out_w,
                                       dx)


def gemm_backward_data(dout, w, dx, stride, pad, groups, tile_images, threads, scratch, gather: bool = True) -> None:
    n_images, share = dx.shape[0], scratch.size // threads
    chunks = chunk_count(n_images, tile_images, threads)  # as gemm_forward: each chunk writes its own images

    def work(c: int, slot: int) -> None:
        first, last = c * n_images // chunks, (c + 1) * n_images // chunks
        mine = scratch[slot * share : (slot + 1) * share]
        _backward_data_images(dout, w, dx, stride, pad, groups, first, last, tile_images, mine, gather)

    run_chunks(work, chunks, threads)


def _backward_weight_images(
    x, dout, acc, stride, pad, groups, first, last, tile_images, scratch, gather=True, in_place=True,
    im2col_in_place=False, k_block=0,
):
    """acc = Σ over images [first, last) of dout_tile @ cols_tile.T, tile after tile in order. A Python loop over
    compiled pieces, as ``_forward_images`` (compiled, with every variant below inside, this was the largest job of
    a cold 224 first run: 2.55 s of CPU on its own, ``im2col_row`` again inside).

    in_place (v16): a 1×1 stride-1 one-image tile is one GEMM with β = 1 straight into acc;
    im2col_in_place (v20): so is any other one-image tile, on its im2col columns."""
    k_total, c_group, kernel = acc.shape[0], acc.shape[1], acc.shape[2]
    out_h, out_w = dout.shape[2], dout.shape[3]
    pixels = out_h * out_w
    k_group = k_total // groups
    rows = c_group * kernel * kernel
    plain_1x1 = kernel == 1 and stride == 1 and pad == 0
    gathered = plain_1x1 and gather  # v9: a 1×1 tile is a gather/scatter, not im2col/col2im
    if first >= last:
        acc[...] = 0.0
    c_total = x.shape[1]
    x_flat, d_flat, acc_flat = x.reshape(x.size), dout.reshape(dout.size), acc.reshape(acc.size)
    scalars = np.empty(2, np.float32)
    for n0 in range(first, last, tile_images):
        images = min(tile_images, last - n0)
        columns = images * pixels
        for g in range(groups):
            if in_place and plain_1x1 and images == 1:  # v16: dW_g += dout_n @ x_nᵀ, β = 1 in BLAS
                sgemm(
                    False, True, k_group, c_group, pixels,
                    d_flat[(n0 * k_total + g * k_group) * pixels :], pixels,
                    x_flat[(n0 * c_total + g * c_group) * pixels :], pixels,
                    0.0 if n0 == first else 1.0, acc_flat[g * k_group * rows :], rows, scalars,
                )  # fmt: skip
                continue
            if im2col_in_place and images == 1:  # v20: dW_g += dout_n @ cols_nᵀ, β = 1 in BLAS
                cols = scratch[: rows * pixels].reshape(rows, pixels)
                im2col_tile_serial(x, n0, images, g * c_group, stride, pad, kernel, out_h, out_w, cols)
                # v26: k_block output channels per GEMM (0: all of them; see STEM_WEIGHT_K_BLOCK)
                step = k_group if k_block <= 0 else k_block
                for k0 in range(0, k_group, step):
                    sgemm(
                        False, True, min(step, k_group - k0), rows, pixels,
                        d_flat[(n0 * k_total + g * k_group + k0) * pixels :], pixels, scratch, pixels,
                        0.0 if n0 == first else 1.0, acc_flat[(g * k_group + k0) * rows :], rows, scalars,
                    )  # fmt: skip
                continue
            used = 0
            if plain_1x1 and images == 1:
                cols = x[n0, g * c_group : (g + 1) * c_group].reshape(c_group, pixels)
            else:
                cols = scratch[: rows * columns].reshape(rows, columns)
                if gathered:  # every column is one pixel: a gather (v9)
                    gather_tile(x, n0, images, g * c_group, cols)
                else:
                    im2col_tile_serial(x, n0, images, g * c_group, stride, pad, kernel, out_h, out_w, cols)
                used = rows * columns
            if images == 1:
                d_tile = dout[n0, g * k_group : (g + 1) * k_group].reshape(k_group, pixels)
            else:
                d_tile = scratch[used : used + k_group * columns].reshape(k_group, columns)
                gather_tile(dout, n0, images, g * k_group, d_tile)
                used += k_group * columns
            acc_g = acc[g * k_group : (g + 1) * k_group].reshape(k_group, rows)
            if n0 == first:
                gemm(d_tile, cols, acc_g, trans_b=True)
            else:
                partial = scratch[used : used + k_group * rows].reshape(k_group, rows)
                gemm(d_tile, cols, partial, trans_b=True)
                acc_g += partial


@njit(cache=True, nogil=True)
def add_partials(total, partials, count, lo, hi):
    """total[i] = (…((total[i] + partials[0·L + i]) + partials[1·L + i]) + …) (``count`` slots of
    len(total)), i in [lo, hi): slot after slot, each a flat vector loop on unsigned offsets.

    Written first as one pass over i with the slots summed in an inner loop (the same additions in
    the same order, so the same bits): its signed slot offsets kept it scalar, 0.72–0.82 ms for
    MobileNetV2's 320→1280 dw (410k floats, one slot) at one or two threads, a quarter of that
    weight gradient's call."""
    length = uint64(total.size)
    end = uint64(hi)
    for t in range(count):
        base = uint64(t) * length
        for i in range(uint64(lo), end):
            total[i] += partials[base + i]


def gemm_backward_weight(
    x, dout, dw, stride, pad, groups, tile_images, threads, scratch, gather: bool = True, in_place: bool = True,
    im2col_in_place: bool = False, k_block: int = 0,
) -> None:
    """Thread 0 sums into dw, thread t > 0 into its own dw-sized slot; the slots are then added in
    thread order (each thread adds a fixed range of dw).

    Tried and dropped (issue 13): the caller adding every slot alone for dw of ≤ 512k floats, no second
    hand-out. Alone, the sum was far cheaper (two threads, median of 20 calls, µs, split / caller alone:
    4608 floats 19–33 / 1, 36864 37 / 3, 153600 60–75 / 16, 409600 47–92 / 40), but in the call it did not
    show: the 22 1×1 weight gradients, batch 32, two threads, best of 7 after a NumPy sgemm, 3 rounds
    alternating in one process: geometric mean 0.97× (144→32 @16×16 0.66–0.69 → 0.81–0.91 ms, 64→384 @8×8
    0.66–0.68 → 0.62, the rest within noise)."""
    sum_image_shares(
        dw, scratch, threads, x.shape[0],
        lambda first, last, acc, mine: _backward_weight_images(
            x, dout, acc, stride, pad, groups, first, last, tile_images, mine, gather, in_place, im2col_in_place,
            k_block,
        ),
    )  # fmt: skip


def pointwise_strided_backward_weight(x, dout, dw, stride: int, threads: int, scratch) -> None:
    """v33: dW of a strided 1×1 conv (``conv_pointwise.strided_weight``) in image shares (``sum_image_shares``);
    scratch as ``conv_pointwise.strided_workspace_size``."""
    count = conv_pointwise.strided_weight_images(x.shape, dout.shape[2] * dout.shape[3], threads)
    sum_image_shares(
        dw, scratch, threads, x.shape[0],
        lambda first, last, acc, mine: conv_pointwise.strided_weight(x, dout, acc, first, last, stride, count, mine),
    )


def sum_image_shares(dw, scratch, threads: int, n_images: int, share) -> None:
    """A weight gradient summed over images by the threads: thread t calls ``share(first, last, acc, mine)`` for
    images [t·N/T, (t+1)·N/T) with ``acc`` dw (t = 0) or its own dw-sized slot at the end of ``scratch`` and
    ``mine`` its part of the rest; then the slots are added to dw in thread order, each thread a fixed range
    of dw (``add_partials``): the same bits at a given thread count."""
    slots = (threads - 1) * dw.size
    part = (scratch.size - slots) // threads
    sums = scratch[scratch.size - slots :]

    def work(t: int) -> None:
        acc = dw if t == 0 else sums[(t - 1) * dw.size : t * dw.size].reshape(dw.shape)
        share(t * n_images // threads, (t + 1) * n_images // threads, acc, scratch[t * part : (t + 1) * part])

    run_shares(work, threads)
    if threads > 1:
        flat = dw.reshape(dw.size)
        run_shares(
            lambda t: add_partials(flat, sums, threads - 1, t * flat.size // threads, (t + 1) * flat.size // threads),
            threads,
        )


# ----------------------------------------------------------------------------------------------
# Direct depthwise kernels (groups == C == K): shapes the flat kernels do not take (stride-2 32×32 forward, 5×5 ...)
# ----------------------------------------------------------------------------------------------


@njit(parallel=True, cache=True, nogil=True)
def depthwise_forward(x, w, out, stride, pad):
    """out[n, c] = Σ_{r, s} w[c, 0, r, s] · x_padded[n, c, ...]: one (n, c) plane per parallel iteration.

    The loops run offset-major (r, s outermost) so the innermost loop walks a row of the output
    and, at stride 1, a row of the input: contiguous and vectorizable. Indexing is done on flat
    views with unsigned offsets: a signed index makes Numba check for negative (wrap-around)
    indices on every access, which kept LLVM from vectorizing and cost 3-5× here.
    """
    n, c, height, width = x.shape
    out_h, out_w = out.shape[2], out.shape[3]
    kernel = w.shape[2]
    src, dst, weights = x.reshape(x.size), out.reshape(out.size), w.reshape(w.size)
    for job in prange(n * c):
        ch = job % c
        src0, dst0 = uint64(job * height * width), uint64(job * out_h * out_w)
        for i in range(out_h * out_w):
            dst[dst0 + uint64(i)] = 0.0
        for r in range(kernel):
            y_lo, y_hi = valid_outputs(height, out_h, r, stride, pad)
            for s in range(kernel):
                x_lo, x_hi = valid_outputs(width, out_w, s, stride, pad)
                weight = weights[(ch * kernel + r) * kernel + s]
                for y in range(y_lo, y_hi):
                    row_in = src0 + uint64((y * stride + r - pad) * width + s - pad)
                    row_out = dst0 + uint64(y * out_w)
                    if stride == 1:
                        for ox in range(x_lo, x_hi):
                            dst[row_out + uint64(ox)] += weight * src[row_in + uint64(ox)]
                    else:
                        for ox in range(x_lo, x_hi):
                            dst[row_out + uint64(ox)] += weight * src[row_in + uint64(ox * stride)]


@njit(parallel=True, cache=True, nogil=True)
def depthwise_backward_data(dout, w, dx, stride, pad):
    """dx[n, c] gets each output gradient times the weight that read the pixel; one plane per iteration."""
    n, c, height, width = dx.shape
    out_h, out_w = dout.shape[2], dout.shape[3]
    kernel = w.shape[2]
    src, dst, weights = dout.reshape(dout.size), dx.reshape(dx.size), w.reshape(w.size)
    for job in prange(n * c):
        ch = job % c
        src0, dst0 = uint64(job * out_h * out_w), uint64(job * height * width)
        for i in range(height * width):
            dst[dst0 + uint64(i)] = 0.0
        for r in range(kernel):
            y_lo, y_hi = valid_outputs(height, out_h, r, stride, pad)
            for s in range(kernel):
                x_lo, x_hi = valid_outputs(width, out_w, s, stride, pad)
                weight = weights[(ch * kernel + r) * kernel + s]
                for y in range(y_lo, y_hi):
                    row_in = src0 + uint64(y * out_w)
                    row_out = dst0 + uint64((y * stride + r - pad) * width + s - pad)
                    if stride == 1:
                        for ox in range(x_lo, x_hi):
                            dst[row_out + uint64(ox)] += weight * src[row_in + uint64(ox)]
                    else:
                        for ox in range(x_lo, x_hi):
                            dst[row_out + uint64(ox * stride)] += weight * src[row_in + uint64(ox)]


@njit(parallel=True, cache=True, nogil=True, fastmath={"reassoc", "contract"})
def depthwise_backward_weight(x, dout, dw, stride, pad):
    """dw[c, 0, r, s] = Σ_{n, oh, ow} dout · x_padded: one channel per parallel iteration.

    ``reassoc`` lets LLVM split each row's sum over SIMD lanes. The order is then the compiled
    code's, not the source's, but it is the same order on every call: the same bits every run.
    """
    n, c, height, width = x.shape
    out_h, out_w = dout.shape[2], dout.shape[3]
    kernel = dw.shape[2]
    src, grad = x.reshape(x.size), dout.reshape(dout.size)
    for ch in prange(c):
        for r in range(kernel):
            y_lo, y_hi = valid_outputs(height, out_h, r, stride, pad)
            for s in range(kernel):
                x_lo, x_hi = valid_outputs(width, out_w, s, stride, pad)
                total = np.float32(0.0)
                for i in range(n):
                    src0 = uint64((i * c + ch) * height * width)
                    grad0 = uint64((i * c + ch) * out_h * out_w)
                    for y in range(y_lo, y_hi):
                        row_in = src0 + uint64((y * stride + r - pad) * width + s - pad)
                        row_grad = grad0 + uint64(y * out_w)
                        if stride == 1:
                            for ox in range(x_lo, x_hi):
                                total += grad[row_grad + uint64(ox)] * src[row_in + uint64(ox)]
                        else:
                            for ox in range(x_lo, x_hi):
                                total += grad[row_grad + uint64(ox)] * src[row_in + uint64(ox * stride)]
                dw[ch, 0, r, s] = total


# ----------------------------------------------------------------------------------------------
# The table entries: check arguments, pick the path, run it
# ----------------------------------------------------------------------------------------------


def _check_array(name: str, a, shape) -> None:
    if not isinstance(a, np.ndarray):
        raise TypeError(f"conv2d: {name} must be a NumPy array on the cpu backend, got {type(a).__name__}")
    if a.dtype != np.float32:
        raise TypeError(f"conv2d: {name} must be float32, got {a.dtype}; convert with .astype(np.float32)")
    if not a.flags.c_contiguous:
        raise ValueError(f"conv2d: {name} must be C-contiguous; pass np.ascontiguousarray({name})")
    if tuple(a.shape) != tuple(shape):
        raise ValueError(f"conv2d: {name} has shape {tuple(a.shape)}, expected {tuple(shape)}")


def _check_scratch(scratch, needed: int, size_function: str) -> np.ndarray:
    if needed == 0:
        return np.empty(0, np.float32) if scratch is None else scratch.reshape(-1)[:0]
    if scratch is None or scratch.size < needed:
        have = 0 if scratch is None else scratch.size
        raise ValueError(
            f"conv2d: scratch holds {have} float32 elements but this shape needs {needed}; "
            f"size it with {size_function}(x_shape, w_shape, stride, pad, groups)"
        )
    if scratch.dtype != np.float32 or scratch.ndim != 1 or not scratch.flags.c_contiguous:
        raise ValueError("conv2d: scratch must be a 1-D C-contiguous float32 array")
    return scratch


def _check_conv(x_shape, w, stride, pad, groups):
    oh, ow = check_conv2d_shapes(tuple(x_shape), w.shape, stride, pad, groups)
    return (x_shape[0], w.shape[0], oh, ow)


def _set_threads(lib, count: int) -> None:
    """Set a BLAS library's thread count from any thread (see ``_BlasOnCallingThread``)."""
    setter = getattr(lib, "_real_set_num_threads", None) or lib.set_num_threads
    setter(count)


class _BlasOnCallingThread:
    """Run SciPy's OpenBLAS (the one the kernels' ``conv_shifted.sgemm`` calls) single-threaded for a while.

    The kernels call BLAS from inside a parallel loop, one GEMM per Numba thread; a multithreaded BLAS
    there would start threads of its own and oversubscribe the cores. NumPy's own BLAS is a
    different library and is left alone.

    Re-entrant across threads (ParallelInference runs conv calls on several threads at once): the
    first to enter saves the thread counts and sets 1, the last to leave restores them; a per-call
    save/restore let one thread's exit lift the limit under another's running conv. The count is set
    through OpenBLAS's own setter (``_real_set_num_threads``), not threadpoolctl's public one:
    threadpoolctl 3.8 ignores ``set_num_threads`` from every thread but the first that set a limit
    (its "controlling thread", here the main thread's ``--threads``), so a conv entered from a
    worker thread ran its GEMMs on a multithreaded BLAS. The lock and the count above keep our own
    callers coherent, which is what that guard is for.
    """

    def __init__(self) -> None:
        self._libraries = None
        self._saved: list[int] = []
        self._depth = 0
        self._lock = threading.Lock()

    def __enter__(self):
        with self._lock:
            if self._depth == 0:
                if self._libraries is None:
                    blas = ThreadpoolController().select(user_api="blas").lib_controllers
                    scipys = [lib for lib in blas if "scipy" in lib.filepath.replace("\\", "/").split("/")[-2]]
                    self._libraries = scipys or blas  # unknown layout: limit every BLAS, not oversubscribe
                self._saved = [lib.num_threads for lib in self._libraries]
                for lib in self._libraries:
                    _set_threads(lib, 1)
            self._depth += 1
        return self

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._depth -= 1
            if self._depth == 0:
                for lib, threads in zip(self._libraries, self._saved):
                    _set_threads(lib, threads)


blas_on_calling_thread = _BlasOnCallingThread()


def conv2d_forward(x, w, bias, out, stride: int, pad: int, groups: int, scratch) -> None:
    """out = conv2d(x, w) + bias, written into ``out``; scratch sized by conv2d_forward_workspace_size."""
    forward(x, w, bias, out, stride, pad, groups, scratch)


def conv2d_backward_data(dout, w, dx, stride: int, pad: int, groups: int, scratch) -> None:
    """dx = the gradient of conv2d's output ``dout`` with respect to its input."""
    backward_data(dout, w, dx, stride, pad, groups, scratch)


def conv2d_backward_weight(x, dout, dw, dbias, stride: int, pad: int, groups: int, scratch) -> None:
    """dw (and dbias when given) = the gradients of conv2d's output ``dout`` w.r.t. weights and bias."""
    backward_weight(x, dout, dw, dbias, stride, pad, groups, scratch)


def check_forward_args(x, w, bias, out, stride, pad, groups) -> None:
    _check_array("x", x, x.shape)
    _check_array("w", w, w.shape)
    _check_array("out", out, _check_conv(x.shape, w, stride, pad, groups))
    if bias is not None:
        _check_array("bias", bias, (w.shape[0],))


FLIPPED_FORWARD = (
    "pointwise", "pointwise-strided", "winograd4", "winograd4-by-k", "winograd", "winograd-by-xi", "shifted",
)
"""Paths whose backward-data is their forward kernel with the filter flipped (``flipped`` / ``transposed``): one
dispatch for both directions, ``_run_forward_kernel`` (``engine.warmup.SHARED_FORWARD_KERNEL`` gives them one job)."""


def _run_forward_kernel(
    kind: str, src, w, dst, flipped: bool, stride: int, threads: int, scratch, paths: Paths
) -> None:
    """x → out (``flipped`` False) or dout → dx (True) on a ``FLIPPED_FORWARD`` path. Block sizes take the
    source's channels as the input side (x's C forward, dout's K backward) and the conv input's plane (x or dx)."""
    c_src, c_dst = src.shape[1], dst.shape[1]
    plane = dst.shape if flipped else src.shape
    with blas_on_calling_thread:
        if kind == "pointwise":
            conv_pointwise.run_images(src, w, dst, flipped, threads, pixel_blocks=paths.pointwise_pixel_blocks)
        elif kind == "pointwise-strided":
            conv_pointwise.run_images(src, w, dst, flipped, threads, stride=stride, scratch=scratch)
        elif kind == "winograd4-by-k":
            conv_winograd4.forward_by_k(src, w, dst, flipped, threads, scratch)
        elif kind == "winograd4":
            rows = conv_winograd4.block_rows(plane, c_src, c_dst, threads)
            limit = conv_pointwise.SMALL_GEMM_MNK if paths.winograd4_small_gemms else 0  # v30
            conv_winograd4.forward(src, w, dst, flipped, threads, rows, scratch, limit)
        elif kind == "winograd":
            rows = conv_winograd.block_rows(plane, c_src, c_dst, threads)
            transposed = flipped and paths.winograd_data_transposed
            conv_winograd.forward(src, w, dst, flipped, threads, rows, scratch, transposed=transposed)
        elif kind == "winograd-by-xi":
            rows = conv_winograd.by_xi_block_rows(plane, c_src, c_dst)
            conv_winograd.forward_by_xi(src, w, dst, flipped, threads, rows, scratch)
        elif kind == "shifted":
            tile = conv_shifted.tile_images(plane, c_src, threads)
            conv_shifted.forward(src, w, dst, flipped, threads, tile, scratch)
        else:
            raise ValueError(f"{kind!r} is not one of FLIPPED_FORWARD's paths")


def forward(x, w, bias, out, stride, pad, groups, scratch, paths: Paths | None = None) -> None:
    """conv2d_forward with a choice of fast paths (the study versions pass fewer)."""
    paths = EXPORTED if paths is None else paths  # read at the call: ``use_paths``
    stride, pad, groups = int(stride), int(pad), int(groups)
    check_forward_args(x, w, bias, out, stride, pad, groups)
    kind = path(x.shape, w.shape, stride, pad, groups, "forward", paths)
    needed = workspace_size(x.shape, w.shape, stride, pad, groups, "forward", paths)
    scratch = _check_scratch(scratch, needed, "conv2d_forward_workspace_size")[:needed]
    threads = get_num_threads()
    if kind == "depthwise-registers":
        conv_depthwise_regs.run_forward(x, w, out, stride)
    elif kind in ("depthwise-flat", "depthwise-planes"):
        conv_depthwise.run_forward(x, w, out, stride, scratch, paths.depthwise_kept_only, kind == "depthwise-planes")
    elif kind == "depthwise-direct":
        depthwise_forward(x, w, out, stride, pad)
    elif kind in FLIPPED_FORWARD:
        _run_forward_kernel(kind, x, w, out, False, stride, threads, scratch, paths)
    elif kind in ("stem", "stem-strided"):  # v36, v39, v47
        with blas_on_calling_thread:
            conv_stem.forward(x, w, out, threads, scratch, stride, pad, paths.stem_phases)
    elif kind == "winograd-s2" and s2_padded(x.shape, w.shape, stride, pad, groups):  # v40
        x_pad, out_pad, rest = _s2_pad(scratch, x.shape, w.shape)
        _embed(x, x_pad)
        forward(x_pad, w, None, out_pad, stride, pad, groups, rest, paths)
        out[...] = out_pad[:, :, : out.shape[2], : out.shape[3]]
    elif kind == "winograd-s2":
        with blas_on_calling_thread:
            images = conv_winograd_s2.block_images(x.shape, w.shape[1], w.shape[0], threads)
            limit = conv_pointwise.SMALL_GEMM_MNK if paths.winograd_s2_small_gemms else 0  # v29
            conv_winograd_s2.forward(x, w, out, threads, images, scratch, limit)
    else:
        tile = gemm_tile_images(
            x.shape, w.shape, stride, pad, groups, "forward", threads, _target(w.shape, "forward", paths),
            paths.pointwise_per_image,
        )
        with blas_on_calling_thread:
            gemm_forward(x, w, out, stride, pad, groups, tile, threads, scratch, paths.pointwise_gather)
    if bias is not None:
        add_bias(out, bias)


def backward_data(dout, w, dx, stride, pad, groups, scratch, paths: Paths | None = None) -> None:
    """conv2d_backward_data with a choice of fast paths."""
    paths = EXPORTED if paths is None else paths  # read at the call: ``use_paths``
    stride, pad, groups = int(stride), int(pad), int(groups)
    _check_array("dx", dx, dx.shape)
    _check_array("w", w, w.shape)
    _check_array("dout", dout, _check_conv(dx.shape, w, stride, pad, groups))
    kind = path(dx.shape, w.shape, stride, pad, groups, "data", paths)
    needed = workspace_size(dx.shape, w.shape, stride, pad, groups, "data", paths)
    scratch = _check_scratch(scratch, needed, "conv2d_backward_data_workspace_size")[:needed]
    threads = get_num_threads()
    if kind == "depthwise-registers":
        conv_depthwise_regs.run_backward_data(dout, w, dx, stride)
    elif kind in ("depthwise-flat", "depthwise-planes"):
        conv_depthwise.run_backward_data(dout, w, dx, stride, scratch, kind == "depthwise-planes")
    elif kind == "depthwise-direct":
        depthwise_backward_data(dout, w, dx, stride, pad)
    elif kind in FLIPPED_FORWARD:
        _run_forward_kernel(kind, dout, w, dx, True, stride, threads, scratch, paths)
    elif kind == "winograd-s2" and s2_padded(dx.shape, w.shape, stride, pad, groups):  # v40
        dx_pad, dout_pad, rest = _s2_pad(scratch, dx.shape, w.shape)
        _embed(dout, dout_pad)
        backward_data(dout_pad, w, dx_pad, stride, pad, groups, rest, paths)
        dx[...] = dx_pad[:, :, : dx.shape[2], : dx.shape[3]]
    elif kind == "winograd-s2":  # v32
        with blas_on_calling_thread:
            images = conv_winograd_s2.data_block_images(dx.shape, w.shape, threads)
            conv_winograd_s2.backward_data(dout, w, dx, threads, images, scratch, conv_pointwise.SMALL_GEMM_MNK)
    else:
        tile = gemm_tile_images(
            dx.shape, w.shape, stride, pad, groups, "data", threads, _target(w.shape, "data", paths),
            paths.pointwise_per_image,
        )
        with blas_on_calling_thread:
            gemm_backward_data(dout, w, dx, stride, pad, groups, tile, threads, scratch, paths.pointwise_gather)


def backward_weight(x, dout, dw, dbias, stride, pad, groups, scratch, paths: Paths | None = None) -> None:
    """conv2d_backward_weight with a choice of fast paths."""
    paths = EXPORTED if paths is None else paths  # read at the call: ``use_paths``
    stride, pad, groups = int(stride), int(pad), int(groups)
    _check_array("x", x, x.shape)
    _check_array("dw", dw, dw.shape)
    _check_array("dout", dout, _check_conv(x.shape, dw, stride, pad, groups))
    if dbias is not None:
        _check_array("dbias", dbias, (dw.shape[0],))
    kind = path(x.shape, dw.shape, stride, pad, groups, "weight", paths)
    needed = workspace_size(x.shape, dw.shape, stride, pad, groups, "weight", paths)
    scratch = _check_scratch(scratch, needed, "conv2d_backward_weight_workspace_size")[:needed]
    threads = get_num_threads()
    if kind == "depthwise-registers":
        conv_depthwise_regs.run_backward_weight(x, dout, dw, stride)
    elif kind in ("depthwise-flat", "depthwise-groups"):
        conv_depthwise.run_backward_weight(x, dout, dw, stride, scratch, kind == "depthwise-groups")
    elif kind == "depthwise-direct":
        depthwise_backward_weight(x, dout, dw, stride, pad)
    elif kind == "pointwise-weight-split":
        with blas_on_calling_thread:
            conv_pointwise.backward_weight(x, dout, dw, threads, conv_pointwise.SMALL_GEMM_MNK,
                                           paths.pointwise_pixel_blocks)
    elif kind == "pointwise-weight-transposed":
        with blas_on_calling_thread:
            conv_pointwise.backward_weight_transposed(x, dout, dw, threads, scratch)
    elif kind == "winograd4-weight-by-k":
        with blas_on_calling_thread:
            conv_winograd4.backward_weight_by_k(x, dout, dw, threads, scratch)
    elif kind == "pointwise-strided":
        with blas_on_calling_thread:
            pointwise_strided_backward_weight(x, dout, dw, stride, threads, scratch)
    elif kind in ("stem", "stem-strided"):  # v36, v39: image shares, as the im2col weight gradient
        share = conv_stem.weight_share(x, dout, STEM_WEIGHT_K_BLOCK, dw.shape, stride, pad, paths.stem_phases)
        with blas_on_calling_thread:
            sum_image_shares(dw, scratch, threads, x.shape[0], share)
    elif kind == "winograd4":
        with blas_on_calling_thread:
            rows = conv_winograd4.weight_block_rows(x.shape, dw.shape[1], dw.shape[0])
            conv_winograd4.backward_weight(x, dout, dw, threads, rows, scratch)
    elif kind == "winograd":
        with blas_on_calling_thread:
            rows = conv_winograd.weight_block_rows(x.shape, dw.shape[1], dw.shape[0])
            conv_winograd.backward_weight(x, dout, dw, threads, rows, scratch)
    elif kind == "winograd-s2" and s2_padded(x.shape, dw.shape, stride, pad, groups):  # v40
        x_pad, dout_pad, rest = _s2_pad(scratch, x.shape, dw.shape)
        _embed(x, x_pad)
        _embed(dout, dout_pad)
        backward_weight(x_pad, dout_pad, dw, None, stride, pad, groups, rest, paths)
    elif kind == "winograd-s2":  # v32
        with blas_on_calling_thread:
            images = conv_winograd_s2.weight_block_images(x.shape, dw.shape, threads)
            conv_winograd_s2.backward_weight(x, dout, dw, threads, images, scratch, conv_pointwise.SMALL_GEMM_MNK)
    elif kind == "shifted":
        with blas_on_calling_thread:
            conv_shifted.backward_weight(
                x, dout, dw, threads, conv_shifted.tile_images(x.shape, x.shape[1], threads), scratch
            )
    else:
        tile = gemm_tile_images(
            x.shape, dw.shape, stride, pad, groups, "weight", threads, _target(dw.shape, "weight", paths),
            weight_in_place=paths.pointwise_weight_in_place, im2col_in_place=paths.im2col_weight_in_place,
        )
        im2col_in_place = (
            paths.im2col_weight_in_place and tile == 1
            and _im2col_weight_in_place(x.shape, dw.shape, stride, pad, groups)
        )
        k_block = stem_weight_k_block(x.shape, dw.shape, stride, pad, groups) if paths.stem_weight_split else 0
        with blas_on_calling_thread:
            gemm_backward_weight(
                x, dout, dw, stride, pad, groups, tile, threads, scratch, paths.pointwise_gather,
                paths.pointwise_weight_in_place, im2col_in_place, k_block,
            )
    if dbias is not None:
        bias_gradient(dout, dbias)

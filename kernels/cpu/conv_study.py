"""Convolution on the CPU, the study versions: every step from the textbook loops to the table's kernel.

As in llm.c's ``dev/cuda``, the versions stay side by side, each checked against the NumPy
reference and timed by ``engine kernels --ops conv2d`` (the ``v1`` … ``v15`` rows), so the table
shows what each idea bought. The production path is ``conv.py`` (v20); this module holds the code
only the earlier versions run and calls into ``conv.py`` for the rest. Figures per version are in
kernels/README.md ("What each step bought").

- v1 ``direct``: seven nested loops, parallel over (image, output channel). ~3 GFLOP/s.
- v2 ``im2col``: im2col of one image (parallel rows) into scratch, then one BLAS GEMM (BLAS's
  own threads) straight into ``out[n]``.
- v3 ``tiled``: blocks of images per tile, so the small late layers (8×8, 4×4) still hand BLAS a
  wide matrix; the tile's result is scattered back to NCHW.
- v4 ``per-thread``: one parallel region per call; each thread takes its share of the images,
  its own tiles and a single-threaded GEMM (``conv.gemm_forward`` …): 20–40× v2 on this busy
  machine, where alternating two thread pools cost milliseconds per hand-over.
- v5 ``fast paths``: v4 plus depthwise 3×3 as flat runs across channel planes
  (``conv_depthwise.py``) and smaller tiles for 1×1.
- v6 ``nine shifted GEMMs``: v5, plus 3×3 stride-1 convolutions without im2col: nine GEMMs of
  depth C per tile over zero-padded planes (one zero column per row, one zero row per image,
  shared between neighbours), each tap's operand the padded tile itself at an offset.
- v7 ``three shifted GEMMs``: v6 with the horizontal taps unrolled into a 3× copy, so
  three GEMMs of depth 3C; 4×4 planes stay on im2col (``conv_shifted.py``, ``conv.py``). Also:
  depthwise stride-2 forward on even planes computes only the kept outputs, on input row pairs
  (``conv_depthwise._flat_filter_s2``), instead of v5's full-resolution run and subsample; and
  im2col tiles of 256 columns instead of 1024 for forward and backward-data (``conv.SMALL_TARGET_COLUMNS``).
- v8 ``pointwise per image``: v7, but a 1×1 stride-1 conv whose tile would copy its wide
  side runs one GEMM per image in place on NCHW instead (forward when C ≥ 4K, backward-data when
  C ≥ 2K, on planes of ≥ 64 pixels: ``conv._pointwise_per_image``, figures in its docstring).
- v9 ``pointwise gather``: v8, but a 1×1 stride-1 tile of several images is built by
  ``conv.gather_tile`` and its backward-data result put back by ``conv.scatter_tile`` instead of
  the general im2col / col2im, whose per-plane index work (zeroing, bounds, ``+=``) cost more than
  the GEMM on small planes: 960→160 @4×4 backward-data, one thread's 16 images, 1.74 → 0.64 ms
  (col2im alone 1.19 ms beside a 0.58 ms GEMM); two threads 2.05 → 0.84 ms (PyTorch 0.71).
- v10 ``Winograd``: v9, but 3×3 stride-1 pad-1 forward and backward-data with ≥ 64
  channels in and out on planes ≤ 16×16 run cache-blocked Winograd F(2×2, 3×3) (``conv_winograd.py``): 2.25× fewer
  multiplies, the transformed input of 128 tiles at a time kept in cache. Two threads, batch 32,
  wall ms v9 → v10 (torch): forward 64 @32×32 11.4 → 8.6 (13.6), 128 @16×16 9.9 → 7.9 (7.8),
  256 @8×8 10.7 → 7.1 (7.2), 512 @4×4 11.6 → 9.0 (7.6); backward-data 11.6 → 8.7 (14.9), 10.3 →
  7.9 (7.9), 11.2 → 7.2 (7.2), 11.6 → 9.9 (6.6), on OpenBLAS. With MKL's sgemm v9 is level at
  32×32 (7.6 vs 8.0 ms), so v10 runs Winograd on planes ≤ 16×16 only. The weight gradient keeps
  v9's paths.
- v11 ``Winograd weight gradient``: v10, plus the weight gradient by Winograd on planes ≤ 16×16
  and the stems' weight gradient on im2col (``conv_winograd.backward_weight``, figures there).
- v12 ``Winograd 32×32 on OpenBLAS``: v11, but forward and backward-data take Winograd
  on planes up to 32×32 when the kernels' sgemm is OpenBLAS (``conv.winograd_max_pixels``): 64
  @32×32, two threads, AMD EPYC, wall ms shifted → Winograd (torch): forward 15.35 → 9.68 (16.46),
  backward-data 15.35 → 9.56 (16.93). With MKL's sgemm it is v11.
- v13 ``Winograd backward-data on a transposed filter``: v12, but backward-data
  transforms the flipped filter straight into the transposed layout its GEMMs read
  (``conv_winograd._filter_transform_flipped``) instead of reading the forward's U transposed
  (``sgemm`` with transA): the same GEMMs as the forward. Two threads, batch 32, AMD EPYC, wall ms,
  median of 7 rounds of best-of-5, v12 → v13 (forward for scale): 512 @4×4 12.83 → 12.11 (11.29),
  256 @8×8 11.04 → 10.45 (10.63), 128 @16×16 10.41 → 10.10 (10.04), 64 @32×32 10.51 → 10.57 (10.61).
- v14 ``Winograd F(4×4, 3×3)``: v13, but with OpenBLAS forward and backward-data of
  64–256 channels on 16×16 to 32×32 planes run F(4×4, 3×3) (``conv_winograd4.py``): 2.25
  multiplies per output instead of 4. Two threads, batch 32, AMD EPYC, wall ms, v13 → v14: 64
  @32×32 forward 10.19 → 7.67, backward-data 10.49 → 7.79; 128 @16×16 9.86 → 7.95, 9.33 → 7.84
  (``conv.WINOGRAD4_MIN_PIXELS``: 8×8 and 4×4 stay F(2×2)).
- v15 ``Winograd F(4×4) weight gradient``: v14, plus the weight gradient of the same
  layers by F(4×4) (``conv_winograd4.backward_weight``), and on 8×8 planes too: 64 @32×32 15.51 →
  11.25 ms (shifted GEMMs before), 128 @16×16 10.56 → 9.09, 256 @8×8 10.30 → 9.23 (F(2×2) before).
- v16 ``pointwise weight in place``: v15, but the 1×1 stride-1 weight gradient on planes
  of ≥ 64 pixels runs one β = 1 sgemm per image in place on NCHW (``conv._pointwise_weight_in_place``),
  not gathered tiles plus a partial add per tile. Two threads, batch 32, ms v15 → v16: 144→32
  @16×16 1.05 → 0.71, 192→32 1.35 → 0.90, 384→64 @8×8 1.00 → 0.80, 576→96 1.80 → 1.49.
- v17 ``stems on im2col``: v16, but convolutions of < 8 input channels (the stems) run
  forward and backward-data on im2col too, not the shifted GEMMs: with v14/v15 the stem was the
  shifted path's last caller in ResNet-18 and MobileNetV2, and its compile cost a cold start 1.7 s
  of CPU for 0.3 ms a step (``conv.SHIFTED_MIN_CHANNELS``).
- v18 ``F(4×4) on 8×8`` (exported): v17, but with OpenBLAS forward and backward-data take F(4×4) on
  8×8 planes too (``conv.WINOGRAD4_MIN_PIXELS_8X8``, ``Paths.winograd4_8x8``): 256 @8×8 10.35 → 7.46
  ms forward, 10.38 → 7.95 backward-data (two threads, batch 32, AMD EPYC). What made it win is not a
  path flag but the kernel under every F(4×4) version: its input and output transforms now run over
  the whole block of tiles (tiles column-major within a block, ``conv_winograd4._input_transform``),
  not one tile row at a time, so v14–v17 got faster too (figures in ``conv_winograd4``'s docstring).
- v20 ``im2col weight gradient in place`` (v19 was not used): v18,
  but the im2col weight gradient with output planes of ≥ 16×16 (the stems, the stride-2 convs on
  32×32 inputs) runs one image's im2col and one β = 1 sgemm into dW per image instead of gathered
  4096-column tiles and a partial sum per tile (``conv._im2col_weight_in_place``). One thread, 16
  images, ms v17 → v20: 3→32 @32×32 0.86 → 0.34, 3→64 1.28 → 1.16, 64→128 1×1 s2 1.31 → 1.13.
- v21 ``depthwise by image groups and by planes``: v20, but the depthwise weight
  gradient on planes of ≥ 8×8 sums each plane's nine taps in vector lanes, four images a pass, into one
  partial dW per group of four images (summed in order: same bits at any thread count), streaming the
  images in memory order; stride 2 reads only the kept outputs (even/odd input, dout on row pairs)
  instead of spreading dout over the full-resolution grid (``conv_depthwise.weight_by_groups``,
  ``Paths.depthwise_weight_groups``). And forward and backward-data on planes of ≥ 16×16 (≥ 32×32 at
  stride 2) run plane by plane with the channel's weights in registers instead of chunk runs with
  position-weights (``conv_depthwise.plane_forward``, ``Paths.depthwise_planes``). Batch 32, two
  threads, ms v20 → v21: weight 576 ch s2 @8×8 0.76 → 0.44, 192 ch s2 @16×16 0.92 → 0.48, 144 ch
  @32×32 3.47 → 1.98; forward 144 ch @32×32 2.29 → 1.84. Every figure in ``conv_depthwise``.
- v23 ``F(2×2) by ξ on 4×4`` (v22 not used): v21, but forward and
  backward-data of F(2×2) on planes of ≤ 4×4 (ResNet-18's 512 @4×4) split the threads by Winograd
  position, each reading half of U once for the batch's 128 tiles, instead of by tiles
  (``conv_winograd.forward_by_xi``, ``conv.WINOGRAD_BY_XI_MAX_PIXELS``): 512 @4×4 forward ~9.6 →
  ~9.15 ms, backward-data ~10.05 → ~9.65 (two threads, batch 32). Under every F(4×4) version since
  v23 the weight gradient's dout transform runs over whole blocks (same bits, 2.2–2.6× faster).
- v25 ``depthwise planes in registers`` (v24 not used): v23, but depthwise 3×3
  pad 1 on square 4×4, 8×8, 16×16 and 32×32 planes (stride 1 and 2, all three directions) loads each
  plane once into vector registers and builds every tap by a constant shuffle with zeros (LLVM IR
  written per plane geometry, ``conv_depthwise_regs.py``, ``Paths.depthwise_registers``): only the
  kept outputs at stride 2 in every direction, no position-weights, no masks in memory, no scratch.
  Batch 32, two threads, ms v23 → v25, forward / backward-data / weight: 576 ch s2 @8×8 0.372 →
  0.124 / 0.566 → 0.215 / 0.415 → 0.154; 960 ch @4×4 0.229 → 0.139 / 0.244 → 0.124 / 0.291 → 0.164;
  192 ch s2 @16×16 0.492 → 0.121 / 0.753 → 0.134 / 0.404 → 0.146 (every shape in ``conv_depthwise_regs``).
- v26 ``stem weight gradient in 32-channel GEMMs`` (exported; v24 not used): v25, but the
  in-place im2col weight gradient of a narrow result (C·R·S ≤ 32: the 3-channel stems) runs its
  ``dW += dout_n @ cols_nᵀ`` as GEMMs of 32 output channels (``conv.stem_weight_k_block``,
  ``Paths.stem_weight_split``): OpenBLAS ran K × 27 results at ~56 GFLOP/s with K = 64 and ~100 with
  K = 32. Two threads, batch 32, 3→64 @32×32: 1.33 → 0.76–0.78 ms (torch 0.84). Tried in the same
  session and not in any version: a polyphase Winograd stride-2 forward (``conv_winograd_s2``,
  ``Paths.winograd_s2``, off: −5 to −10% on 64→128 and 128→256 for 3.2 s of cold compile CPU; figures in
  ``conv.WINOGRAD_S2_MIN_PIXELS``).
- v27 ``pointwise small GEMMs`` (v28 adds to it): v26, but a 1×1 stride-1 conv (groups 1) runs
  forward and backward-data as one sgemm per image per block of output rows of ≤ 10⁶ multiply-adds
  (OpenBLAS's small-matrix kernel; ``Paths.pointwise_small_gemms``), and its weight gradient on planes
  of ≥ 16×16 with each thread owning a block of dW, in ≤ 32-row, ≤ 1200-element GEMMs
  (``Paths.pointwise_weight_split``; ``conv_pointwise.py``). Batch 32, two threads, median ms v26 →
  v27: forward 144→32 @16×16 0.641 → 0.400, 384→64 @8×8 0.694 → 0.496, 384→96 0.946 → 0.718;
  backward-data 384→64 0.753 → 0.510, 960→320 @4×4 1.975 → 1.743; weight 144→32 0.758 → 0.440.
- v28 ``polyphase Winograd stride-2 forward`` (v29 adds to it): v27, but the 3×3 stride-2 forward
  with ≥ 64 channels in and out on inputs of ≥ 8×8 (ResNet-18's 64→128, 128→256 and 256→512) runs the
  polyphase Winograd transform of ``conv_winograd_s2`` (25 instead of 36 multiplies per 2×2 output tile),
  whose input and output transforms now run as flat loops over a whole block of tiles, and on 8×8 inputs
  with the threads split by output channel (``Paths.winograd_s2``). Two threads, batch 32, wall ms,
  im2col → v28: 64→128 @32×32 8.21 → 6.52, 128→256 @16×16 7.27 → 6.10, 256→512 @8×8 6.93 → 6.33; 3.44 s
  of cold compile CPU (``conv.WINOGRAD_S2_MIN_PIXELS``).
- v29 ``stride-2 Winograd in small GEMMs`` (v30 adds to it): v28, but each of the polyphase transform's 16 GEMMs
  in blocks of output channels of ≤ 10⁶ multiply-adds, where SciPy's OpenBLAS takes its small-matrix kernel
  (v27's finding; ``Paths.winograd_s2_small_gemms``); the same bits. Batch 32, two threads, median ms, v28 →
  v29, two sittings: 256→512 @8×8 6.93 → 5.70, 8.43 → 6.80; 64→128 @32×32 7.05 → 6.16, 8.41 → 7.23;
  128→256 @16×16 6.61 → 6.70, 8.19 → 7.95 (``conv_winograd_s2.forward``).
- v30 ``F(4×4) in small GEMMs``: v29, but F(4×4)'s forward and backward-data (its flipped forward)
  run each of their 36 GEMMs in blocks of output channels of ≤ 10⁶ multiply-adds, OpenBLAS's small-matrix
  kernel (``Paths.winograd4_small_gemms``). Batch 32, two threads, median ms, v29 → v30: 128 @16×16 7.20 →
  6.46, 256 @8×8 8.32 → 7.48, 64 @32×32 level (``conv_winograd4.forward``).
- v31 ``pointwise weight as NN GEMMs`` (v34 adds to it): v30, but the weight gradient of a 1×1 stride-1 conv on
  planes under 16×16 (MobileNetV2's 8×8 and 4×4 layers; v16's per-image GEMMs and im2col's stacked tiles before) runs
  with each thread owning a range of dW's larger side and the smaller side transposed per image (8 images of 4×4
  side by side), so that every GEMM is NN and ≤ 10⁶ multiply-adds: OpenBLAS's small-matrix kernel, which the
  transposed-A ``dout_n @ x_nᵀ`` missed (``Paths.pointwise_weight_transposed``,
  ``conv_pointwise.backward_weight_transposed``). Batch 32, two threads, median ms, v30 → v31: 192→64 @8×8
  0.479 → 0.354, 384→64 0.757 → 0.567, 576→96 1.436 → 1.182, 576→160 @4×4 0.665 → 0.556, 960→320 1.926 →
  1.723 (all 11 shapes 1.12–1.35×).
- v32 ``stride-2 Winograd backward``: v31, but the stride-2 3×3 layers of v28 run backward-data, and on
  inputs of ≥ 16×16 the weight gradient, by the polyphase transform transposed (``Paths.winograd_s2_backward``;
  ``conv_winograd_s2.backward_data``, ``backward_weight``): 25 instead of 36 multiplies per tile in the GEMMs, in
  blocks that stay in L2. Figures in ``conv_winograd_s2``'s v32 section.
- v33 ``strided 1×1 on kept pixels``: v32, but a 1×1 stride-2 conv (pad 0, groups 1: ResNet-18's
  downsample shortcuts) runs on its kept pixels instead of im2col (``Paths.pointwise_strided``): the forward
  gathers them for v27's per-image row-blocked GEMMs, backward-data scatters each image's GEMM result into dx
  with its zeros, the weight gradient sums 256-deep GEMMs of images side by side (``conv_pointwise``). Batch 32,
  two threads, median ms v30 → v33: forward 64→128 @32×32 1.124 → 0.913, 128→256 @16×16 0.920 → 0.720, 256→512
  @8×8 0.861 → 0.704; backward-data 1.388 → 1.024, 1.132 → 0.830, 1.194 → 0.826; weight 1.175 → 1.018,
  1.074 → 0.922, 0.961 → 0.887.
- v34 ``F(4×4) by output channel`` (v31–v33 are numbers given to work on other branches): v30, but
  forward and backward-data on planes of 4×4 to 8×8 (ResNet-18's 512 @4×4, until now F(2×2) by ξ, and 256
  @8×8) split by output channel, each block of 16 channels transforming its own filters where its GEMMs read
  them, with every tile of the batch as the GEMMs' columns (``conv_winograd4.forward_by_k``,
  ``Paths.winograd4_by_k``). Batch 32, two threads, median of 15 alternating calls, ms, v30 → v34: 512 @4×4
  forward 10.17 → 6.70, backward-data 10.85 → 7.15; 256 @8×8 8.01 → 5.65, 8.43 → 5.79; ImageNet's 512 @7×7
  36.50 → 21.38 (F(2×2) before); 128 @16×16 and larger planes lose (8.33 → 8.96, 64 @32×32 6.81 → 12.90).
- v35 ``F(4×4) weight gradient by output channel`` (exported): v34, but the weight gradient on the same planes
  too, where the batch's transformed x and dout fit 24 MiB (``conv_winograd4.backward_weight_by_k``,
  ``Paths.winograd4_weight_by_k``): per block of 16 output channels 36 GEMMs dUᵀ = V Mᵀ and dw = Gᵀ dU G
  vectorized over the block's 16 rows, where v15–v34 wrote a 36·K·C dU to memory (F(4×4) by ξ, 256 @8×8) or
  ran F(2×2) (512 @4×4). Batch 32, two threads, median of 15 alternating calls, ms, v34 → v35, two sittings:
  512 @4×4 10.18 → 7.92, 9.67 → 7.76; 256 @8×8 7.41 → 6.93, 6.63 → 5.70.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from numba import get_num_threads, njit, prange, uint64

from kernels.cpu import conv, conv_shifted, conv_winograd
from kernels.cpu.conv_winograd import SKEW as WSKEW
from kernels.cpu.conv_winograd import _filter_transform as _wfilter
from kernels.cpu.conv_winograd import _input_transform as _winput
from kernels.cpu.conv_winograd import _output_transform as _woutput
from kernels.cpu.threads import run_shares

_SINCE_2 = (2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 20, 21, 23, 25, 26, 27, 28, 29, 30, 31, 32, 33,
            34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47)
VERSIONS = {"forward": (1, *_SINCE_2), "data": _SINCE_2, "weight": _SINCE_2}
"""The numbered versions per direction (v1 exists for forward only)."""

BEFORE_V21 = {"depthwise_weight_groups": False, "depthwise_planes": False, "winograd_by_xi": False,
              "depthwise_registers": False}
"""What v21, v23 and v25 added, off in every earlier version."""
V21_PATHS = conv.Paths(winograd_by_xi=False, depthwise_registers=False)
V23_PATHS = conv.Paths(depthwise_registers=False)
ADDED_IN = {
    26: ("stem_weight_split",),
    27: ("pointwise_small_gemms", "pointwise_weight_split"),
    28: ("winograd_s2",),
    29: ("winograd_s2_small_gemms",),
    30: ("winograd4_small_gemms",),
    31: ("pointwise_weight_transposed",),
    32: ("winograd_s2_backward",),
    33: ("pointwise_strided",),
    34: ("winograd4_by_k",),
    35: ("winograd4_weight_by_k",),
    36: ("stem_columns",),
    37: ("winograd_s2_weight_8x8",),
    38: ("float32_forward",),
    39: ("stem_strided",),
    40: ("winograd_s2_padded",),
    41: ("winograd_large_planes",),
    42: ("imagenet_measured",),
    43: ("winograd_by_xi_forward",),
    44: ("depthwise_planes_large_s2",),
    45: ("depthwise_imagenet_planes",),
    46: ("pointwise_pixel_blocks",),
    47: ("stem_phases",),
}
"""The ``conv.Paths`` flags each version from v26 on added: off in every version before it (``_paths``). A new
version is one line here and its number in ``_SINCE_2``."""


def flags_off(version: int) -> dict[str, bool]:
    """``ADDED_IN[version]``'s flags, off: ``dataclasses.replace(conv.Paths(), **flags_off(34))`` is today's paths
    without what v34 added."""
    return dict.fromkeys(ADDED_IN[version], False)


NO_FAST_PATHS = conv.Paths(
    depthwise_flat=False, pointwise_tiles=False, shifted=False, depthwise_kept_only=False, small_tiles=False,
    pointwise_per_image=False, pointwise_gather=False, winograd=False, winograd_weight=False,
    narrow_weight_im2col=False, winograd4=False, winograd4_weight=False, pointwise_weight_in_place=False,
    narrow_im2col=False, winograd4_8x8=False, im2col_weight_in_place=False, **BEFORE_V21,
)
V20_PATHS = conv.Paths(**BEFORE_V21)
V18_PATHS = conv.Paths(im2col_weight_in_place=False, **BEFORE_V21)
V17_PATHS = conv.Paths(winograd4_8x8=False, im2col_weight_in_place=False, **BEFORE_V21)
V16_PATHS = conv.Paths(
    narrow_im2col=False, winograd4_8x8=False, im2col_weight_in_place=False, **BEFORE_V21
)
V15_PATHS = conv.Paths(
    pointwise_weight_in_place=False, narrow_im2col=False, winograd4_8x8=False, im2col_weight_in_place=False,
    winograd_by_xi=False, depthwise_registers=False,
)
V14_PATHS = conv.Paths(
    winograd4_weight=False, pointwise_weight_in_place=False, narrow_im2col=False, winograd4_8x8=False,
    im2col_weight_in_place=False, **BEFORE_V21,
)
V13_PATHS = conv.Paths(
    winograd4=False, winograd4_weight=False, pointwise_weight_in_place=False, narrow_im2col=False,
    winograd4_8x8=False, im2col_weight_in_place=False, **BEFORE_V21,
)
V12_PATHS = conv.Paths(
    winograd_data_transposed=False, winograd4=False, winograd4_weight=False, pointwise_weight_in_place=False,
    narrow_im2col=False, winograd4_8x8=False, im2col_weight_in_place=False, **BEFORE_V21,
)
V11_PATHS = conv.Paths(
    winograd_32x32_openblas=False, winograd_data_transposed=False, winograd4=False, winograd4_weight=False,
    pointwise_weight_in_place=False, narrow_im2col=False, winograd4_8x8=False, im2col_weight_in_place=False,
    **BEFORE_V21,
)
V10_PATHS = conv.Paths(
    winograd_weight=False, narrow_weight_im2col=False, winograd_32x32_openblas=False, winograd_data_transposed=False,
    winograd4=False, winograd4_weight=False, pointwise_weight_in_place=False, narrow_im2col=False, winograd4_8x8=False,
    im2col_weight_in_place=False, **BEFORE_V21,
)
V9_PATHS = conv.Paths(
    winograd=False, winograd_weight=False, narrow_weight_im2col=False, winograd4=False, winograd4_weight=False,
    pointwise_weight_in_place=False, narrow_im2col=False, winograd4_8x8=False, im2col_weight_in_place=False,
    **BEFORE_V21,
)
V8_PATHS = conv.Paths(
    pointwise_gather=False, winograd=False, winograd_weight=False, narrow_weight_im2col=False, winograd4=False,
    winograd4_weight=False, pointwise_weight_in_place=False, narrow_im2col=False, winograd4_8x8=False,
    im2col_weight_in_place=False, **BEFORE_V21,
)
V7_PATHS = conv.Paths(
    pointwise_per_image=False, pointwise_gather=False, winograd=False, winograd_weight=False,
    narrow_weight_im2col=False, winograd4=False, winograd4_weight=False, pointwise_weight_in_place=False,
    narrow_im2col=False, winograd4_8x8=False, im2col_weight_in_place=False, **BEFORE_V21,
)
V5_PATHS = conv.Paths(
    depthwise_flat=True, pointwise_tiles=True, shifted=False, depthwise_kept_only=False, small_tiles=False,
    pointwise_per_image=False, pointwise_gather=False, winograd=False, winograd_weight=False,
    narrow_weight_im2col=False, winograd4=False, winograd4_weight=False, pointwise_weight_in_place=False,
    narrow_im2col=False, winograd4_8x8=False, im2col_weight_in_place=False, **BEFORE_V21,
)


# ----------------------------------------------------------------------------------------------
# v1: the direct loop nest
# ----------------------------------------------------------------------------------------------


@njit(parallel=True, cache=True, nogil=True)
def direct_forward(x, w, out, stride, pad, groups):
    """The textbook loop nest, parallel over (image, output channel): no reuse, ~3 GFLOP/s."""
    n = x.shape[0]
    height, width = x.shape[2], x.shape[3]
    k_total, c_group, kernel = w.shape[0], w.shape[1], w.shape[2]
    k_group = k_total // groups
    out_h, out_w = out.shape[2], out.shape[3]
    for job in prange(n * k_total):
        i = job // k_total
        k = job % k_total
        c0 = (k // k_group) * c_group
        for y in range(out_h):
            for ox in range(out_w):
                total = np.float32(0.0)
                for c in range(c_group):
                    for r in range(kernel):
                        iy = y * stride + r - pad
                        if iy < 0 or iy >= height:
                            continue
                        for s in range(kernel):
                            ix = ox * stride + s - pad
                            if 0 <= ix < width:
                                total += w[k, c, r, s] * x[i, c0 + c, iy, ix]
                out[i, k, y, ox] = total


# ----------------------------------------------------------------------------------------------
# v2 and v3: parallel im2col/col2im between GEMMs that run on BLAS's own threads
# ----------------------------------------------------------------------------------------------


@njit(parallel=True, cache=True, nogil=True)
def im2col_tile(x, n0, images, c0, stride, pad, kernel, out_h, out_w, cols):
    """cols[(c·R + r)·S + s, i·OH·OW + oh·OW + ow] = x_padded[n0 + i, c0 + c, oh·stride + r, ow·stride + s]."""
    for row in prange(cols.shape[0]):
        conv.im2col_row(x, n0, images, c0, stride, pad, kernel, out_h, out_w, cols, row)


@njit(parallel=True, cache=True, nogil=True)
def col2im_tile(dcols, n0, images, c0, channels, stride, pad, kernel, out_h, out_w, dx):
    """The transpose of im2col. One parallel iteration owns one whole (image, channel) plane, so
    there are no write races and every pixel's sum runs in the same order."""
    for job in prange(channels * images):
        conv.col2im_plane(dcols, n0, c0, stride, pad, kernel, out_h, out_w, dx, job // images, job % images)


@njit(cache=True, nogil=True)
def _forward_gemm(x, w, out, stride, pad, groups, tile_images, scratch):
    n_images = x.shape[0]
    k_total, c_group, kernel = w.shape[0], w.shape[1], w.shape[2]
    out_h, out_w = out.shape[2], out.shape[3]
    pixels = out_h * out_w
    k_group = k_total // groups
    rows = c_group * kernel * kernel
    plain_1x1 = kernel == 1 and stride == 1 and pad == 0
    for n0 in range(0, n_images, tile_images):
        images = min(tile_images, n_images - n0)
        columns = images * pixels
        for g in range(groups):
            w_g = w[g * k_group : (g + 1) * k_group].reshape(k_group, rows)
            if plain_1x1 and images == 1:
                cols = x[n0, g * c_group : (g + 1) * c_group].reshape(c_group, pixels)
            else:
                cols = scratch[: rows * columns].reshape(rows, columns)
                im2col_tile(x, n0, images, g * c_group, stride, pad, kernel, out_h, out_w, cols)
            if images == 1:
                np.dot(w_g, cols, out[n0, g * k_group : (g + 1) * k_group].reshape(k_group, pixels))
            else:
                start = rows * columns
                result = scratch[start : start + k_group * columns].reshape(k_group, columns)
                np.dot(w_g, cols, result)
                conv.scatter_tile(result, n0, images, g * k_group, out)


@njit(cache=True, nogil=True)
def _backward_data_gemm(dout, w, dx, stride, pad, groups, tile_images, scratch):
    n_images = dx.shape[0]
    k_total, c_group, kernel = w.shape[0], w.shape[1], w.shape[2]
    out_h, out_w = dout.shape[2], dout.shape[3]
    pixels = out_h * out_w
    k_group = k_total // groups
    rows = c_group * kernel * kernel
    plain_1x1 = kernel == 1 and stride == 1 and pad == 0
    for n0 in range(0, n_images, tile_images):
        images = min(tile_images, n_images - n0)
        columns = images * pixels
        for g in range(groups):
            w_g = w[g * k_group : (g + 1) * k_group].reshape(k_group, rows)
            if images == 1:
                d_tile = dout[n0, g * k_group : (g + 1) * k_group].reshape(k_group, pixels)
            else:
                d_tile = scratch[: k_group * columns].reshape(k_group, columns)
                conv.gather_tile(dout, n0, images, g * k_group, d_tile)
            if plain_1x1 and images == 1:
                np.dot(w_g.T, d_tile, dx[n0, g * c_group : (g + 1) * c_group].reshape(c_group, pixels))
            else:
                start = k_group * columns if images > 1 else 0
                dcols = scratch[start : start + rows * columns].reshape(rows, columns)
                np.dot(w_g.T, d_tile, dcols)
                col2im_tile(dcols, n0, images, g * c_group, c_group, stride, pad, kernel, out_h, out_w, dx)


@njit(cache=True, nogil=True)
def _backward_weight_gemm(x, dout, dw, stride, pad, groups, tile_images, scratch):
    n_images = x.shape[0]
    k_total, c_group, kernel = dw.shape[0], dw.shape[1], dw.shape[2]
    out_h, out_w = dout.shape[2], dout.shape[3]
    pixels = out_h * out_w
    k_group = k_total // groups
    rows = c_group * kernel * kernel
    plain_1x1 = kernel == 1 and stride == 1 and pad == 0
    for n0 in range(0, n_images, tile_images):
        images = min(tile_images, n_images - n0)
        columns = images * pixels
        for g in range(groups):
            used = 0
            if plain_1x1 and images == 1:
                cols = x[n0, g * c_group : (g + 1) * c_group].reshape(c_group, pixels)
            else:
                cols = scratch[: rows * columns].reshape(rows, columns)
                im2col_tile(x, n0, images, g * c_group, stride, pad, kernel, out_h, out_w, cols)
                used = rows * columns
            if images == 1:
                d_tile = dout[n0, g * k_group : (g + 1) * k_group].reshape(k_group, pixels)
            else:
                d_tile = scratch[used : used + k_group * columns].reshape(k_group, columns)
                conv.gather_tile(dout, n0, images, g * k_group, d_tile)
                used += k_group * columns
            dw_g = dw[g * k_group : (g + 1) * k_group].reshape(k_group, rows)
            if n0 == 0:
                np.dot(d_tile, cols.T, dw_g)
            else:
                partial = scratch[used : used + k_group * rows].reshape(k_group, rows)
                np.dot(d_tile, cols.T, partial)
                dw_g += partial


# ----------------------------------------------------------------------------------------------
# v6: nine shifted GEMMs over zero-padded planes
# ----------------------------------------------------------------------------------------------

NINE_TARGET_COLUMNS = 1024
"""Images stack into one tile until the GEMM has at least this many output-grid columns."""

NINE_TILE_BUDGET_ELEMENTS = 1 << 19
"""At most this many float32 (2 MiB) in the padded input tile."""


def nine_tile_images(x_shape, channels: int, threads: int) -> int:
    """Images per tile: enough for ``NINE_TARGET_COLUMNS`` grid columns, within the budget, ≤ a thread's share."""
    n, _, h, w = x_shape
    grid = (h + 1) * (w + 1)
    share = -(-n // threads)
    wanted = -(-NINE_TARGET_COLUMNS // grid)
    fits = max(1, NINE_TILE_BUDGET_ELEMENTS // (channels * grid))
    return max(1, min(share, wanted, fits))


def _nine_tile_sizes(x_shape, c_in: int, c_out: int, threads: int) -> tuple[int, int, int]:
    """(images per tile, P's row length, O's row length) for inputs of ``c_in`` channels."""
    _, _, h, w = x_shape
    images = nine_tile_images(x_shape, c_in, threads)
    m = images * (h + 1) * (w + 1)
    return images, m + 2 * (w + 2), m


def nine_workspace_size(x_shape, w_shape, direction: str, threads: int) -> int:
    """Per thread: the padded input tile and the output-grid tile; plus the nine reordered filters
    (and, for the weight gradient, a nine-filter partial sum per extra thread)."""
    k, c = w_shape[0], w_shape[1]
    c_in, c_out = (k, c) if direction == "data" else (c, k)
    images, row, m = _nine_tile_sizes(x_shape, c_in, c_out, threads)
    per_thread = c_in * row + c_out * m
    filters = 9 * k * c
    if direction == "weight":
        return threads * per_thread + threads * filters
    return threads * per_thread + filters


@njit(cache=True, nogil=True)
def _pack(src, n0, images, channels, height, width, row, dst):
    """dst[c, lead + (i·(H+1) + y)·(W+1) + x] = src[n0 + i, c, y, x], zeros on every pad position."""
    wp = width + 1
    lead = wp + 1
    plane = height * width
    for c in range(channels):
        base = uint64(c * row)
        for q in range(lead):
            dst[base + uint64(q)] = 0.0
        for i in range(images):
            s0 = uint64(((n0 + i) * channels + c) * plane)
            d0 = base + uint64(lead + i * (height + 1) * wp)
            for y in range(height):
                sr = s0 + uint64(y * width)
                dr = d0 + uint64(y * wp)
                for x in range(width):
                    dst[dr + uint64(x)] = src[sr + uint64(x)]
                dst[dr + uint64(width)] = 0.0
            sep = d0 + uint64(height * wp)
            for x in range(wp):
                dst[sep + uint64(x)] = 0.0
        for q in range(lead + images * (height + 1) * wp, row):
            dst[base + uint64(q)] = 0.0


@njit(cache=True, nogil=True)
def _unpack(grid, n0, images, channels, height, width, m, dst):
    """dst[n0 + i, c, y, x] = grid[c, (i·(H+1) + y)·(W+1) + x]: the output's valid positions."""
    wp = width + 1
    plane = height * width
    for c in range(channels):
        base = uint64(c * m)
        for i in range(images):
            d0 = uint64(((n0 + i) * channels + c) * plane)
            s0 = base + uint64(i * (height + 1) * wp)
            for y in range(height):
                sr = s0 + uint64(y * wp)
                dr = d0 + uint64(y * width)
                for x in range(width):
                    dst[dr + uint64(x)] = grid[sr + uint64(x)]


@njit(cache=True, nogil=True)
def _pack_grid(src, n0, images, channels, height, width, m, dst):
    """dst[c, (i·(H+1) + y)·(W+1) + x] = src[n0 + i, c, y, x], zeros elsewhere (dout on the grid)."""
    wp = width + 1
    plane = height * width
    for c in range(channels):
        base = uint64(c * m)
        for i in range(images):
            s0 = uint64(((n0 + i) * channels + c) * plane)
            d0 = base + uint64(i * (height + 1) * wp)
            for y in range(height):
                sr = s0 + uint64(y * width)
                dr = d0 + uint64(y * wp)
                for x in range(width):
                    dst[dr + uint64(x)] = src[sr + uint64(x)]
                dst[dr + uint64(width)] = 0.0
            sep = d0 + uint64(height * wp)
            for x in range(wp):
                dst[sep + uint64(x)] = 0.0


@njit(cache=True, nogil=True)
def _filters(w, flipped, out):
    """out[t] = w[:, :, dy, dx] (K×C), or flipped: w[:, :, 2−dy, 2−dx]ᵀ (C×K), t = 3·dy + dx."""
    k, c = w.shape[0], w.shape[1]
    for t in range(9):
        dy, dx = t // 3, t % 3
        base = t * k * c
        if flipped:
            for cc in range(c):
                for kk in range(k):
                    out[base + cc * k + kk] = w[kk, cc, 2 - dy, 2 - dx]
        else:
            for kk in range(k):
                for cc in range(c):
                    out[base + kk * c + cc] = w[kk, cc, dy, dx]


@njit(parallel=True, cache=True, nogil=True)
def nine_forward(x, w, out, flipped, threads, tile, scratch):
    """out = conv3×3(x, w), stride 1, pad 1 (flipped: dx = the transposed conv of dout, see module)."""
    n, c_in, height, width = x.shape
    c_out = out.shape[1]
    wp = width + 1
    m = tile * (height + 1) * wp
    row = m + 2 * (width + 2)
    filters = scratch[: 9 * c_in * c_out]
    _filters(w, flipped, filters)
    per_thread = c_in * row + c_out * m
    src, dst = x.reshape(x.size), out.reshape(out.size)
    for t in prange(threads):
        mine = scratch[9 * c_in * c_out + t * per_thread : 9 * c_in * c_out + (t + 1) * per_thread]
        padded = mine[: c_in * row]
        grid = mine[c_in * row :]
        scalars = np.empty(2, np.float32)
        first, last = t * n // threads, (t + 1) * n // threads
        for n0 in range(first, last, tile):
            images = min(tile, last - n0)
            cols = images * (height + 1) * wp
            _pack(src, n0, images, c_in, height, width, row, padded)
            for tap in range(9):
                shift = (tap // 3) * wp + tap % 3
                conv_shifted.sgemm(
                    False,
                    False,
                    c_out,
                    cols,
                    c_in,
                    filters[tap * c_in * c_out :],
                    c_in,
                    padded[shift:],
                    row,
                    0.0 if tap == 0 else 1.0,
                    grid,
                    m,
                    scalars,
                )
            _unpack(grid, n0, images, c_out, height, width, m, dst)


@njit(parallel=True, cache=True, nogil=True)
def nine_backward_weight(x, dout, dw, threads, tile, scratch):
    """dw[k, c, dy, dx] = Σ_n Σ_grid dout · x shifted by (dy, dx): nine GEMMs per tile, β = 1 across tiles."""
    n, c_in, height, width = x.shape
    c_out = dout.shape[1]
    wp = width + 1
    m = tile * (height + 1) * wp
    row = m + 2 * (width + 2)
    filters = 9 * c_in * c_out
    per_thread = c_in * row + c_out * m
    src, grad = x.reshape(x.size), dout.reshape(dout.size)
    for t in prange(threads):
        mine = scratch[t * per_thread : (t + 1) * per_thread]
        padded = mine[: c_in * row]
        grid = mine[c_in * row :]
        acc = scratch[threads * per_thread + t * filters : threads * per_thread + (t + 1) * filters]
        scalars = np.empty(2, np.float32)
        first, last = t * n // threads, (t + 1) * n // threads
        if first >= last:
            acc[:] = 0.0
        for n0 in range(first, last, tile):
            images = min(tile, last - n0)
            cols = images * (height + 1) * wp
            _pack(src, n0, images, c_in, height, width, row, padded)
            _pack_grid(grad, n0, images, c_out, height, width, m, grid)
            for tap in range(9):
                shift = (tap // 3) * wp + tap % 3
                conv_shifted.sgemm(
                    False,
                    True,
                    c_out,
                    c_in,
                    cols,
                    grid,
                    m,
                    padded[shift:],
                    row,
                    0.0 if n0 == first else 1.0,
                    acc[tap * c_in * c_out :],
                    c_in,
                    scalars,
                )
    sums = scratch[threads * per_thread :]
    k, c = dw.shape[0], dw.shape[1]
    for kk in prange(k):
        for cc in range(c):
            for tap in range(9):
                at = tap * c_in * c_out + kk * c + cc
                total = sums[at]
                for t in range(1, threads):
                    total += sums[t * filters + at]
                dw[kk, cc, tap // 3, tap % 3] = total


# ----------------------------------------------------------------------------------------------
# Winograd with the threads splitting the output channels, not the tiles (tried, dropped)
# ----------------------------------------------------------------------------------------------


def channel_block_rows(x_shape, c_in: int, c_out: int, target_tiles: int, budget: int) -> int:
    """Tile rows per block when every thread works on every block (``forward_by_channels``):
    ``target_tiles`` tiles within ``budget`` floats of V and M, ≤ the batch."""
    n, _, h, w = x_shape
    tw = (w + 1) // 2
    total = n * ((h + 1) // 2)
    wanted = -(-target_tiles // tw)
    fits = max(1, budget // (16 * (c_in + c_out) * tw))
    return max(1, min(total, wanted, fits))


def channel_workspace_size(x_shape, w_shape, direction: str, threads: int, rows: int) -> int:
    """Scratch of ``forward_by_channels``: U, one block's V and M (shared), per thread a row buffer."""
    k, c = w_shape[0], w_shape[1]
    c_in, c_out = (k, c) if direction == "data" else (c, k)
    tw = (x_shape[3] + 1) // 2
    return (16 * (k * c + WSKEW) + 16 * ((c_in + c_out) * rows * tw + 2 * WSKEW)
            + threads * conv_winograd._buffer(x_shape[3], rows))


@njit(cache=True, nogil=True)
def _channel_gemms(u, v, m, flipped, k_lo, k_hi, c_in, c_out, cols):
    """m[ξ][k_lo:k_hi] = U[ξ][k_lo:k_hi] (or U'[ξ]) @ v[ξ] for the 16 ξ: one thread's output channels."""
    scalars = np.empty(2, np.float32)
    plane = c_in * c_out + WSKEW
    for xi in range(16):
        at = xi
        if flipped:  # U'[(i, j)] = U[(p(i), p(j))]ᵀ, p swapping 0 and 3: rows k of U' are columns of U
            i, j = xi // 4, xi % 4
            at = 4 * (3 - i if i == 0 or i == 3 else i) + (3 - j if j == 0 or j == 3 else j)
        conv_shifted.sgemm(flipped, False, k_hi - k_lo, cols, c_in,
                           u[at * plane + (k_lo if flipped else k_lo * c_in):], c_out if flipped else c_in,
                           v[xi * (c_in * cols + WSKEW):], cols, 0.0,
                           m[xi * (c_out * cols + WSKEW) + k_lo * cols:], cols, scalars)


def forward_by_channels(x, w, out, flipped: bool, threads: int, rows: int, scratch) -> None:
    """``conv_winograd.forward``, but every thread works on every block: the threads split the input
    transform by input channel, then the 16 GEMMs and the output transform by output channel. The idea:
    a thread's GEMMs read only its share of U and have all the block's tiles as columns, where the
    production path gives each thread all of U and its share of the tiles (at 512 @4×4: 64 tiles
    against 16 MiB of transformed filter per thread). Single-threaded OpenBLAS, 16 GEMMs, GFLOP/s
    (AMD EPYC): K × C @ C × Tb = 512 × 512 @ 512 × 64: 74; 256 × 512 @ 512 × 128: 81. But the whole
    conv did not follow. Two threads, batch 32, wall ms, median of 5 rounds of best-of-5, production
    → this (its best block size): 512 @4×4 forward 12.90 → 13.23, backward-data 15.01 → 14.29; 256
    @8×8 10.52 → 12.52, 11.53 → 13.54; 128 @16×16 9.78 → 11.95, 10.05 → 12.03; 64 @32×32 10.08 →
    15.53, 10.85 → 15.46 (V crosses from one core's cache to the other's, and each block is two
    hand-overs). Dropped; kept here with a reference test."""
    n, c_in, height, width = x.shape
    c_out = out.shape[1]
    tw = (width + 1) // 2
    total = n * ((height + 1) // 2)
    k = w.shape[0]
    u, v, m, at = conv_winograd.block_buffers(scratch, 16, c_in, c_out, rows * tw)
    per_thread = conv_winograd._buffer(width, rows)
    src, dst = x.reshape(x.size), out.reshape(out.size)
    run_shares(lambda t: _wfilter(w, t * k // threads, (t + 1) * k // threads, u), threads)

    def transform_in(t: int, r0: int, nr: int) -> None:
        tmp = scratch[at + t * per_thread : at + (t + 1) * per_thread]
        _winput(src, r0, nr, t * c_in // threads, (t + 1) * c_in // threads, c_in, height, width, v, tmp)

    def multiply_out(t: int, r0: int, nr: int) -> None:
        tmp = scratch[at + t * per_thread : at + (t + 1) * per_thread]
        k_lo, k_hi = t * c_out // threads, (t + 1) * c_out // threads
        _channel_gemms(u, v, m, flipped, k_lo, k_hi, c_in, c_out, nr * tw)
        _woutput(m, r0, nr, c_out, height, width, dst, tmp, k_lo, k_hi)

    for r0 in range(0, total, rows):
        nr = min(rows, total - r0)
        run_shares(lambda t, r0=r0, nr=nr: transform_in(t, r0, nr), threads)
        run_shares(lambda t, r0=r0, nr=nr: multiply_out(t, r0, nr), threads)


FILTER_CHUNK = 128
"""Filters per chunk of ``_filter_transform_chunks`` (its 27 short loops run over this many lanes)."""


@njit(cache=True, nogil=True, inline="always")
def _g_store(dst, x0, x1, x2, n, j, half):
    """dst[:n] = column j of (row x) Gᵀ: x0, ½(x0 + x1 + x2), ½(x0 − x1 + x2) or x2 (one store stream)."""
    if j == 0:
        for lane in range(n):
            dst[lane] = x0[lane]
    elif j == 1:
        for lane in range(n):
            dst[lane] = half * (x0[lane] + x1[lane] + x2[lane])
    elif j == 2:
        for lane in range(n):
            dst[lane] = half * (x0[lane] - x1[lane] + x2[lane])
    else:
        for lane in range(n):
            dst[lane] = x2[lane]


@njit(cache=True, nogil=True)
def _filter_transform_chunks(w, lo, hi, u, flipped, tmp):
    """``conv_winograd._filter_transform`` (flipped: ``_filter_transform_flipped``) over k (c) in [lo, hi), the same
    bits, in chunks of ``FILTER_CHUNK`` filters: the nine taps gathered into rows of ``tmp`` (15 ×
    FILTER_CHUNK floats), the rows of G g computed from them, then each of the 16 planes written by a
    loop of its own (one store stream: the one-loop transforms' 16 streams keep LLVM from
    vectorizing them). Tried and dropped: the transform is bound by writing U, not by its scalar
    arithmetic. Two threads, wall ms, median of 7 rounds of best-of-5 (AMD EPYC), one-loop → chunks,
    forward / flipped: 512 ch 1.37 → 2.03 / 1.76 → 4.01; 256 ch 0.57 → 0.60 / 0.59 → 0.85; 128 ch
    0.16 → 0.17 / 0.16 → 0.20."""
    k, c = w.shape[0], w.shape[1]
    plane = k * c + WSKEW
    g = w.reshape(w.size)
    half = np.float32(0.5)
    inner = k if flipped else c
    ch = FILTER_CHUNK
    for outer in range(lo, hi):
        for i0 in range(0, inner, ch):
            n = min(ch, inner - i0)
            if flipped:  # outer = c, lanes = k: filter (i0 + lane, outer); U' is C × K
                base, stride, at0 = 9 * (i0 * c + outer), 9 * c, outer * k + i0
            else:  # outer = k, lanes = c
                base, stride, at0 = 9 * (outer * c + i0), 9, outer * c + i0
            for r in range(9):
                t = tmp[r * ch : r * ch + n]
                for lane in range(n):
                    t[lane] = g[base + lane * stride + r]
            for j in range(3):  # rows 1 and 2 of G g: ½(g0 + g1 + g2), ½(g0 − g1 + g2), column j
                w0, w1, w2 = tmp[j * ch :], tmp[(3 + j) * ch :], tmp[(6 + j) * ch :]
                b, d = tmp[(9 + j) * ch : (9 + j) * ch + n], tmp[(12 + j) * ch : (12 + j) * ch + n]
                for lane in range(n):
                    b[lane] = half * (w0[lane] + w1[lane] + w2[lane])
                for lane in range(n):
                    d[lane] = half * (w0[lane] - w1[lane] + w2[lane])
            for i in range(4):
                row = (0, 9, 12, 6)[i]  # where row i of G g starts in tmp: g0, b, d, g2
                x0, x1, x2 = tmp[row * ch :], tmp[(row + 1) * ch :], tmp[(row + 2) * ch :]
                for j in range(4):
                    xi = 4 * i + j
                    if flipped:
                        xi = 4 * (3 - i if i == 0 or i == 3 else i) + (3 - j if j == 0 or j == 3 else j)
                    _g_store(u[xi * plane + at0 : xi * plane + at0 + n], x0, x1, x2, n, j, half)



# ----------------------------------------------------------------------------------------------
# The versions behind one signature
# ----------------------------------------------------------------------------------------------


def _v23_tile(x_shape, w_shape, stride, pad, groups, version, direction) -> int:
    if version == 2:
        return 1
    target = conv.WEIGHT_TARGET_COLUMNS if direction == "weight" else conv.TARGET_COLUMNS
    return conv.images_per_tile(x_shape, w_shape, stride, pad, groups, target, 1)


def _paths(version: int) -> conv.Paths:
    paths = {4: NO_FAST_PATHS, 5: V5_PATHS, 6: V5_PATHS, 7: V7_PATHS, 8: V8_PATHS, 9: V9_PATHS, 10: V10_PATHS,
             11: V11_PATHS, 12: V12_PATHS, 13: V13_PATHS, 14: V14_PATHS, 15: V15_PATHS,
             16: V16_PATHS, 17: V17_PATHS, 18: V18_PATHS, 20: V20_PATHS, 21: V21_PATHS,
             23: V23_PATHS}
    chosen = paths.get(version, conv.Paths())  # not EXPORTED: a version's paths do not follow ENGINE_CONV
    for since in ADDED_IN:
        if version < since:
            chosen = dataclasses.replace(chosen, **flags_off(since))
    return chosen


def _nine(version, x_shape, w_shape, stride, pad, groups) -> bool:
    return version == 6 and conv_shifted.supported(x_shape, w_shape, stride, pad, groups)


def conv2d_version_workspace_size(version: int, direction: str, x_shape, w_shape, stride, pad, groups) -> int:
    """Scratch (float32 elements) for a numbered version (1 to 18, 20, 21, 23, 25, 26, 27, 28, 29, 30, 31, 32, 33,
    34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46) and direction ("forward", "data", "weight")."""
    x_shape, w_shape = tuple(x_shape), tuple(w_shape)
    if version == 1:
        return 0
    if version in (2, 3):
        if conv.is_depthwise(x_shape, w_shape, groups):
            return 0
        tile = _v23_tile(x_shape, w_shape, stride, pad, groups, version, direction)
        oh, ow = conv.check_conv2d_shapes(x_shape, w_shape, stride, pad, groups)
        rows = w_shape[1] * w_shape[2] * w_shape[3]
        k_group = w_shape[0] // groups
        columns = tile * oh * ow
        cols = 0 if (w_shape[2] == 1 and stride == 1 and pad == 0 and tile == 1) else rows * columns
        size = cols + (k_group * columns if tile > 1 else 0)
        return size + (k_group * rows if direction == "weight" and tile < x_shape[0] else 0)
    if _nine(version, x_shape, w_shape, stride, pad, groups):
        return nine_workspace_size(x_shape, w_shape, direction, get_num_threads())
    return conv.workspace_size(x_shape, w_shape, stride, pad, groups, direction, _paths(version))


def conv2d_forward_v1_direct(x, w, bias, out, stride: int, pad: int, groups: int, scratch=None) -> None:
    """Version 1: the direct loop nest (no scratch). The baseline the tour starts from."""
    stride, pad, groups = int(stride), int(pad), int(groups)
    conv.check_forward_args(x, w, bias, out, stride, pad, groups)
    direct_forward(x, w, out, stride, pad, groups)
    if bias is not None:
        conv.add_bias(out, bias)


def _forward(x, w, bias, out, stride, pad, groups, scratch, version) -> None:
    stride, pad, groups = int(stride), int(pad), int(groups)
    if version in (2, 3) and not conv.is_depthwise(x.shape, w.shape, groups):
        conv.check_forward_args(x, w, bias, out, stride, pad, groups)
        _forward_gemm(
            x,
            w,
            out,
            stride,
            pad,
            groups,
            _v23_tile(x.shape, w.shape, stride, pad, groups, version, "forward"),
            scratch,
        )
    elif version in (2, 3):
        conv.check_forward_args(x, w, bias, out, stride, pad, groups)
        conv.depthwise_forward(x, w, out, stride, pad)
    elif _nine(version, x.shape, w.shape, stride, pad, groups):
        conv.check_forward_args(x, w, bias, out, stride, pad, groups)
        threads = get_num_threads()
        with conv.blas_on_calling_thread:
            nine_forward(x, w, out, False, threads, nine_tile_images(x.shape, x.shape[1], threads), scratch)
    else:
        conv.forward(x, w, None, out, stride, pad, groups, scratch, _paths(version))
    if bias is not None:
        conv.add_bias(out, bias)


def _backward_data(dout, w, dx, stride, pad, groups, scratch, version) -> None:
    stride, pad, groups = int(stride), int(pad), int(groups)
    if version in (2, 3) and not conv.is_depthwise(dx.shape, w.shape, groups):
        _backward_data_gemm(
            dout,
            w,
            dx,
            stride,
            pad,
            groups,
            _v23_tile(dx.shape, w.shape, stride, pad, groups, version, "data"),
            scratch,
        )
    elif version in (2, 3):
        conv.depthwise_backward_data(dout, w, dx, stride, pad)
    elif _nine(version, dx.shape, w.shape, stride, pad, groups):
        threads = get_num_threads()
        with conv.blas_on_calling_thread:
            nine_forward(dout, w, dx, True, threads, nine_tile_images(dx.shape, w.shape[0], threads), scratch)
    else:
        conv.backward_data(dout, w, dx, stride, pad, groups, scratch, _paths(version))


def _backward_weight(x, dout, dw, dbias, stride, pad, groups, scratch, version) -> None:
    stride, pad, groups = int(stride), int(pad), int(groups)
    if version in (2, 3) and not conv.is_depthwise(x.shape, dw.shape, groups):
        _backward_weight_gemm(
            x,
            dout,
            dw,
            stride,
            pad,
            groups,
            _v23_tile(x.shape, dw.shape, stride, pad, groups, version, "weight"),
            scratch,
        )
    elif version in (2, 3):
        conv.depthwise_backward_weight(x, dout, dw, stride, pad)
    elif _nine(version, x.shape, dw.shape, stride, pad, groups):
        threads = get_num_threads()
        with conv.blas_on_calling_thread:
            nine_backward_weight(x, dout, dw, threads, nine_tile_images(x.shape, x.shape[1], threads), scratch)
    else:
        conv.backward_weight(x, dout, dw, None, stride, pad, groups, scratch, _paths(version))
    if dbias is not None:
        conv.bias_gradient(dout, dbias)


def conv2d_version(version: int, direction: str):
    """A numbered version's kernel for "forward" (1-18, 20, 21, 23, 25-46), "data" or "weight" (2-18, 20, 21, 23,
    25-46), with the table's signature.

    Versions 2 and 3 check only what they need: they exist to be timed and compared, not called by
    layers."""
    if direction == "forward":
        if version == 1:
            return conv2d_forward_v1_direct
        return lambda x, w, bias, out, stride, pad, groups, scratch: _forward(
            x, w, bias, out, stride, pad, groups, scratch, version
        )
    if direction == "data":
        return lambda dout, w, dx, stride, pad, groups, scratch: _backward_data(
            dout, w, dx, stride, pad, groups, scratch, version
        )
    return lambda x, dout, dw, dbias, stride, pad, groups, scratch: _backward_weight(
        x, dout, dw, dbias, stride, pad, groups, scratch, version
    )

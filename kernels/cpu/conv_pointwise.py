"""1×1 convolutions (groups 1, pad 0) as GEMMs small enough for OpenBLAS's small-matrix kernel: stride 1 (v27),
stride 2 on the kept pixels (v33, at the end of this docstring).

What it computes. A plain 1×1 conv is a GEMM per image on NCHW read in place: forward
``out[n] (K × P) = W (K × C) @ x[n] (C × P)``, backward-data ``dx[n] = Wᵀ @ dout[n]``, weight gradient
``dW = Σ_n dout[n] @ x[n]ᵀ``. v8–v26 ran them per image or in stacked tiles (``conv._pointwise_per_image``,
v16's ``_pointwise_weight_in_place``), one sgemm as large as the layer. Here:

- forward and backward-data (``images``, ``run_images``; path "pointwise"): each image's GEMM is cut
  into blocks of output rows so that rows × pixels × depth ≤ ``SMALL_GEMM_MNK`` (10⁶), on every plane
  size, the images handed out in chunks as before (``threads.run_chunks``). The row blocks do not
  depend on the thread count: the same bits at any thread count. Since v46, on planes of ≥ 56×56 a GEMM
  with fewer output rows than its depth is cut into blocks of pixels instead (``pixel_block``).
- the weight gradient on planes under 16×16 (v31, ``backward_weight_transposed``; path
  "pointwise-weight-transposed"): NN GEMMs over the smaller side transposed, below.
- the weight gradient on planes of ≥ 16×16 (``backward_weight``; path "pointwise-weight-split"):
  each thread owns a block of dW (a range of its longer side: input channels when C ≥ K) and sums
  every image into it, in sub-blocks of ≤ 32 rows × ≤ 1200 elements (``weight_steps``): one hand-out,
  no partial sum, no add pass, no scratch. Its bits depend on the thread count (as v16's partial sums
  did), not on which thread runs what.

Why: the first question was why 144→32 @16×16 forward read 0.51× torch. Its GEMMs were not slow
because of the threads: one thread's 16 images ran 0.54 ms alone (sgemm per image, M = 32, N = 256,
K = 144: ~70 GFLOP/s); side by side each share took ~0.57 and the call ~0.67 (~50 µs of Python
and hand-out before the first chunk, 20–30 µs after the last); torch took 1.24–1.30 ms on one thread
and 0.54 on two. (The 1.0 ms records were calls where both threads ran at half speed at once, right
after a NumPy sgemm: this machine's noise, also seen on the 3×3 records.) What moved it was the GEMM
shape. The same 16 images on one thread, one sgemm per block of output rows, ms (full rows → blocks):
144→32 forward 0.546 → 0.344 (16 rows); 384→64 0.604 → 0.434 (32); 384→96 0.844 → 0.647 (32; 48 rows:
0.955); 64→384 0.539 → 0.439 (192); backward-data 384→64 0.618 → 0.442 (192 rows of dx); 64→384
0.681 → 0.439 (32); 576→96 1.348 → 0.988 (144; 288: 1.379); 960→320 @4×4 2.906 → 1.414 (64; 240:
2.917). The cut is sharp and sits where rows × pixels × depth crosses 10⁶: SciPy's OpenBLAS (0.3.30,
SkylakeX kernels on this Zen 4) runs a GEMM of ≤ 100³ multiply-adds on its small-matrix kernel, which
packs nothing (``sgemm_small_kernel_permit``: MNK ≤ 10⁶; for transposed-A-only calls, the weight
gradient's, also M·N ≤ 1200 and K ≥ 32). Where that kernel does not exist (another BLAS, another
OpenBLAS target) the blocks are just smaller GEMMs.

Measured, batch 32, two threads, calls alternating base / new one by one (30 each, a NumPy 384² sgemm
and ``quiesce`` every 15), median ms v26 → v27: forward 144→32 @16×16 0.641 → 0.400, 192→32 0.840 →
0.519, 32→192 0.686 → 0.536, 384→64 @8×8 0.694 → 0.496, 384→96 0.946 → 0.718, 64→384 0.774 → 0.533,
576→96 1.441 → 1.057, 96→576 1.349 → 1.070, 960→320 @4×4 1.785 → 1.557, 320→1280 2.389 → 2.004, 96→24
@32×32 2.288 → 1.301, 144→24 3.892 → 2.236, 32→16 0.439 → 0.413 (all 20 forward shapes faster,
geometric mean 1.35×); backward-data 384→64 0.753 → 0.510, 64→384 0.901 → 0.558, 576→96 1.704 →
1.156, 960→320 1.975 → 1.743, 32→192 0.985 → 0.588, 24→144 @32×32 5.007 → 3.515 (all 20 faster,
1.34×). Weight gradient, same sitting style, v26 → dW split with 10⁶ blocks along the split side /
≤ 32 × 1200 blocks: 144→32 @16×16 0.758 → 0.644 / 0.440, 192→32 0.962 → 0.805 / 0.577, 32→192 0.800
→ 0.703 / 0.583, 144→24 @32×32 3.252 → 1.611 / 1.537, 16→96 1.174 → 0.754 / 0.724; but on 8×8 the
1200-element blocks lost (384→64 0.803 → 0.705 / 0.770, 96→576 1.427 → 1.352 / 1.661: 64-deep GEMMs)
and on 4×4 the split did (160→960 1.182 → 0.967 / 1.699; 576→160 0.812 → 0.902). In ``engine kernels``
(below) the 8×8 weight gradients came out level or behind (192→64 0.424 / 0.440 → 0.458 / 0.604 ms in
two sittings), so the split is for ≥ 16×16 only (``WEIGHT_SPLIT_MIN_PIXELS``).

``engine kernels --ops conv2d --compare torch --no-versions --repeat 7``, main's tree and this one
alternating (each a fresh process, one pair per CPU-lock hold, two pairs), median of our ms over the
runs, main → v27 (the 1×1 stride-1 records; the unchanged stride-2 1×1 records moved 0.61–1.18× between the trees: this
machine's noise):
forward 144→32 @16×16 0.816 / 0.969 → 0.421 / 0.414, 384→64 @8×8 0.665 / 0.932 → 0.489 / 0.517,
384→96 0.941 / 1.306 → 0.766 / 0.792, 576→96 1.375 / 1.512 → 1.624 (one run 2.20, the other 1.04) /
1.054, 960→160 @4×4 0.907 / 1.331 → 0.779 / 0.758; backward-data 384→64 0.698 / 1.003 → 0.536 / 0.566,
960→320 1.769 / 2.533 → 1.591 / 1.549, 64→384 0.770 / 0.776 → 0.552 / 0.598; weight 144→32 0.769 /
0.808 → 0.643 / 0.461, 96→24 @32×32 2.175 / 2.107 → 0.981 / 1.021. Ratios against torch's median
over all four runs of a pair, 1×1 stride-1 records (57) geometric mean 1.006 → 1.220 and 0.987 →
1.273, records below 0.8 11 → 10 and 16 → 6 (the second pair with the weight split on ≥ 8×8). With
the final rules (weight split on ≥ 16×16), a third pair: 0.996 → 1.256, below 0.8 17 → 1 (960→160
@4×4 weight gradient, a path v27 does not touch, 0.74); all 123 conv records 1.476 → 1.583, below 0.8
19 → 5 (the stride-2 3×3 forwards and 1×1 weight gradients). The MobileNetV2 training step
(``bench_train.py --models mobilenetv2 --batch-size 32 --steps 12 --threads 2 --frameworks engine``,
trees alternating, eight runs each in two sittings), images/s: main 111.9, 96.0, 117.5, 111.2, 119.8,
114.1, 112.7, 101.7 (median 112.3) → v27 103.6, 121.8, 136.5, 130.5, 104.0, 103.9, 126.3, 131.4
(median 124.1): bimodal on both trees, ahead on the median.

First tried: the weight gradient split over dW without any blocking (one sgemm per thread per image):
interleaved, 1.07× v26 over 8×8 and 16×16 shapes (144→32 0.697 → 0.663, 192→64 0.461 → 0.390),
1.16× in the three-way run above against 1.22× with the 10⁶ blocks. Also measured and left as they
were: cutting the forward's batch into 1 or 2 chunks per thread instead of 4 (144→32 0.678 / 0.692 /
0.755 ms, level within noise), and splitting the forward over output channels or pixels between the
two threads instead of over images (144→32 0.795 → 0.484 / 0.498, but 384→96 1.12 → 1.25 and 960→320
@4×4 1.95 → 3.2 / 6.9): the gain there was the smaller GEMMs, which the row blocks give without it.

Tried and dropped (2026-11-26, after v35): cutting a forward or backward-data GEMM over 10⁶ multiply-adds into
blocks of pixels (all output rows, ≥ 64 pixels each) instead of blocks of output rows, so that no block re-reads
the image. One thread on 16 images that stay in the cache it looked decisive (144→24 @32×32 2.55 ms in 6-row
blocks → 1.07 in 128-pixel blocks), but on the batch, two threads, ``conv.forward`` / ``conv.backward_data``
alternating, median of 15, ms, row → pixel blocks: 144→24 forward 2.16 → 1.74, backward-data 2.15 → 2.18;
96→24 forward 0.89 → 0.96; 24→144 forward 2.40 → 2.44; the 16×16 shapes level (0.40–0.55 either way): the
32×32 layers are bound by reading the batch (19 MiB at 144 channels), not by the blocks.

Cold compile: ``images`` 0.71 s, ``weight_block`` 0.41 s on an empty cache (one job each in a
MobileNetV2 warm-up; ResNet-18 has no plain 1×1 stride-1 conv and compiles neither).

v31: the weight gradient on planes under 16×16 (``backward_weight_transposed``; path
"pointwise-weight-transposed", ``Paths.pointwise_weight_transposed``). Until v30 8×8 planes ran v16's
``dW += dout_n @ x_nᵀ`` per image (each thread a partial dW, added after) and 4×4 planes im2col's stacked
tiles; issue 13 had them at 0.69–0.89× PyTorch (192→64 @8×8 0.72–0.80 over seven runs, 576→160 @4×4
0.69–0.88). That GEMM reads x transposed: the one case OpenBLAS's small-matrix kernel takes only when
M·N ≤ 1200 and K ≥ 32 (``sgemm_small_kernel_permit`` for SkylakeX: transposed A needs both; NN and NT
only MNK ≤ 10⁶), so a whole-dW GEMM went through the packing path. Now each thread owns a range of dW's
larger side (``transposed_shares``) and the smaller side of each image is transposed into the thread's
scratch (``transpose_images``), so every GEMM is NN, cut into row blocks of ≤ ``SMALL_GEMM_MNK``:

- C ≥ K: ``dWᵀ[c0:c1] (rows × K) += x_n[c0:c1] (rows × P) @ doutᵀ_n (P × K)``, x read in place; the block of
  dWᵀ is written into dw's columns at the end (K × rows floats, once a call);
- K > C: ``dW[k0:k1] += dout_n[k0:k1] @ xᵀ_n`` straight into dw.

The transposed side is the smaller one (each thread transposes all of it: dout on 384→64, x on 64→384), so
the duplicated copy is the cheap one and no partial dW is summed. On planes under 64 pixels the GEMMs take
``TRANSPOSED_TARGET_DEPTH`` (128) pixels of consecutive images (8 images of 4×4), the larger side's rows
gathered side by side (``gather_rows``): a 16-deep GEMM per image ran ~5–10% slower. Scratch: the caller's,
``transposed_workspace_size`` (the transposed images, the gathered rows, the dWᵀ block, per thread).

Measured first, one thread, 16 images, ms (v16 per image → NN with x transposed, one image per GEMM):
192→64 @8×8 0.335 → 0.301, 384→64 0.602 → 0.610 (its x transposition alone 0.158: hence the smaller side),
96→576 1.228 → 1.067, 960→320 @4×4 1.761 → 1.660 (→ 1.503 with 8 images per GEMM). One share alone (half of
dW, 32 images, one thread, with the first transposition): 576→160 @4×4 0.486 ms, of which 0.035 transposes
and 0.020 gathers; its GEMMs ran at ~109 GFLOP/s (NumPy's 1024³ sgemm: ~85 per core here), so what is left
is outside them: the two-thread call costs ~0.08 ms more than a share (``run_shares``' round trip alone is
35 µs, the whole table call on a tiny shape 59 µs).

Two threads, batch 32, ``conv.backward_weight`` with v30's and v31's paths alternating call by call (10 each,
twice, a NumPy 384² sgemm and ``quiesce`` before each round), median ms, v30 → v31, two sittings:
192→64 @8×8 0.479 → 0.354 / 0.455 → 0.336, 64→384 0.677 → 0.566 / 0.697 → 0.581, 384→64 0.757 → 0.567 /
0.747 → 0.566, 384→96 1.019 → 0.845 / 1.016 → 0.833, 96→576 1.379 → 1.166 / 1.427 → 1.183, 576→96 1.436 →
1.182 / 1.471 → 1.196, 576→160 @4×4 0.665 → 0.556 / 0.712 → 0.585, 160→960 0.979 → 0.823 / 1.088 → 0.876,
960→160 1.026 → 0.878 / 1.223 → 0.953, 960→320 1.926 → 1.723 / 2.035 → 1.769, 320→1280 2.492 → 2.102 /
2.533 → 2.146 (1.12–1.35×, every shape). PyTorch (``aten.convolution_backward``, two threads, its own
process, median of 40) in a third sitting, before and after the same comparison: 192→64 0.571 / 0.568 (v31
0.372), 384→64 0.939 / 0.944 (0.654), 576→160 0.878 / 0.883 (0.700), 960→320 2.364 / 2.278 (1.931); in
``engine kernels``' first run of the day PyTorch's best was 0.474, 0.596, 0.567 and 1.639 ms on the same
four: this machine's two states (kernels/README.md has the record runs).

Tried and dropped: both sides transposed and the GEMM as ``Aᵀ·B`` (NT in OpenBLAS's terms, also a small-kernel
case), one thread, 16 images: 3–25% slower than NN on every 8×8 and 4×4 shape (64→384 0.633 against 0.524 ms,
96→576 1.331 against 1.067); 2 images per GEMM on 8×8 (faster on 64→384 and 96→576 in one sitting, slower on
all six in the next); row blocks of ≤ 2.5·10⁵ multiply-adds (192→64 faster in one sitting, 96→576 and 576→96
15–25% slower), of ≤ 2·10⁶ (6–29% slower on 4×4) or uncut (level to 10% slower) instead of 10⁶; 4 instead of
8 images of 4×4 (within 5% either way); 16×16 planes with K > C (32→192 against v27's split: 1.06–1.16× in
three sittings, 0.93–0.97× in three more once the transposition was the final one; ``takes_transposed``).
Cold compile: the path's first call 1.77–1.82 s CPU on an empty cache
(0.22 s warm): one more MobileNetV2 warm-up job (22 → 23); ResNet-18 has no plain 1×1 stride-1 conv.

Stride 2 (v33, path "pointwise-strided"; ResNet-18's downsample shortcuts 64→128 @32×32, 128→256 @16×16,
256→512 @8×8, which ran on im2col). A 1×1 conv at stride s with pad 0 reads input pixel (s·i, s·j) for output
(i, j) (output (H−1)//s + 1 × (W−1)//s + 1: a 7×9 plane gives 4×5) and nothing else, so each direction is the
stride-1 GEMM on those *kept* pixels:

- forward (``run_images(..., stride, scratch)``): per block of ``strided_tile_images`` images (≤
  ``STRIDED_TILE_ELEMENTS``, 256 KiB: 4 images at 64→128, 8 at 128→256, 16 at 256→512) ``move_kept`` gathers
  their kept pixels into the thread's tile, then v27's ``images``, unchanged, runs each image's row-blocked GEMMs
  on the tile into out;
- backward-data: ``images`` runs ``Wᵀ @ dout[n]`` of a block of images into the tile, then ``move_kept`` writes the
  whole of each dx[n], row by row: zeros, then the kept pixels (one pass over dx, no separate zeroing);
- weight gradient (``strided_weight``, driven by ``conv.pointwise_strided_backward_weight``): each thread sums
  its half of the images into dw or one K × C partial (added in thread order, as the im2col path does), one
  β = 1 sgemm per block of images placed side by side (x's kept pixels and dout copied into [C, b·P] and
  [K, b·P]; one image: dout read in place), b = ``STRIDED_WEIGHT_MIN_DEPTH`` (256) // P: 1, 4 and 16.

Same bits: forward and backward-data at every thread count (a gather is a copy; each image's GEMMs do not
depend on which tile or thread holds it), the weight gradient at a given thread count (its partials).

Measured, batch 32, two threads, median of 21 calls alternating v30's im2col / v33 in one process (quiesce
every 7), ms (best call in brackets): forward 64→128 1.124 → 0.913 (1.032 → 0.808), 128→256 0.920 → 0.720,
256→512 0.861 → 0.704; backward-data 1.388 → 1.024, 1.132 → 0.830, 1.194 → 0.826; weight 1.175 → 1.018,
1.074 → 0.922, 0.961 → 0.887 (0.854 → 0.814). Against PyTorch (``engine kernels --models resnet18 --ops
conv2d --compare torch --no-versions --repeat 7 --format json``, the branch point a8fad6a and this tree
alternating, one pair per CPU-lock hold, two pairs; torch's best-of-7 ms over the four runs in brackets), ratio
torch / ours, v30 → v33: forward 64→128 1.22 / 0.97 → 1.06 / 1.72 (1.10–1.43), 128→256 0.90 / 0.88 → 1.15 /
1.24 (0.79–0.85), 256→512 0.90 / 0.89 → 1.08 / 1.05 (0.73–0.75); backward-data 4.11 / 8.55 → 11.61 / 10.22
(torch 5.0–10.8), 1.26 / 1.25 → 1.63 / 1.71, 1.08 / 1.09 → 1.53 / 1.55 (1.20–1.26); weight 1.16 / 1.13 → 1.46
/ 1.70, 0.89 / 0.87 → 1.02 / 1.03 (0.85–0.90), 0.96 / 0.90 → 1.00 / 1.00 (0.80–0.81). The nine records'
geometric mean 1.21 / 1.26 → 1.57 / 1.68; the other 24 conv records of ResNet-18 1.43 / 1.44 → 1.40 / 1.43
(untouched; noise). The weight gradients are at OpenBLAS's GEMM rate: 16 images of 256→512 on one thread take
0.72 ms, of which 0.66–0.68 the GEMMs (~100 GFLOP/s, a 512 × 256 × 64 sgemm alone: 100.6) and 0.08 the copies;
two threads side by side each take ~0.85 (two 16-GEMM loops side by side: 3–17% slower than one alone), about
torch's 0.80 for the whole call.

Tried and measured (same sittings, medians of 15–21 alternating calls, ms): the forward gathering per image
(64→128 1.370, 128→256 0.821, 256→512 0.750) against blocks of 4 images (1.047, 0.755, 0.724), 8 (—, 0.743,
0.723) and 16 (—, 0.768, 0.721), or the thread's whole share at once (1.173, 0.806, 0.718); blocks of images
side by side in one wider GEMM and a scatter of the result (2 images: 1.170, 0.793, 0.744; 4: 1.569, 0.842,
0.751; a share: 3.421, 1.618, 0.957): the per-image GEMMs stay, the gather goes by 256 KiB. Backward-data in
two chunks instead of eight: level (0.861 / 0.850, 0.733 / 0.756, 0.730 / 0.746). The weight gradient's GEMMs in
blocks of 32 or 64 rows of dW (OpenBLAS's small kernel): 15–40% slower (256→512, one image a GEMM: 1.311 / 1.116
/ 0.953 for 32 / 64 / all rows); dW split over output channels between the threads (each gathering all of x,
no partial): level (0.898 / 0.892 with blocks of four; 0.843 / 0.865 with 256-deep blocks, 11 rounds of
best-of-7); GEMM depth 64 against 256: 0.820 / 0.808 (256→512), 0.851 / 0.840 (128→256).

Cold compile (ResNet-18's warm-up jobs one after another in one process, empty cache, ``time.process_time``
per job): the path's forward job (``images``, new to ResNet-18, and ``move_kept``; backward-data shares the job)
1.03–1.08 s of CPU, its weight job (``strided_weight``) 0.64 s: +1.7 s of job CPU on ResNet-18's 21 → 23 jobs
(all jobs 26.0 s on the branch point a8fad6a, 26.1–27.7 s here: that total moves by ±1 s run to run), about
+0.85 s of wall on the two-worker warm-up, on a cold − warm of ~13.5–14.5 s against the 15 s goal (the README
command's cold − warm itself not measured). First written with the stride inside ``images`` (gather and scatter
inlined there): the same speed (forward and backward-data level within 1–2%, median of 9 rounds of best-of-7)
and the same cost for ResNet-18 (1.04 + 0.70 s), but MobileNetV2's ``images`` job grew 0.52 → 0.99 s for code it
never runs; with ``images`` unchanged it stays 0.48.
"""

from __future__ import annotations

import numpy as np
from numba import njit, uint64

from kernels.cpu.conv_shifted import row_block, sgemm
from kernels.cpu.threads import chunk_count, run_chunks, run_shares


@njit(cache=True, nogil=True)
def weight_block(x, dout, dw, k0, k1, c0, c1, k_step, c_step, p_step):
    """dw[k0:k1, c0:c1] = Σ_n dout[n, k0:k1] @ x[n, c0:c1]ᵀ (1×1 stride 1, NCHW) in sub-blocks of
    ``k_step`` × ``c_step``, each summed image after image and, within an image, over blocks of ``p_step`` pixels
    (β = 1 from the first GEMM on)."""
    n_images, c_total, k_total = x.shape[0], x.shape[1], dout.shape[1]
    pixels = x.shape[2] * x.shape[3]
    x_flat, d_flat, w_flat = x.reshape(x.size), dout.reshape(dout.size), dw.reshape(dw.size)
    scalars = np.empty(2, np.float32)
    if n_images == 0:
        for k in range(k0, k1):
            for c in range(c0, c1):
                w_flat[k * c_total + c] = 0.0
        return
    for kb in range(k0, k1, k_step):
        rows = min(k_step, k1 - kb)
        for cb in range(c0, c1, c_step):
            columns = min(c_step, c1 - cb)
            for n in range(n_images):
                for p0 in range(0, pixels, p_step):
                    sgemm(
                        False, True, rows, columns, min(p_step, pixels - p0),
                        d_flat[(n * k_total + kb) * pixels + p0 :], pixels,
                        x_flat[(n * c_total + cb) * pixels + p0 :], pixels,
                        0.0 if n == 0 and p0 == 0 else 1.0, w_flat[kb * c_total + cb :], c_total, scalars,
                    )  # fmt: skip


def split_blocks(k: int, c: int, threads: int) -> list[tuple[int, int, int, int]]:
    """The dW blocks ``(k0, k1, c0, c1)``, one per share: dW's longer side (input channels when C ≥ K)
    cut into ``threads`` near-equal ranges (fewer when that side is shorter than ``threads``)."""
    if c >= k:
        shares = max(1, min(threads, c))
        return [(0, k, t * c // shares, (t + 1) * c // shares) for t in range(shares)]
    shares = max(1, min(threads, k))
    return [(t * k // shares, (t + 1) * k // shares, 0, c) for t in range(shares)]


def weight_steps(
    k_block: int, c_block: int, pixels: int, split_on_c: bool, limit: int, pixel_blocks: bool = True
) -> tuple[int, int, int]:
    """Sub-blocks (output channels, input channels, pixels) of one thread's dW block of ``k_block`` × ``c_block``:
    on planes of ≥ ``SMALL_TN_MIN_PIXELS`` at most ``SMALL_TN_ROWS`` × (``SMALL_TN_ELEMENTS`` / rows)
    and ≤ ``limit`` multiply-adds (OpenBLAS's small-matrix kernel takes them); on smaller planes cut
    along the split side only, to ≤ ``limit`` multiply-adds (0: no cut). Every pixel in one GEMM but on planes of
    ≥ ``PIXEL_BLOCKS_MIN_PIXELS`` (``pixel_blocks``, v46): there a sub-block of dW is as wide as
    ``SMALL_TN_ELEMENTS`` allows and its GEMMs take the pixels in blocks within ``limit``.

    Why the pixel blocks (v46). The limit cut the dW block's width instead, so each image's rows of dout were read
    once per few input channels: MobileNetV2's 16→96 @112×112 (24 × 3 sub-blocks of a 48 × 16 thread block, 12544
    pixels) read dout six times. Cut in pixels the sub-block is 24 × 16 and dout is read once. Two threads, median of
    three rounds of the median of 11 calls, ms, width cut → pixel blocks: batch 8 16→96 @112 6.62 → 3.09, 32→16
    @112 0.84 → 0.83, 24→144 @56 1.18 → 1.26; batch 32 35.00 → 11.75, 7.09 → 4.62, 7.59 → 5.88; 96→24 and 144→24
    @56 and the 28×28 and CIFAR layers level (0.95–1.09). Its sums run over the pixel blocks of each image, so the
    bits differ from the width cut's (relative difference ≤ 6·10⁻⁷ of the largest entry)."""
    if limit <= 0:
        return k_block, c_block, pixels
    if pixels >= SMALL_TN_MIN_PIXELS:
        k_step = row_block(k_block, 1, 1, SMALL_TN_ROWS)
        if pixel_blocks and pixels >= PIXEL_BLOCKS_MIN_PIXELS:
            c_step = row_block(c_block, 1, 1, max(1, SMALL_TN_ELEMENTS // k_step))
            return k_step, c_step, min(pixels, max(16, limit // (k_step * c_step) // 16 * 16))
        most = max(1, min(SMALL_TN_ELEMENTS // k_step, limit // (k_step * pixels)))
        return k_step, row_block(c_block, 1, 1, most), pixels
    if split_on_c:
        return k_block, row_block(c_block, k_block, pixels, limit), pixels
    return row_block(k_block, c_block, pixels, limit), c_block, pixels


def backward_weight(x, dout, dw, threads: int, limit: int = 0, pixel_blocks: bool = True) -> None:
    """dW of a 1×1 stride-1 conv (groups 1) on ``threads`` threads, each owning one block of dW
    (``split_blocks``), cut into sub-blocks by ``weight_steps`` (``limit`` 0: no cut): no scratch."""
    k, c, pixels = dw.shape[0], dw.shape[1], x.shape[2] * x.shape[3]
    blocks = split_blocks(k, c, threads)
    k0, k1, c0, c1 = blocks[0]
    steps = weight_steps(k1 - k0, c1 - c0, pixels, c >= k, limit, pixel_blocks)
    if len(blocks) == 1:
        weight_block(x, dout, dw, *blocks[0], *steps)
        return
    run_shares(lambda t: weight_block(x, dout, dw, *blocks[t], *steps), len(blocks))


SMALL_GEMM_MNK = 1_000_000
"""Per-image GEMMs are cut into blocks of output rows so that rows × pixels × depth ≤ this."""

SMALL_TN_MIN_PIXELS = 256
SMALL_TN_ROWS = 32
SMALL_TN_ELEMENTS = 1200
"""The weight gradient's GEMMs on planes of ≥ 16×16 in dW blocks of ≤ 32 rows and ≤ 1200 elements."""

WEIGHT_SPLIT_MIN_PIXELS = 256
"""The weight gradient takes this module's split on planes of ≥ 16×16; smaller planes take v31's
``backward_weight_transposed`` (v16–v30: 8×8 v16's images split, one β = 1 sgemm per image and a partial per
extra thread; 4×4 v9's stacked tiles)."""


@njit(cache=True, nogil=True)
def gather_kept(x, n0, count, stride, tile, start, channel_step, image_step):
    """The kept pixels of images [n0, n0 + count) of ``x`` at ``stride`` (1×1, pad 0: pixel (s·i, s·j) of
    the input feeds output (i, j)) into ``tile``: pixel p of channel c of image i at
    ``start + c · channel_step + i · image_step + p``. One image after another (``channel_step`` = P,
    ``image_step`` = C·P: the images' own NCHW planes, what ``images`` runs its per-image GEMMs on) or side
    by side (``channel_step`` = count·P, ``image_step`` = P: one [C, count·P] matrix, ``strided_weight``'s).
    Stride 1 copies whole planes (``strided_weight``'s dout tile)."""
    channels, height, width = x.shape[1], x.shape[2], x.shape[3]
    out_h, out_w = (height - 1) // stride + 1, (width - 1) // stride + 1
    pixels = out_h * out_w
    src, dst = x.reshape(x.size), tile.reshape(tile.size)
    for i in range(count):
        for c in range(channels):
            s0 = uint64(((n0 + i) * channels + c) * height * width)
            d0 = uint64(start + c * channel_step + i * image_step)
            if stride == 1:
                for p in range(pixels):
                    dst[d0 + uint64(p)] = src[s0 + uint64(p)]
                continue
            for y in range(out_h):
                row_in = s0 + uint64(y * stride * width)
                row_out = d0 + uint64(y * out_w)
                for j in range(out_w):
                    dst[row_out + uint64(j)] = src[row_in + uint64(j * stride)]


@njit(cache=True, nogil=True, inline="always")
def scatter_kept(tile, n, stride, dx):
    """dx[n] = the C × P matrix ``tile`` on the kept pixels (stride ``stride``, as ``gather_kept``), zero on
    the others: every element of the image written once, row by row (zeros, then the kept ones)."""
    channels, height, width = dx.shape[1], dx.shape[2], dx.shape[3]
    out_h, out_w = (height - 1) // stride + 1, (width - 1) // stride + 1
    src, dst = tile.reshape(tile.size), dx.reshape(dx.size)
    for c in range(channels):
        plane = uint64((n * channels + c) * height * width)
        line = uint64(c * out_h * out_w)
        for y in range(height):
            row = plane + uint64(y * width)
            for xx in range(width):
                dst[row + uint64(xx)] = 0.0
            if y % stride == 0:
                read = line + uint64((y // stride) * out_w)
                for j in range(out_w):
                    dst[row + uint64(j * stride)] = src[read + uint64(j)]


@njit(cache=True, nogil=True)
def scatter_images(x, n0, count, stride, tile):
    """``scatter_kept`` for images [n0, n0 + count): ``tile`` (count × C × P, one image after another, flat) into
    the whole of each image of ``x``, zeros included."""
    size = tile.size // count
    for i in range(count):
        scatter_kept(tile[i * size : (i + 1) * size], n0 + i, stride, x)


def move_kept(x, n0, count, stride, tile, scatter):
    """Images [n0, n0 + count) between ``x`` (N × C × H × W) and ``tile`` (count × C × P, one image after
    another, flat): gather the kept pixels into the tile (``gather_kept``), or ``scatter`` the tile into the whole
    of each image, zeros included (``scatter_images``). Compiled pieces called from Python: a compiled
    ``move_kept`` compiled ``gather_kept`` again, which ``strided_weight`` calls too (``conv.py``'s module
    docstring, "Compiled pieces, Python drivers")."""
    if scatter:
        scatter_images(x, n0, count, stride, tile)
        return
    pixels = ((x.shape[2] - 1) // stride + 1) * ((x.shape[3] - 1) // stride + 1)
    gather_kept(x, n0, count, stride, tile, 0, pixels, x.shape[1] * pixels)


@njit(cache=True, nogil=True)
def images(src, w, dst, transposed, first, last, block_rows, block_pixels):
    """Images [first, last) of a 1×1 stride-1 conv, one sgemm per block of ``block_rows`` output rows and
    ``block_pixels`` pixels: forward ``dst[n] = w @ src[n]`` (w: K × C), backward-data (``transposed``)
    ``dst[n] = wᵀ @ src[n]``. At stride 2 (v33) ``run_images`` calls it on tiles of kept pixels."""
    depth, rows = src.shape[1], dst.shape[1]
    pixels = src.shape[2] * src.shape[3]
    s_flat, w_flat, d_flat = src.reshape(src.size), w.reshape(w.size), dst.reshape(dst.size)
    scalars = np.empty(2, np.float32)
    for n in range(first, last):
        for p0 in range(0, pixels, block_pixels):
            columns = min(block_pixels, pixels - p0)
            for m0 in range(0, rows, block_rows):
                block = min(block_rows, rows - m0)
                if transposed:
                    sgemm(
                        True, False, block, columns, depth, w_flat[m0:], rows,
                        s_flat[n * depth * pixels + p0 :], pixels, 0.0, d_flat[(n * rows + m0) * pixels + p0 :],
                        pixels, scalars,
                    )  # fmt: skip
                else:
                    sgemm(
                        False, False, block, columns, depth, w_flat[m0 * depth :], depth,
                        s_flat[n * depth * pixels + p0 :], pixels, 0.0, d_flat[(n * rows + m0) * pixels + p0 :],
                        pixels, scalars,
                    )  # fmt: skip


PIXEL_BLOCKS_MIN_PIXELS = 56 * 56
"""v46: on planes of at least this many pixels a stride-1 1×1 conv's per-image GEMM with fewer output rows than its
depth is cut into blocks of pixels (every output row) of ≤ ``SMALL_GEMM_MNK`` multiply-adds (``pixel_block``), not
into blocks of output rows."""

PIXEL_BLOCK_MIN = 64
"""The fewest pixels a block of ``pixel_block`` takes: below, the rows are cut instead."""


def pixel_block(rows: int, depth: int, pixels: int, limit: int) -> int:
    """Pixels per GEMM of a 1×1 conv's image (v46): all of them on planes under ``PIXEL_BLOCKS_MIN_PIXELS``, where
    ``limit`` is 0 or where the GEMM has as many output rows as its depth or more; else the most, in whole 16-pixel
    vectors, that keep rows × depth × pixels ≤ ``limit`` (OpenBLAS's small-matrix kernel), unless that is under
    ``PIXEL_BLOCK_MIN`` (then all: the rows are cut).

    Why. Cut into rows, a GEMM re-reads the image for every block of rows. At 224×224 MobileNetV2's planes of
    112×112 and 56×56 hold 0.5–1.8 MB per image, and 144→24 @56×56 ran 12 blocks of two rows; 96→16 @112×112
    backward-data ran one GEMM per image on OpenBLAS's packing path (a row past the limit already). Cut into
    pixels, every block reads its columns of the image once and the weights (≤ 15 K floats) again. That wins
    where the output is the narrow side (a projection's forward, an expansion's backward-data) and loses where it
    is the wide one, whose blocks are then a few pixels wide. MobileNetV2's 1×1 layers at 224, two threads,
    median of three alternating rounds of the median of 11 calls, ms, row blocks → pixel blocks everywhere (the
    rule takes the first five of each batch size): batch 8 (the chunk ``engine/layers/chunked.py`` runs) forward
    32→16 @112 1.23 → 0.86, 96→24 @56 0.98 → 0.62, 144→24 @56 1.51 → 0.93, backward-data 16→96 @112 6.01 → 3.64,
    24→144 @56 2.10 → 1.01; the wide side lost: forward 16→96 2.25 → 3.86, 24→144 0.97 → 1.16, backward-data
    32→16 1.00 → 1.25, 96→24 0.65 → 0.70, 144→24 0.92 → 1.01. Batch 32 the same way: 6.53 → 5.15, 6.56 → 4.02,
    8.94 → 5.84, 24.02 → 15.96, 11.79 → 6.45 (lost: 10.58 → 15.97, 5.64 → 6.12, 5.68 → 7.15, 4.00 → 4.38, 5.13 →
    6.02). The same bits as the row blocks at every shape measured. A block past the limit (1024 pixels and more on
    96→16) took the packing path and lost the gain. On 28×28 and 14×14 planes the blocks changed nothing (0.94–1.04),
    on CIFAR's 32×32 they were level or behind (the docstring's "Tried and dropped (2026-11-26)")."""
    if limit <= 0 or pixels < PIXEL_BLOCKS_MIN_PIXELS or rows >= depth:
        return pixels
    most = (limit // max(1, rows * depth)) // 16 * 16
    return pixels if most < PIXEL_BLOCK_MIN else min(pixels, most)


def run_images(
    src, w, dst, transposed: bool, threads: int, limit: int | None = None, stride: int = 1, scratch=None,
    pixel_blocks: bool = True,
) -> None:
    """``images`` over the batch in chunks (``threads.run_chunks``: whichever thread is free takes the next),
    in row blocks (or, v46, pixel blocks: ``pixel_block``; ``pixel_blocks`` False for the study's earlier versions)
    of ≤ ``limit`` multiply-adds (default ``SMALL_GEMM_MNK``).

    Stride > 1 (v33): per block of ``strided_tile_images`` images of a chunk, in the thread's slice of
    ``scratch`` (``strided_workspace_size``), the forward gathers the kept pixels (``move_kept``) and runs
    ``images`` on them into out; backward-data runs ``images`` into the tile and scatters it into dx with its
    zeros (``move_kept``). ``images`` then has the signature it has at stride 1: nothing more to compile.

    Where a single output row's GEMM (depth × pixels) is already past ``limit``, no block reaches the
    small-matrix kernel, and cutting the rows only reads the whole source panel once per block: all rows go
    in one GEMM. The case that showed it, MobileNetV2's 16→96 @112×112 backward-data at 224 (depth 96,
    12,544 pixels: 1.2·10⁶ a row, so 16 one-row GEMMs, each re-reading 4.8 MB of dout): batch 32, two
    threads, best of 7, ms, by rows per block 1 / 2 / 4 / 8 / 16: 131.4 / 85.1 / 48.7 / 28.8 / 28.9
    (torch 77.3 in ``engine kernels --compare torch --image-size 224``). The other 1×1 stride-1 layers at
    224 stay under the limit a row and keep their blocks, which won there: e.g. 144→24 @56×56 forward
    8.86 ms in blocks against 20.00 in one GEMM, 24→144 6.48 against 16.88 (2026-11-27, AMD EPYC, quiet)."""
    n_images = src.shape[0]
    limit = SMALL_GEMM_MNK if limit is None else limit
    pixels = src.shape[2] * src.shape[3] if transposed else dst.shape[2] * dst.shape[3]  # the output plane
    columns = pixel_block(dst.shape[1], src.shape[1], pixels, limit) if stride == 1 and pixel_blocks else pixels
    if src.shape[1] * columns > limit:  # one row is past the small-matrix kernel already: blocks only re-read src
        limit = 0
    block = row_block(dst.shape[1], src.shape[1], columns, limit)
    if stride == 1:
        chunks = chunk_count(n_images, 1, threads)
        run_chunks(
            lambda c, slot: images(
                src, w, dst, transposed, c * n_images // chunks, (c + 1) * n_images // chunks, block, columns
            ),
            chunks, threads,
        )  # fmt: skip
        return
    kept = src if transposed else dst
    channels, out_h, out_w = w.shape[1], kept.shape[2], kept.shape[3]
    tile_images = strided_tile_images((n_images, channels), pixels, threads)
    share = channels * pixels * tile_images
    chunks = chunk_count(n_images, tile_images, threads)

    def work(c: int, slot: int) -> None:
        tile = scratch[slot * share : (slot + 1) * share].reshape(tile_images, channels, out_h, out_w)
        last = (c + 1) * n_images // chunks
        for n0 in range(c * n_images // chunks, last, tile_images):
            count = min(tile_images, last - n0)
            flat = tile[:count].reshape(-1)
            if transposed:
                images(src[n0 : n0 + count], w, tile[:count], True, 0, count, block, pixels)
                move_kept(dst, n0, count, stride, flat, True)
            else:
                move_kept(src, n0, count, stride, flat, False)
                images(tile[:count], w, dst[n0 : n0 + count], False, 0, count, block, pixels)

    run_chunks(work, chunks, threads)


# ----------------------------------------------------------------------------------------------
# v31: the weight gradient on planes under 16×16 as non-transposed GEMMs (path "pointwise-weight-transposed")
# ----------------------------------------------------------------------------------------------

TRANSPOSED_MIN_DEPTH = 64
"""Images per GEMM on planes of fewer pixels than this: enough for ``TRANSPOSED_TARGET_DEPTH`` pixels of depth;
8×8 planes (64 pixels) run one image per GEMM."""

TRANSPOSED_TARGET_DEPTH = 128
"""The depth (pixels of consecutive images) of each GEMM on planes under ``TRANSPOSED_MIN_DEPTH`` pixels:
8 images of 4×4."""


def takes_transposed(x_shape) -> bool:
    """Whether a plain 1×1 weight gradient takes ``backward_weight_transposed`` (v31): planes under
    ``WEIGHT_SPLIT_MIN_PIXELS`` (16×16). At 16×16 with K > C it went both ways against v27's split (32→192, two
    threads, batch 32, median ms of alternating calls, v27 → v31, six sittings: 0.757 → 0.655, 0.740 → 0.681,
    0.620 → 0.586, then with the final transposition 0.609 → 0.657, 0.837 → 0.868, 0.576 → 0.593; 144→32 and
    192→32 level), so 16×16 stays on v27's split."""
    return x_shape[2] * x_shape[3] < WEIGHT_SPLIT_MIN_PIXELS


def transposed_group(x_shape) -> int:
    """Images per GEMM of ``backward_weight_transposed``: 1 on planes of ≥ 64 pixels, else enough for a
    depth of ``TRANSPOSED_TARGET_DEPTH`` (never more than the batch)."""
    pixels = x_shape[2] * x_shape[3]
    if pixels >= TRANSPOSED_MIN_DEPTH:
        return 1
    return max(1, min(x_shape[0], -(-TRANSPOSED_TARGET_DEPTH // max(1, pixels))))


def transposed_shares(w_shape, threads: int) -> int:
    """Threads that get a share: one per row of the larger side at most."""
    return max(1, min(threads, max(w_shape[0], w_shape[1])))


def transposed_share_size(x_shape, w_shape, threads: int) -> int:
    """Scratch (float32) of one share: the smaller side of ``group`` images transposed (pixels × channels),
    the larger side's rows of those images side by side (only when ``group`` > 1) and, when the larger side
    is x (C ≥ K), the share's block of dWᵀ."""
    k, c = w_shape[0], w_shape[1]
    pixels = x_shape[2] * x_shape[3]
    group = transposed_group(x_shape)
    big, small = (c, k) if k <= c else (k, c)
    rows = -(-big // transposed_shares(w_shape, threads))
    return group * pixels * small + (rows * group * pixels if group > 1 else 0) + (rows * k if k <= c else 0)


def transposed_workspace_size(x_shape, w_shape, threads: int) -> int:
    """Scratch (float32) of ``backward_weight_transposed`` on ``threads`` threads: one share's per thread."""
    return transposed_shares(w_shape, threads) * transposed_share_size(x_shape, w_shape, threads)


@njit(cache=True, nogil=True)
def transpose_images(a, n0, images, dst):
    """dst[(i·P + p)·S + s] = a[n0 + i, s, p] (a: N × S × P): images n0 … n0 + images − 1, each P × S,
    one after the other. Eight channels at a time: eight loads a plane apart, one contiguous run of eight
    stores. Of the orders tried, the fastest (32 images, one thread, ms, this / every channel read in order
    and written with a stride of S / 16-channel strips written in rows / 8 × 8 blocks through a local array):
    32 ch @16×16 0.074 / 0.121 / – / 0.186; 64 ch @8×8 0.037 / 0.040 / 0.052 / 0.095; 160 ch @4×4 0.023 /
    0.024 / 0.033 / 0.063."""
    channels, pixels = a.shape[1], a.shape[2] * a.shape[3]
    src = a.reshape(a.size)
    plane = uint64(pixels)
    for i in range(images):
        base = uint64((n0 + i) * channels * pixels)
        out = uint64(i * pixels * channels)
        s0 = 0
        while s0 + 8 <= channels:
            row = base + uint64(s0 * pixels)
            for p in range(pixels):
                at = out + uint64(p * channels + s0)
                q = row + uint64(p)
                dst[at] = src[q]
                dst[at + uint64(1)] = src[q + plane]
                dst[at + uint64(2)] = src[q + uint64(2) * plane]
                dst[at + uint64(3)] = src[q + uint64(3) * plane]
                dst[at + uint64(4)] = src[q + uint64(4) * plane]
                dst[at + uint64(5)] = src[q + uint64(5) * plane]
                dst[at + uint64(6)] = src[q + uint64(6) * plane]
                dst[at + uint64(7)] = src[q + uint64(7) * plane]
            s0 += 8
        for s in range(s0, channels):
            row = base + uint64(s * pixels)
            for p in range(pixels):
                dst[out + uint64(p * channels + s)] = src[row + uint64(p)]


@njit(cache=True, nogil=True)
def gather_rows(a, n0, images, b0, b1, dst):
    """dst[b·(images·P) + i·P + p] = a[n0 + i, b0 + b, p]: channels b0 … b1 − 1 of several images side by side."""
    channels, pixels = a.shape[1], a.shape[2] * a.shape[3]
    src = a.reshape(a.size)
    width = images * pixels
    for b in range(b1 - b0):
        for i in range(images):
            s0 = uint64(((n0 + i) * channels + b0 + b) * pixels)
            d0 = uint64(b * width + i * pixels)
            for p in range(pixels):
                dst[d0 + uint64(p)] = src[s0 + uint64(p)]


@njit(cache=True, nogil=True)
def transposed_share(x, dout, dw, b0, b1, group, mine, limit):
    """Rows [b0, b1) of dW's larger side, summed over every image, as NN GEMMs ≤ ``limit`` multiply-adds.

    C ≥ K: ``dWᵀ[b0:b1] (rows × K) += x_n[b0:b1] (rows × P) @ doutᵀ_n (P × K)``, x read in place (one image
    per GEMM) or gathered (``group`` images side by side), dout transposed into ``mine``; the share's dWᵀ
    block is then written into dw's columns b0 … b1 − 1. K > C: ``dW[b0:b1] += dout_n[b0:b1] @ xᵀ_n``
    straight into dw. ``mine``: ``transposed_share_size`` floats."""
    n_images, c_total, k_total = x.shape[0], x.shape[1], dout.shape[1]
    pixels = x.shape[2] * x.shape[3]
    on_c = k_total <= c_total
    big = x if on_c else dout
    small = dout if on_c else x
    big_channels, small_channels = big.shape[1], small.shape[1]
    rows = b1 - b0
    big_flat, w_flat = big.reshape(big.size), dw.reshape(dw.size)
    transposed_size = group * pixels * small_channels
    gathered_size = rows * group * pixels if group > 1 else 0
    transposed = mine[:transposed_size]
    gathered = mine[transposed_size : transposed_size + gathered_size]
    result = mine[transposed_size + gathered_size :]
    scalars = np.empty(2, np.float32)
    if n_images == 0:
        for r in range(b0, b1):
            for s in range(small_channels):
                w_flat[s * c_total + r if on_c else r * c_total + s] = 0.0
        return
    for n0 in range(0, n_images, group):
        images = min(group, n_images - n0)
        depth = images * pixels
        transpose_images(small, n0, images, transposed)
        if group > 1:
            gathered_rows = gathered[: rows * depth]
            gather_rows(big, n0, images, b0, b1, gathered_rows)
        beta = 0.0 if n0 == 0 else 1.0
        step = row_block(rows, depth, small_channels, limit)
        for r0 in range(0, rows, step):
            m = min(step, rows - r0)
            if group > 1:
                a_view, lda = gathered[r0 * depth :], depth
            else:
                a_view, lda = big_flat[(n0 * big_channels + b0 + r0) * pixels :], pixels
            if on_c:
                target, ldc = result[r0 * k_total :], k_total
            else:
                target, ldc = w_flat[(b0 + r0) * c_total :], c_total
            sgemm(False, False, m, small_channels, depth, a_view, lda, transposed, small_channels, beta, target, ldc,
                  scalars)  # fmt: skip
    if on_c:
        for k in range(k_total):
            for r in range(rows):
                w_flat[k * c_total + b0 + r] = result[r * k_total + k]


def backward_weight_transposed(x, dout, dw, threads: int, scratch, limit: int | None = None) -> None:
    """dW of a 1×1 stride-1 conv (groups 1) on planes under 16×16 (v31): each thread owns a range of dW's
    larger side (``transposed_shares``), transposes the smaller side of each image (group) into its slice of
    ``scratch`` (``transposed_workspace_size``) and runs NN GEMMs of ≤ ``limit`` multiply-adds (default
    ``SMALL_GEMM_MNK``): OpenBLAS's small-matrix kernel. No partial sums; the bits depend on the thread
    count (the share bounds), not on which thread runs what."""
    limit = SMALL_GEMM_MNK if limit is None else limit
    k, c = dw.shape[0], dw.shape[1]
    big = max(k, c)
    shares = transposed_shares(dw.shape, threads)
    per = transposed_share_size(x.shape, dw.shape, threads)
    group = transposed_group(x.shape)

    def work(t: int) -> None:
        transposed_share(x, dout, dw, t * big // shares, (t + 1) * big // shares, group,
                         scratch[t * per : (t + 1) * per], limit)  # fmt: skip

    if shares == 1:
        work(0)
        return
    run_shares(work, shares)


STRIDED_TILE_ELEMENTS = 1 << 16
"""v33: a strided 1×1 forward (backward-data) gathers (scatters) the kept pixels of as many images at a time as
fit in this many float32 (256 KiB; at most a thread's share of the batch)."""


def strided_tile_images(x_shape, pixels: int, threads: int) -> int:
    """Images per tile of a strided 1×1 forward or backward-data (``run_images``): ``STRIDED_TILE_ELEMENTS`` //
    (C · output pixels), at least 1, at most a thread's share of the batch."""
    share = -(-x_shape[0] // max(1, threads))
    return max(1, min(share, STRIDED_TILE_ELEMENTS // max(1, x_shape[1] * pixels)))


STRIDED_WEIGHT_MIN_DEPTH = 256
"""v33: the strided 1×1 weight gradient sums ``dout @ keptᵀ`` over blocks of images side by side, enough that
each GEMM is at least this deep (one image of 16×16 outputs, four of 8×8, sixteen of 4×4)."""


def strided_weight_images(x_shape, pixels: int, threads: int) -> int:
    """Images per GEMM of the strided 1×1 weight gradient (``strided_weight``)."""
    share = -(-x_shape[0] // max(1, threads))
    return max(1, min(share, -(-STRIDED_WEIGHT_MIN_DEPTH // max(1, pixels))))


def strided_workspace_size(x_shape, w_shape, stride: int, direction: str, threads: int) -> int:
    """Scratch (float32 elements) of a strided 1×1 conv (v33): per thread its tile of kept pixels (forward and
    backward-data: ``strided_tile_images`` images' C × P; weight gradient: x's kept pixels and, for blocks of
    several images, dout side by side), plus one K × C partial dW per extra thread."""
    k, c = w_shape[0], w_shape[1]
    pixels = ((x_shape[2] - 1) // stride + 1) * ((x_shape[3] - 1) // stride + 1)
    if direction in ("forward", "data"):
        return threads * c * pixels * strided_tile_images(x_shape, pixels, threads)
    count = strided_weight_images(x_shape, pixels, threads)
    per_thread = c * pixels * count + (k * pixels * count if count > 1 else 0)
    return threads * per_thread + (threads - 1) * k * c


def strided_weight(x, dout, acc, first, last, stride, tile_images, tile):
    """acc (K × C) = Σ over images [first, last) of dout[n] @ kept(x[n])ᵀ at ``stride`` (v33): blocks of
    ``tile_images`` images side by side (x's kept pixels gathered, dout copied; one image: dout in place), one
    sgemm per block, β = 1 from the second on. A Python loop over compiled pieces, as ``move_kept``."""
    channels, k_total = x.shape[1], dout.shape[1]
    pixels = dout.shape[2] * dout.shape[3]
    d_flat, acc_flat = dout.reshape(dout.size), acc.reshape(acc.size)
    scalars = np.empty(2, np.float32)
    if first >= last:
        acc_flat[:] = 0.0
        return
    for n0 in range(first, last, tile_images):
        count = min(tile_images, last - n0)
        columns = count * pixels
        gather_kept(x, n0, count, stride, tile, 0, columns, pixels)
        if count == 1:
            a_in, lda = d_flat[n0 * k_total * pixels :], pixels
        else:
            a_in, lda = tile[channels * columns :], columns
            gather_kept(dout, n0, count, 1, tile, channels * columns, columns, pixels)
        sgemm(False, True, k_total, channels, columns, a_in, lda, tile, columns, 0.0 if n0 == first else 1.0, acc_flat,
              channels, scalars)

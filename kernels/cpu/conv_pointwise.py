"""1×1 stride-1 convolutions (groups 1) as GEMMs small enough for OpenBLAS's small-matrix kernel (v27).

What it computes. A plain 1×1 conv is a GEMM per image on NCHW read in place: forward
``out[n] (K × P) = W (K × C) @ x[n] (C × P)``, backward-data ``dx[n] = Wᵀ @ dout[n]``, weight gradient
``dW = Σ_n dout[n] @ x[n]ᵀ``. v8–v26 ran them per image or in stacked tiles (``conv._pointwise_per_image``,
v16's ``_pointwise_weight_in_place``), one sgemm as large as the layer. Here:

- forward and backward-data (``images``, ``run_images``; path "pointwise"): each image's GEMM is cut
  into blocks of output rows so that rows × pixels × depth ≤ ``SMALL_GEMM_MNK`` (10⁶), on every plane
  size, the images handed out in chunks as before (``threads.run_chunks``). The row blocks do not
  depend on the thread count: the same bits at any thread count.
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
"""

from __future__ import annotations

import numpy as np
from numba import njit, uint64

from kernels.cpu.conv_shifted import row_block, sgemm
from kernels.cpu.threads import chunk_count, run_chunks, run_shares


@njit(cache=True, nogil=True)
def weight_block(x, dout, dw, k0, k1, c0, c1, k_step, c_step):
    """dw[k0:k1, c0:c1] = Σ_n dout[n, k0:k1] @ x[n, c0:c1]ᵀ (1×1 stride 1, NCHW) in sub-blocks of
    ``k_step`` × ``c_step``, each summed image after image (β = 1 from the second image on)."""
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
                sgemm(
                    False, True, rows, columns, pixels,
                    d_flat[(n * k_total + kb) * pixels :], pixels,
                    x_flat[(n * c_total + cb) * pixels :], pixels,
                    0.0 if n == 0 else 1.0, w_flat[kb * c_total + cb :], c_total, scalars,
                )  # fmt: skip


def split_blocks(k: int, c: int, threads: int) -> list[tuple[int, int, int, int]]:
    """The dW blocks ``(k0, k1, c0, c1)``, one per share: dW's longer side (input channels when C ≥ K)
    cut into ``threads`` near-equal ranges (fewer when that side is shorter than ``threads``)."""
    if c >= k:
        shares = max(1, min(threads, c))
        return [(0, k, t * c // shares, (t + 1) * c // shares) for t in range(shares)]
    shares = max(1, min(threads, k))
    return [(t * k // shares, (t + 1) * k // shares, 0, c) for t in range(shares)]


def weight_steps(k_block: int, c_block: int, pixels: int, split_on_c: bool, limit: int) -> tuple[int, int]:
    """Sub-blocks (output channels, input channels) of one thread's dW block of ``k_block`` × ``c_block``:
    on planes of ≥ ``SMALL_TN_MIN_PIXELS`` at most ``SMALL_TN_ROWS`` × (``SMALL_TN_ELEMENTS`` / rows)
    and ≤ ``limit`` multiply-adds (OpenBLAS's small-matrix kernel takes them); on smaller planes cut
    along the split side only, to ≤ ``limit`` multiply-adds (0: no cut)."""
    if limit <= 0:
        return k_block, c_block
    if pixels >= SMALL_TN_MIN_PIXELS:
        k_step = row_block(k_block, 1, 1, SMALL_TN_ROWS)
        most = max(1, min(SMALL_TN_ELEMENTS // k_step, limit // (k_step * pixels)))
        return k_step, row_block(c_block, 1, 1, most)
    if split_on_c:
        return k_block, row_block(c_block, k_block, pixels, limit)
    return row_block(k_block, c_block, pixels, limit), c_block


def backward_weight(x, dout, dw, threads: int, limit: int = 0) -> None:
    """dW of a 1×1 stride-1 conv (groups 1) on ``threads`` threads, each owning one block of dW
    (``split_blocks``), cut into sub-blocks by ``weight_steps`` (``limit`` 0: no cut): no scratch."""
    k, c, pixels = dw.shape[0], dw.shape[1], x.shape[2] * x.shape[3]
    blocks = split_blocks(k, c, threads)
    k0, k1, c0, c1 = blocks[0]
    k_step, c_step = weight_steps(k1 - k0, c1 - c0, pixels, c >= k, limit)
    if len(blocks) == 1:
        weight_block(x, dout, dw, *blocks[0], k_step, c_step)
        return
    run_shares(lambda t: weight_block(x, dout, dw, *blocks[t], k_step, c_step), len(blocks))


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
def images(src, w, dst, transposed, first, last, block_rows):
    """Images [first, last) of a 1×1 stride-1 conv, one sgemm per block of ``block_rows`` output rows:
    forward ``dst[n] = w @ src[n]`` (w: K × C), backward-data (``transposed``) ``dst[n] = wᵀ @ src[n]``."""
    depth, rows = src.shape[1], dst.shape[1]
    pixels = src.shape[2] * src.shape[3]
    s_flat, w_flat, d_flat = src.reshape(src.size), w.reshape(w.size), dst.reshape(dst.size)
    scalars = np.empty(2, np.float32)
    for n in range(first, last):
        for m0 in range(0, rows, block_rows):
            block = min(block_rows, rows - m0)
            if transposed:
                sgemm(
                    True, False, block, pixels, depth, w_flat[m0:], rows,
                    s_flat[n * depth * pixels :], pixels, 0.0, d_flat[(n * rows + m0) * pixels :], pixels, scalars,
                )  # fmt: skip
            else:
                sgemm(
                    False, False, block, pixels, depth, w_flat[m0 * depth :], depth,
                    s_flat[n * depth * pixels :], pixels, 0.0, d_flat[(n * rows + m0) * pixels :], pixels, scalars,
                )  # fmt: skip


def run_images(src, w, dst, transposed: bool, threads: int, limit: int | None = None) -> None:
    """``images`` over the batch in chunks (``threads.run_chunks``: whichever thread is free takes the next),
    in row blocks of ≤ ``limit`` multiply-adds (default ``SMALL_GEMM_MNK``)."""
    n_images = src.shape[0]
    limit = SMALL_GEMM_MNK if limit is None else limit
    block = row_block(dst.shape[1], src.shape[1], src.shape[2] * src.shape[3], limit)
    chunks = chunk_count(n_images, 1, threads)
    run_chunks(
        lambda c, slot: images(src, w, dst, transposed, c * n_images // chunks, (c + 1) * n_images // chunks, block),
        chunks, threads,
    )  # fmt: skip


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

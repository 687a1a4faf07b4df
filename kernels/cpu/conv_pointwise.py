"""The weight gradient of a 1×1 stride-1 convolution split over dW, not over the images (v27).

What it computes. ``dW[k, c] = Σ_n Σ_p dout[n, k, p] · x[n, c, p]``, read in place from NCHW as v16
does (``conv._pointwise_weight_in_place``: planes of ≥ 64 pixels): one β = 1 sgemm per image,
``dW_block += dout_n[k-rows] @ x_n[c-rows]ᵀ``. What changed is who owns what. v16 gave each thread
half of the *images* and a whole dW: thread 0 summed into dW, thread 1 into a dW-sized slot of
scratch, and a second hand-out added the slot into dW. Here each thread owns a *block of dW* (a
range of its longer side: input channels when C ≥ K, output channels otherwise) and sums every
image into it: one hand-out, no partial sum, no add pass, no scratch.

Why. On two cores every hand-out and every partial is paid per call, and these calls are short
(0.4–2 ms for batch 32): 144→32 @16×16 is 75 MFLOP. Batch 32, two threads, best of 7, median of 5
rounds alternating in one process (each round after a NumPy 384² sgemm and ``quiesce``), ms,
v26 (images) → dW rows (output channels) / dW columns (input channels):

    144→32  @16×16   0.683 → 0.752 / 0.633        64→384 @8×8   0.798 → 0.702 / 0.718
    192→64  @8×8     0.429 → 0.486 / 0.437        32→192 @16×16 0.724 → 0.672 / 0.778
    576→96  @8×8     2.239 → 2.031 / 2.007        96→576 @8×8   1.386 → 1.271 / 1.394
    384→64  @8×8     1.084 → 1.061 / 0.885

so the split goes along dW's longer side (columns when C ≥ K). Tried and dropped in the same sitting:
splitting each thread's block further into 32- or 16-row GEMMs (v26 found 32-row GEMMs ~1.8× faster
for the 27-column stem results): slower or level everywhere (576→96 2.0 → 2.5 ms, 96→576 1.3 → 5.1
with 32-row blocks), these results are 32–576 wide.

What it costs. Each thread reads all of one operand (x when the split is over output channels, dout
otherwise): 1.5–4.7 MB per call that sits in the shared L3 (32 MB here) after the layer's forward.
Each GEMM is half as wide, which is what lost 192→64 rows (M = 32).

Determinism: each dW element is summed by one thread, image after image, by the same sgemm call
shape whatever the thread count's blocks; the blocks depend on the shapes and the thread count only.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from kernels.cpu.conv_shifted import sgemm
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
"""The weight gradient takes this module's split on planes of ≥ 16×16; 8×8 keeps v16's images split
(one β = 1 sgemm per image, a partial per extra thread), 4×4 v9's stacked tiles."""


@njit(cache=True, nogil=True)
def images(src, w, dst, transposed, first, last, row_block):
    """Images [first, last) of a 1×1 stride-1 conv, one sgemm per block of ``row_block`` output rows:
    forward ``dst[n] = w @ src[n]`` (w: K × C), backward-data (``transposed``) ``dst[n] = wᵀ @ src[n]``."""
    depth, rows = src.shape[1], dst.shape[1]
    pixels = src.shape[2] * src.shape[3]
    s_flat, w_flat, d_flat = src.reshape(src.size), w.reshape(w.size), dst.reshape(dst.size)
    scalars = np.empty(2, np.float32)
    for n in range(first, last):
        for m0 in range(0, rows, row_block):
            block = min(row_block, rows - m0)
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


def row_block(rows: int, depth: int, pixels: int, limit: int = SMALL_GEMM_MNK) -> int:
    """Output rows per sgemm: the fewest near-equal blocks with rows × pixels × depth ≤ ``limit``."""
    most = max(1, limit // max(1, pixels * depth))
    blocks = -(-rows // most)
    return -(-rows // blocks)


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

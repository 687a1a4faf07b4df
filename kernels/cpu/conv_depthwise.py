"""Depthwise convolution on the CPU, version 2: flat runs of whole channel planes with border masks.

Since v25 the square 4×4, 8×8, 16×16 and 32×32 planes (every depthwise layer of the CIFAR MobileNetV2)
run ``conv_depthwise_regs`` instead (whole planes in vector registers, 2–5× faster; figures there):
this module serves the other shapes (odd planes, 24×24, large planes, ImageNet sizes).

Why. A depthwise filter (``groups == C == K``) reads one input plane: nine multiply-adds per output
pixel, nothing for a GEMM. Version 1 (``depthwise_forward`` in ``conv.py``) walks one plane at a
time, row by row; on the late MobileNetV2 layers a row is 8 or 4 pixels, so every inner loop is a
few lanes long and the loop set-up costs more than the arithmetic (960 channels @4×4: 10× slower
than torch).

The trick. In NCHW the planes of consecutive channels of one image are contiguous, and at stride 1
tap (r, s) of output q reads the input at q + d with d = (r − 1)·W + (s − 1): the same offset for
every pixel of every plane. So a run of channel planes is one flat loop per image, nine loads and
multiply-adds per output, straight across plane borders. What the borders break (a tap that falls
off the plane reads a pixel of the next row or plane) is zeroed by the *weights*: each tap gets a
weight per position, ``w[c, r, s]`` where the tap stays inside the plane and 0 where it does not,
built once per channel chunk in scratch and used for all the images. Backward to data is the same
loop with the masks mirrored (the transposed filter); backward to weights accumulates per-position
products over the images, then sums each plane's valid positions. Reads that would leave the tensor
itself (the first and last rows) take a checked loop.

Tried first and dropped: copying each channel's planes, zero padding written out, into scratch so
one flat loop covers a block of images (polyphase planes for stride 2). Correct, but the row-by-row
copy in and out cost more than v1 saved on 4×4 and 8×8 planes.

Caveat of masks-as-weights: a tap off the plane multiplies a neighbour's value by 0, so an inf or
NaN in one channel also reaches the border pixels of its neighbour channel (NaN·0 = NaN).

Stride-2 forward on even planes (v7) computes only the kept outputs: input rows 2y and 2y+1 of a
plane are contiguous, so with the output laid out as row pairs (2·OW positions per output row, the
second half unused) output j reads input 2j + d_k, one flat loop again, at half the work of the
full-resolution run (measured one thread, batch 32: 576 ch @8×8 1.14 → 0.85 ms, 192 ch @16×16
1.36 → 1.08 ms; 144 ch @32×32 4.9 ms, as fast as the direct loops it keeps using). Still well
behind oneDNN (0.17 ms at 576 ch @8×8 on a quiet machine, one thread): its nine position-weight
arrays are read for every output, 36 bytes per output, where a channel-blocked layout keeps
the weights in registers; that layout is the next step.

This session (issue 13): the stride-2 row-pair filter read ``x[2j + d]`` for its nine taps, which
LLVM compiled to nine ``vgatherqps`` a vector (slow on Zen 4); the input of each chunk is now split
into its even and odd elements first (``_deinterleave``: two vector loads and a shuffle), after which
every tap is a contiguous run (``_flat_filter_s2``). And the position weights were built per chunk
with the inside test per element (scalar): the tap masks are now built once per call and each chunk's
weights selected from them in one vector loop (``_tap_masks``, ``_position_weights``). The same bits
as before (checked at one and two threads on the shapes below). One thread, 16 images, median of 5
rounds of best-of-7, ms, before → after, forward / backward-data: 192 ch s2 @16×16 0.66 → 0.40 /
0.77 → 0.68; 576 ch s2 @8×8 0.68 → 0.30 / 0.83 → 0.48; 576 ch @8×8 0.63 → 0.43 / 0.65 → 0.43; 384
ch @8×8 0.43 → 0.25 / 0.43 → 0.26; 960 ch @4×4 0.30 → 0.17 / 0.30 → 0.17; 144 ch s2 @32×32 2.04 →
1.17 / 3.30 → 2.41; 32 ch @32×32 0.51 → 0.31 / 0.53 → 0.32. Left: the weight gradient (its stride-2
form still spreads dout over the full-resolution grid, four times the kept positions).

Tried and dropped (the v16 session): the stride-2 weight gradient on the input's four polyphase planes
(x[2y + a, 2x + b] copied per image into four planes at the output's resolution; then tap (r, s)
is dout times one phase plane shifted by 0, −1, −OW or −OW−1, nine multiply-adds per *kept*
output instead of per full-resolution position, a quarter of the arithmetic). Correct (max error
against the reference 1e-5 to 1e-4), but not faster: batch 32, two threads, median of 7 rounds of
best-of-5, ms, full-resolution run / polyphase one image a pass / four images a pass: 144 ch
@32×32 3.44 / 3.61 / 4.78, 192 ch @16×16 0.94 / 0.84 / 1.31, 576 ch @8×8 0.73 / 0.83 / 1.66. The
stride-2 gather that builds the phase planes (a scalar loop) costs what the saved multiply-adds
gave back, and four images' phase planes (16 of them beside nine accumulators) no longer fit L1.

v21 (issue 13, item 2). **The weight gradient by image groups** (``weight_by_groups``): each plane's
nine tap sums in one vector loop with nine lane accumulators (``fastmath={"reassoc", "contract"}`` in
``_tap_sums``/``_tap_sums4`` only), four images a pass so one horizontal sum per tap serves four planes,
the masks applied as selects (a NaN in one channel stays there, tested); at stride 2 only the kept
outputs: the input chunk split into even and odd elements, dout laid on row pairs (``_to_row_pairs``),
the taps of ``_flat_filter_s2``. Determinism: the unit of work is a group of four images, whatever
the thread count, each group's partial dW (C·9) is written by one thread, and the partials are added
in group order (``_sum_partials``). Batch 32, two threads, median of 5 rounds of best-of-7, ms, per-
position accumulators (v20) → by groups, timed alternately in one process: 32 ch @32×32 0.723 →
0.435, 96 ch @32×32 1.967 → 1.258, 144 ch @32×32 3.469 → 1.980, 144 ch s2 @32×32 3.231 → 1.581, 192
ch @16×16 0.740 → 0.629, 192 ch s2 @16×16 0.918 → 0.478, 576 ch s2 @8×8 1.317 → 0.459 (quiet rounds
0.76 / 0.73 → 0.44 / 0.45), 576 ch @8×8 quiet rounds 0.59 / 0.57 → 0.53 / 0.53, 384 ch @8×8 quiet
rounds 0.50 / 0.49 → 0.37 / 0.37; 960 ch @4×4 0.265 → 0.335, so 4×4 keeps v20
(``GROUPS_MIN_PIXELS``). The first form, one image a pass (nine horizontal sums per plane), lost on
the small planes: 576 ch @8×8 0.602 → 0.765, 960 ch @4×4 0.315 → 0.610.

**Forward and backward-data plane by plane on ≥ 16×16** (``plane_forward``, ``PLANES_MIN_PIXELS``
has the figures): the channel's nine weights in registers and the call's tap masks as selects, no
position-weights; the work is (image, chunk) items in memory order. 32×32 planes 4–20% faster, 16×16
at stride 1 6–10%; slower on 8×8 and 4×4, which keep the chunk runs.

Why the small planes are still behind (measured, for the next step): the nine-tap loops are bound by
their loads, not by memory. Hot in L1, one thread, cycles at 3.7 GHz per 16 outputs:
``_flat_filter_s2`` 37–46 (runs of 256 to 4096), ``_flat_filter_fast`` 31; a chunk of 8 channels
@8×8 at stride 2 costs ~880 cycles (deinterleave 154, filter 591, keeping the halves 130). Each 16
outputs load 18 zmm vectors (nine position-weights, nine taps, the taps misaligned so each splits
two cache lines) and the adds are not fused (no ``contract``). Tried and dropped: software prefetch
of the next image's chunk (``llvm.prefetch``; one thread, 576 ch s2 @8×8: 0.64 → 0.64 ms, so not
memory latency); row pairs with the weights broadcast per plane and two masks instead of nine
position-weights (9 + 2 loads an output; two threads: 576 ch s2 @8×8 0.445 → 0.536 ms, 192 ch s2
@16×16 0.453 → 0.413: the per-plane loop of two vectors costs more than the loads it saves). The
layout that would vectorize: channels in lanes ([position][16 channels], weights in registers,
aligned loads), at the price of a transpose in and out.

Threads: thread ``t`` owns channel chunks ``[t·chunks/T, (t+1)·chunks/T)`` and a fixed slice of the
caller's scratch (one serial share each, run by ``threads.run_shares``: on ``prange`` the shares were
often queued on one CPU, figures in ``threads``' docstring, and the two parfor drivers cost compile
time), so every output and every weight-gradient sum is computed by one thread in one
fixed order: the same bits on every call with the same thread count.
"""

from __future__ import annotations

import os

import numpy as np
from numba import get_num_threads, njit, uint64

from kernels.cpu.threads import run_shares

L1D_FALLBACK_BYTES = 32 * 1024
"""The L1 data cache assumed where the OS does not say (the smallest of current x86 cores)."""

CHUNK_STREAMS = 11
"""Float arrays of a chunk's length that the nine-tap loop keeps live: the nine position-weights,
the input run and the output run."""


def l1d_bytes(root: str = "/sys/devices/system/cpu/cpu0/cache") -> int:
    """CPU 0's level-1 data cache in bytes, from Linux's sysfs; ``L1D_FALLBACK_BYTES`` elsewhere."""
    try:
        for entry in sorted(os.listdir(root)):
            folder = os.path.join(root, entry)
            with open(os.path.join(folder, "level")) as f:
                level = f.read().strip()
            with open(os.path.join(folder, "type")) as f:
                kind = f.read().strip()
            if level == "1" and kind in ("Data", "Unified"):
                with open(os.path.join(folder, "size")) as f:
                    size = f.read().strip().upper()
                scale = {"K": 1024, "M": 1024 * 1024}.get(size[-1:], 1)
                value = int(size.rstrip("KM")) * scale
                if value > 0:
                    return value
    except (OSError, ValueError):
        pass
    return L1D_FALLBACK_BYTES


def chunk_elements(l1d: int) -> int:
    """Floats per channel chunk: the largest power of two from 256 to 1024 whose ``CHUNK_STREAMS``
    arrays fit in the L1 data cache (32 KiB → 512, 48 KiB and more → 1024).

    Why. At 1024 the nine position-weights alone are 36 KiB, more than a 32 KiB L1 holds, and every
    output reloads them from L2. Batch 32, two threads, AMD EPYC Zen 4 (32 KiB L1d), each shape's
    three directions timed side by side at 256 / 512 / 1024 / 2048 elements a chunk, median of 5
    rounds of best-of-5, ms: backward-data 192 ch @16×16 s2 0.88 / 0.88 / 1.43 / 1.35, 576 ch @8×8
    0.65 / 0.68 / 0.90 / 0.86, 576 ch @8×8 s2 0.79 / 0.76 / 0.98 / 0.93; weight gradient 192 ch
    @16×16 s2 1.01 / 0.98 / 1.26 / 1.33, 576 ch @8×8 0.65 / 0.68 / 0.74 / 0.72, 384 ch @8×8 0.51 /
    0.51 / 0.57 / 0.60; forwards within ±10% either way (their kept-outputs loop streams half the
    positions); 32×32 planes unchanged (a chunk is one 1024-pixel plane at any of these sizes).
    256 was no better than 512, so the floor is 256 and the rule takes the largest size that fits."""
    elements = 256
    while elements < 1024 and 2 * elements * CHUNK_STREAMS * 4 <= l1d:
        elements *= 2
    return elements


CHUNK_ELEMENTS = chunk_elements(l1d_bytes())
"""Channel planes per chunk: about this many floats (``chunk_elements``), so the nine
position-weights stay in L1."""


FULL_RESOLUTION_FORWARD_LIMIT = 4096
"""Stride-2 forwards on planes of this many pixels (64×64) and more run the direct loops instead.

Set at 1024 when this path computed all four times the outputs it keeps (144 ch @32×32: 5.1 ms
direct, 6.2 ms here, one thread). Since it computes only the kept outputs (``_flat_filter_s2``),
two threads, median of 9, ms direct → here: 144 ch @32×32 batch 32 2.41 / 2.29 → 1.60 / 1.68,
32 ch @32×32 0.58 / 0.53 → 0.46 / 0.46, 144 ch @48×48 5.06 / 4.98 → 3.69 / 3.61, 144 ch @56×56
batch 16 3.18 / 3.41 → 2.60 / 2.59; but 144 ch @64×64 9.93 / 9.98 → 10.55 / 10.69 and 96 ch
@112×112 batch 16 10.53 / 10.34 → 10.55 / 10.48 (a tie).

v44: from ``PLANES_S2_FORWARD_MIN_PIXELS`` up, the limit is the chunk runs' only: plane by plane
(``plane_forward``, which came after the figures above) those planes run faster than the direct loops."""

PLANES_S2_FORWARD_MIN_PIXELS = 80 * 80
"""v44: stride-2 depthwise forwards on even planes of at least this many pixels run plane by plane, not direct.
Two threads, best quarter of 7–9 calls, ms, direct → planes, two rounds: batch 32, 96 ch @64×64 5.18 / 5.07 →
5.94 / 5.90 (direct ahead, so 64×64 stays direct), @80×80 8.78 / 8.33 → 6.93 / 6.94, @96×96 12.95 / 12.80 → 9.70 /
9.69, 144 ch @80×80 12.52 / 12.51 → 11.57 / 10.44, @96×96 19.32 / 19.26 → 14.43 / 14.62, 96 ch @112×112 (MobileNetV2's
ImageNet variant's second block) 18.71 / 18.63 → 13.25 / 12.89; batch 8 (the chunk ``engine/layers/chunked.py`` runs,
again twice in a recomputed backward) 96 ch @112×112 4.66 / 4.64 → 3.21 / 3.25, 144 ch @112×112 7.35 / 7.24 → 5.01 /
4.98, 64 ch @128×128 4.96 / 4.93 → 3.56 / 3.74."""


def supported(x_shape, w_shape, stride: int, pad: int, direction: str, planes: bool = False) -> bool:
    """3×3, pad 1, stride 1 or 2 (every MobileNetV2 depthwise layer), except large stride-2 forwards that do not run
    plane by plane (``planes``: the caller allows ``plane_forward``; v44)."""
    pixels = x_shape[2] * x_shape[3]
    if (direction == "forward" and stride == 2 and pixels >= FULL_RESOLUTION_FORWARD_LIMIT
            and not (planes and pixels >= PLANES_S2_FORWARD_MIN_PIXELS and plane_by_plane(x_shape, stride))):
        return False
    return w_shape[2] == 3 and w_shape[3] == 3 and stride in (1, 2) and pad == 1


def channels_per_chunk(x_shape) -> int:
    return max(1, min(x_shape[1], CHUNK_ELEMENTS // (x_shape[2] * x_shape[3])))


def workspace_size(x_shape, stride: int) -> int:
    """Per thread: nine position-weights (or accumulators) per chunk element, nine tap masks per plane
    position (``_tap_masks``); at stride 2 also
    full-resolution chunks to subsample from or upsample into (four for the weight gradient's
    four-image passes, plus a row of zeros either side for backward-data)."""
    plane = x_shape[2] * x_shape[3]
    chunk = channels_per_chunk(x_shape) * plane
    full = 4 * chunk + 2 * (x_shape[3] + 1) if stride == 2 else 0
    return get_num_threads() * (9 * chunk + 9 * plane + full)


@njit(cache=True, nogil=True, inline="always")
def _tap_inside(y, x, r, s, height, width, mirrored):
    """Whether tap (r, s) of pixel (y, x) stays in the plane (mirrored: the backward-data direction)."""
    if mirrored:
        yy, xx = y - r + 1, x - s + 1
    else:
        yy, xx = y + r - 1, x + s - 1
    return 0 <= yy < height and 0 <= xx < width


@njit(cache=True, nogil=True)
def _tap_masks(height, width, mirrored, pairs, mask):
    """mask[k·P + q] = 1 where the weight slot k of plane position q is a tap inside the plane, else 0;
    once per call, then ``_position_weights`` fills every chunk from it.

    Slot k reads the input at offset d_k. Forward: tap k itself; mirrored (backward-data): tap 8 − k,
    at d_k = −d_(8−k). ``pairs`` (stride-2 forward, kept outputs): positions are row pairs of the
    input, q = y·2OW + x' with OW = W/2, and x' ≥ OW is unused (0)."""
    out_h, out_w = height // 2, width // 2
    q = 0
    for k in range(9):
        t = 8 - k if mirrored else k
        r, s = t // 3, t % 3
        if pairs:
            for y in range(out_h):
                for x in range(width):
                    inside = x < out_w and 0 <= 2 * y + r - 1 < height and 0 <= 2 * x + s - 1 < width
                    mask[q] = 1.0 if inside else 0.0
                    q += 1
        else:
            for y in range(height):
                for x in range(width):
                    mask[q] = 1.0 if _tap_inside(y, x, r, s, height, width, mirrored) else 0.0
                    q += 1


@njit(cache=True, nogil=True)
def _position_weights(weights, c0, channels, positions, mirrored, mask, pw):
    """pw[k·L + c·P + q] = the weight of channel c0 + c in slot k (``_tap_masks``) where mask says the
    tap is inside, 0 where not (P = ``positions`` per plane, L = channels·P).

    Built per chunk from the call's masks: one vector select per element. Written first per element
    with the inside test inline (scalar, branchy), it cost as much as the filter itself on small
    planes: 576 ch s2 @8×8, one thread, 16 images, 0.23 of 0.55 ms (192 ch @16×16: 0.11 of 0.50)."""
    length = uint64(channels * positions)
    per_plane = uint64(positions)
    for k in range(9):
        t = 8 - k if mirrored else k
        m0 = uint64(k) * per_plane
        for c in range(channels):
            weight = weights[(c0 + c) * 9 + t]
            q0 = uint64(k) * length + uint64(c) * per_plane
            for qq in range(positions):
                q = uint64(qq)
                pw[q0 + q] = weight if mask[m0 + q] != 0.0 else np.float32(0.0)


@njit(cache=True, nogil=True)
def _flat_filter(src, base, size, pw, length, width, dst, dst_base):
    """dst[dst_base + q] = Σ_k pw[k·L + q] · src[base + q + d_k] for q < L.

    The run of the tensor's first and last planes would read outside ``src``: it takes a checked
    loop (two runs per call); every other run the vectorized one."""
    reach = width + 1
    if base >= reach and base + length + reach <= size:
        _flat_filter_fast(src, base, pw, length, width, dst, dst_base)
        return
    for q in range(length):
        total = np.float32(0.0)
        for k in range(9):
            at = base + q + (k // 3 - 1) * width + (k % 3 - 1)
            if 0 <= at < size and pw[k * length + q] != 0.0:
                total += pw[k * length + q] * src[at]
        dst[dst_base + q] = total


@njit(cache=True, nogil=True)
def _flat_filter_fast(src, start, pw, length, width, dst, dst_start):
    """The unchecked loop: nine taps written out over flat unsigned offsets.

    Written this way on purpose: the offsets ±W and ±1 spelled out (not a runtime sign) and the
    loop running over exactly the ``L`` that strides ``pw``. Either change made LLVM give up on
    vectorizing (measured 5× slower), presumably because it could no longer bound the overlap
    checks between the reads and ``dst``."""
    L, o = uint64(length), uint64(dst_start)
    s0, s1, s2 = uint64(start - width - 1), uint64(start - width), uint64(start - width + 1)
    s3, s4, s5 = uint64(start - 1), uint64(start), uint64(start + 1)
    s6, s7, s8 = uint64(start + width - 1), uint64(start + width), uint64(start + width + 1)
    for jj in range(length):
        j = uint64(jj)
        total = pw[j] * src[s0 + j]
        total += pw[L + j] * src[s1 + j]
        total += pw[2 * L + j] * src[s2 + j]
        total += pw[3 * L + j] * src[s3 + j]
        total += pw[4 * L + j] * src[s4 + j]
        total += pw[5 * L + j] * src[s5 + j]
        total += pw[6 * L + j] * src[s6 + j]
        total += pw[7 * L + j] * src[s7 + j]
        total += pw[8 * L + j] * src[s8 + j]
        dst[o + j] = total


@njit(cache=True, nogil=True)
def _subsample(full, channels, height, width, small, base, out_h, out_w):
    """small[base + c·OH·OW + y·OW + x] = full[c·H·W + 2y·W + 2x]: the stride-2 outputs of a stride-1 run."""
    for cc in range(channels):
        for y in range(out_h):
            src = uint64(cc * height * width + 2 * y * width)
            dst = uint64(base + (cc * out_h + y) * out_w)
            for x in range(out_w):
                small[dst + uint64(x)] = full[src + uint64(2 * x)]


@njit(cache=True, nogil=True)
def _upsample(small, base, out_h, out_w, channels, height, width, margin, full):
    """The transpose of _subsample into ``full`` (zeros between, ``margin`` zeros at both ends)."""
    for q in range(channels * height * width + 2 * margin):
        full[q] = 0.0
    for cc in range(channels):
        for y in range(out_h):
            dst = uint64(margin + cc * height * width + 2 * y * width)
            src = uint64(base + (cc * out_h + y) * out_w)
            for x in range(out_w):
                full[dst + uint64(2 * x)] = small[src + uint64(x)]


@njit(cache=True, nogil=True)
def _deinterleave(src, base, length, margin, eo):
    """Even and odd elements of src[base : base + 2L] side by side, with ``margin`` zeros around each:
    E[j] = eo[margin + j] = src[base + 2j], O[j] = eo[L + 3·margin + j] = src[base + 2j + 1].

    One loop over both halves of each pair: LLVM loads two vectors and shuffles them apart."""
    b, m, o = uint64(base), uint64(margin), uint64(length + 3 * margin)
    for q in range(margin):
        eo[q] = 0.0
        eo[length + margin + q] = 0.0
        eo[length + 2 * margin + q] = 0.0
        eo[2 * length + 3 * margin + q] = 0.0
    for jj in range(length):
        j = uint64(jj)
        eo[m + j] = src[b + j + j]
        eo[o + j] = src[b + j + j + uint64(1)]


@njit(cache=True, nogil=True)
def _flat_filter_s2(eo, pw, length, out_w, dst):
    """dst[j] = Σ_k pw[k·L + j] · x[2j + d_k] for j < L, the stride-2 outputs of a run of row pairs,
    reading the input's even and odd elements (``_deinterleave``): tap (r, s) of row pair j reads
    E[j + (r − 1)·OW] at s = 1, O[j + (r − 1)·OW − 1] at s = 0 and O[j + (r − 1)·OW] at s = 2, so
    every tap is a contiguous run (the strided reads of ``x[2j + d]`` were nine gathers).
    The taps that would read past the run read the zero margins (their weights are 0 anyway)."""
    L, m = uint64(length), out_w + 1
    e, o = uint64(m), uint64(length + 3 * m)
    w = uint64(out_w)
    s0, s1, s2 = o - w - uint64(1), e - w, o - w
    s3, s4, s5 = o - uint64(1), e, o
    s6, s7, s8 = o + w - uint64(1), e + w, o + w
    for jj in range(length):
        j = uint64(jj)
        total = pw[j] * eo[s0 + j]
        total += pw[L + j] * eo[s1 + j]
        total += pw[2 * L + j] * eo[s2 + j]
        total += pw[3 * L + j] * eo[s3 + j]
        total += pw[4 * L + j] * eo[s4 + j]
        total += pw[5 * L + j] * eo[s5 + j]
        total += pw[6 * L + j] * eo[s6 + j]
        total += pw[7 * L + j] * eo[s7 + j]
        total += pw[8 * L + j] * eo[s8 + j]
        dst[j] = total


@njit(cache=True, nogil=True)
def _keep_first_halves(buf, rows, out_w, dst, base):
    """dst[base + R·OW + x] = buf[R·2OW + x] for x < OW: the kept half of each row pair."""
    for row in range(rows):
        src0 = uint64(row * 2 * out_w)
        dst0 = uint64(base + row * out_w)
        for x in range(out_w):
            dst[dst0 + uint64(x)] = buf[src0 + uint64(x)]


@njit(cache=True, nogil=True)
def flat_forward(x, w, out, mirrored, stride, t, threads, chunk, scratch, kept_only=True):
    """Thread ``t``'s share of out = depthwise 3×3 pad-1 conv of x (its channel chunks, its slice of
    scratch); mirrored: dx from dout (the backward-data pass). ``run_forward`` runs the shares.

    Stride 2 runs the stride-1 filter at full resolution: forward keeps every other output
    (subsample), backward-data spreads dout over the full-resolution grid first (upsample)."""
    n, c = x.shape[0], x.shape[1]
    full_shape = out.shape if mirrored else x.shape
    small_shape = x.shape if mirrored else out.shape
    height, width, out_h, out_w = full_shape[2], full_shape[3], small_shape[2], small_shape[3]
    plane, small_plane = height * width, out_h * out_w
    chunks = (c + chunk - 1) // chunk
    share = scratch.size // threads
    src, dst, weights = x.reshape(x.size), out.reshape(out.size), w.reshape(w.size)
    margin = width + 1
    pairs = kept_only and stride == 2 and not mirrored and height == 2 * out_h and width == 2 * out_w
    mine = scratch[t * share : (t + 1) * share]
    pw = mine[: 9 * chunk * plane]
    mask = mine[9 * chunk * plane : 9 * (chunk + 1) * plane]
    buf = mine[9 * (chunk + 1) * plane :]
    _tap_masks(height, width, mirrored, pairs, mask)
    positions = plane // 2 if pairs else plane
    for k in range(t * chunks // threads, (t + 1) * chunks // threads):
        c0 = k * chunk
        channels = min(chunk, c - c0)
        length = channels * plane
        _position_weights(weights, c0, channels, positions, mirrored, mask, pw)
        if pairs:  # kept outputs only, on row pairs: half the work of the full-resolution run
            half = length // 2
            eo = buf[half:]
            for i in range(n):
                _deinterleave(src, (i * c + c0) * plane, half, out_w + 1, eo)
                _flat_filter_s2(eo, pw, half, out_w, buf)
                _keep_first_halves(buf, channels * out_h, out_w, dst, (i * c + c0) * small_plane)
            continue
        for i in range(n):
            base = (i * c + c0) * plane
            if stride == 1:
                _flat_filter(src, base, src.size, pw, length, width, dst, base)
            elif mirrored:
                _upsample(src, (i * c + c0) * small_plane, out_h, out_w, channels, height, width, margin, buf)
                _flat_filter(buf, margin, length + 2 * margin, pw, length, width, dst, base)
            else:
                # np.int64(0), here and below: a literal 0 would compile a second signature of the callee
                _flat_filter(src, base, src.size, pw, length, width, buf, np.int64(0))
                _subsample(buf, channels, height, width, dst, (i * c + c0) * small_plane, out_h, out_w)


@njit(cache=True, nogil=True)
def _flat_accumulate(src, base, size, grad, grad_base, acc, length, width):
    """acc[t·L + q] += grad[grad_base + q] · src[base + q + d_t], checked: for runs at the tensor's ends."""
    for t in range(9):
        d = (t // 3 - 1) * width + (t % 3 - 1)
        for q in range(length):
            at = base + q + d
            if 0 <= at < size:
                acc[t * length + q] += grad[grad_base + q] * src[at]


@njit(cache=True, nogil=True)
def _flat_accumulate_fast(src, base, grad, grad_base, acc, length, width):
    """The unchecked _flat_accumulate, one vector loop per tap."""
    for t in range(9):
        d = (t // 3 - 1) * width + (t % 3 - 1)
        a0 = uint64(t * length)
        g0 = uint64(grad_base)
        s0 = uint64(base + d)
        for jj in range(length):
            j = uint64(jj)
            acc[a0 + j] += grad[g0 + j] * src[s0 + j]


@njit(cache=True, nogil=True)
def _flat_accumulate_fast4(src, b0, b1, b2, b3, grad, g0, g1, g2, g3, acc, length, width):
    """_flat_accumulate_fast for four images at once: a quarter of the read-modify-write traffic on
    ``acc``, which is what bounds this loop."""
    for t in range(9):
        d = (t // 3 - 1) * width + (t % 3 - 1)
        a0 = uint64(t * length)
        r0, r1, r2, r3 = uint64(g0), uint64(g1), uint64(g2), uint64(g3)
        s0, s1, s2, s3 = uint64(b0 + d), uint64(b1 + d), uint64(b2 + d), uint64(b3 + d)
        for jj in range(length):
            j = uint64(jj)
            acc[a0 + j] += (
                grad[r0 + j] * src[s0 + j]
                + grad[r1 + j] * src[s1 + j]
                + grad[r2 + j] * src[s2 + j]
                + grad[r3 + j] * src[s3 + j]
            )


@njit(cache=True, nogil=True)
def flat_backward_weight(x, dout, dw, stride, t, threads, chunk, scratch):
    """Thread ``t``'s channel chunks of dw[c, tap] = Σ over the plane's positions where the tap is
    inside of Σ_n dout · x(shifted), in order (``run_backward_weight`` runs the shares).

    Stride 2: dout is spread over the full-resolution grid first (zeros between), as in backward-data."""
    n, c, height, width = x.shape
    out_h, out_w = dout.shape[2], dout.shape[3]
    plane, small_plane = height * width, out_h * out_w
    chunks = (c + chunk - 1) // chunk
    share = scratch.size // threads
    src, grad, result = x.reshape(x.size), dout.reshape(dout.size), dw.reshape(dw.size)
    reach = width + 1
    zero = np.int64(0)  # not a literal 0: that would compile a second signature of each callee
    mine = scratch[t * share : (t + 1) * share]
    acc = mine[: 9 * chunk * plane]
    buf = mine[9 * chunk * plane :]
    for k in range(t * chunks // threads, (t + 1) * chunks // threads):
        c0 = k * chunk
        channels = min(chunk, c - c0)
        length = channels * plane
        for q in range(9 * length):
            acc[q] = 0.0
        i = 0
        while i < n:
            base = (i * c + c0) * plane
            last = ((i + 3) * c + c0) * plane
            if i + 4 <= n and base >= reach and last + length + reach <= src.size:
                step = c * plane
                b1, b2 = base + step, base + 2 * step
                if stride == 1:
                    _flat_accumulate_fast4(src, base, b1, b2, last, grad, base, b1, b2, last, acc, length, width)
                else:
                    # dout of the four images spread over the full-resolution grid, side by side
                    for k in range(4):
                        small = ((i + k) * c + c0) * small_plane
                        _upsample(grad, small, out_h, out_w, channels, height, width, zero, buf[k * length :])
                    _flat_accumulate_fast4(
                        src, base, b1, b2, last, buf, zero, length, 2 * length, 3 * length, acc, length, width
                    )
                i += 4
                continue
            if stride == 1:
                g, g0 = grad, base
            else:
                _upsample(grad, (i * c + c0) * small_plane, out_h, out_w, channels, height, width, zero, buf)
                g, g0 = buf, 0
            if base >= reach and base + length + reach <= src.size:
                _flat_accumulate_fast(src, base, g, g0, acc, length, width)
            else:
                _flat_accumulate(src, base, src.size, g, g0, acc, length, width)
            i += 1
        for cc in range(channels):
            for tap in range(9):
                # the positions whose tap stays inside the plane: a rectangle of rows and columns
                r, s = tap // 3, tap % 3
                y_lo, y_hi = max(0, 1 - r), min(height, height + 1 - r)
                x_lo, x_hi = max(0, 1 - s), min(width, width + 1 - s)
                total = np.float32(0.0)
                for y in range(y_lo, y_hi):
                    row = tap * length + cc * plane + y * width
                    for x in range(x_lo, x_hi):
                        total += acc[row + x]
                result[(c0 + cc) * 9 + tap] = total


PLANES_MIN_PIXELS = 256
"""Forward and backward-data run plane by plane (``plane_forward``) on planes of this many pixels
(16×16) and more at stride 1, and of ``PLANES_MIN_PIXELS_STRIDE2`` and more (even ones) at stride 2.

Batch 32, two threads, median of 5 rounds of best-of-7, ms, chunk runs with position weights
(``flat_forward``) → plane by plane, forward / backward-data: 32 ch @32×32 0.381 → 0.367 / 0.375 →
0.366; 96 ch @32×32 1.445 → 1.242 / 1.404 → 1.214; 144 ch @32×32 2.291 → 1.843 / 2.293 → 1.940;
192 ch @16×16 0.518 → 0.485 / 0.626 → 0.561; 144 ch s2 @32×32 1.681 → 1.402 / 2.603 → 2.513. Slower
on the small planes, where each plane's loop is four vectors or one and its set-up counts: 192 ch s2
@16×16 0.458 → 0.489 / 0.740 → 0.753; 384 ch @8×8 0.362 → 0.436 / 0.335 → 0.390; 576 ch @8×8 0.413
→ 0.507 / 0.438 → 0.551; 576 ch s2 @8×8 0.392 → 0.552 / 0.622 → 0.717; 960 ch @4×4 0.258 → 0.509 /
0.264 → 0.511."""

PLANES_MIN_PIXELS_STRIDE2 = 1024

IMAGENET_PLANES_MIN_PIXELS = 14 * 14
"""v45: forward and backward-data plane by plane from 14×14 at both strides (``plane_by_plane(..., imagenet=True)``;
the two limits above are v21–v44's, kept for the study's versions). The figures above were taken on CIFAR's square
planes, which ``conv_depthwise_regs`` has run since v25; MobileNetV2's ImageNet variant has 28×28 and 14×14 ones.
Batch 32, two threads, median of four rounds of the median of 15 calls, ms, chunk runs → plane by plane: stride 1
384 ch @14×14 forward 1.082 → 0.899, 576 ch @14×14 forward 1.803 → 1.383, backward-data 1.801 → 1.347; stride 2 192 ch
@28×28 forward 2.107 → 1.670 (8 images 0.365 → 0.339), backward-data 2.280 → 2.157, 144 ch @28×28 forward 1.200 →
1.024, 576 ch @14×14 forward 1.413 → 1.229, backward-data 1.831 → 1.654, 960 ch @14×14 forward 3.305 → 2.047. Below,
the chunk runs stay ahead: 960 ch @7×7 forward 0.590 against 0.819, backward-data 0.631 against 0.838; 576 ch s2
@10×10 forward 0.590 against 0.720, backward-data 0.893 against 0.997."""


def plane_by_plane(x_shape, stride: int, imagenet: bool = True) -> bool:
    """Whether forward and backward-data run plane by plane (``plane_forward``; ``x_shape``: the
    full-resolution side): see ``PLANES_MIN_PIXELS`` and, ``imagenet`` (v45), ``IMAGENET_PLANES_MIN_PIXELS``."""
    pixels = x_shape[2] * x_shape[3]
    if stride == 1:
        return pixels >= (IMAGENET_PLANES_MIN_PIXELS if imagenet else PLANES_MIN_PIXELS)
    least = IMAGENET_PLANES_MIN_PIXELS if imagenet else PLANES_MIN_PIXELS_STRIDE2
    return pixels >= least and x_shape[2] % 2 == 0 and x_shape[3] % 2 == 0


def run_forward(x, w, out, stride: int, scratch, kept_only: bool = True, planes: bool = False) -> None:
    """kept_only (stride 2, even planes): compute the kept outputs on row pairs instead of the
    full-resolution run (the study's v5 passes False). planes: ``plane_forward``."""
    threads = get_num_threads()
    if planes and plane_by_plane(x.shape, stride):
        chunk, mine = channels_per_chunk(x.shape), scratch[: workspace_size(x.shape, stride)]
        run_shares(lambda t: plane_forward(x, w, out, False, stride, t, threads, chunk, mine), threads)
        return
    size = workspace_size(x.shape, stride)
    chunk, mine = channels_per_chunk(x.shape), scratch[:size]
    run_shares(lambda t: flat_forward(x, w, out, False, stride, t, threads, chunk, mine, kept_only), threads)


def run_backward_data(dout, w, dx, stride: int, scratch, planes: bool = False) -> None:
    threads = get_num_threads()
    if planes and plane_by_plane(dx.shape, stride):
        chunk, mine = channels_per_chunk(dx.shape), scratch[: workspace_size(dx.shape, stride)]
        run_shares(lambda t: plane_forward(dout, w, dx, True, stride, t, threads, chunk, mine), threads)
        return
    size = workspace_size(dx.shape, stride)
    chunk, mine = channels_per_chunk(dx.shape), scratch[:size]
    # kept_only passed (not left to its default) so backward-data runs the very signature forward
    # compiled: an omitted argument is a different Numba type, and so a second compile
    run_shares(lambda t: flat_forward(dout, w, dx, True, stride, t, threads, chunk, mine, True), threads)


GROUPS_MIN_PIXELS = 64
"""The weight gradient runs by image groups on planes of this many pixels (8×8) and more; below, the
nine horizontal sums per four planes cost more than the per-position accumulators they replace (960
ch @4×4, batch 32, two threads, median of 5 rounds of best-of-7: 0.265 ms per-position, 0.335 by
groups)."""

IMAGENET_GROUPS_MIN_PIXELS = 7 * 7
"""v45: the weight gradient by image groups from 7×7 (``by_groups(..., imagenet=True)``; 4×4 and 5×5 keep the
per-position accumulators, square 4×4 to 32×32 planes run ``conv_depthwise_regs`` anyway). Batch 32, two threads,
median of four rounds of the median of 15 calls, ms, per-position → by groups: 960 ch @7×7 0.819 → 0.678 (8 images
0.347 → 0.218), 576 ch @7×7 0.470 → 0.416, 160 ch @7×7 0.174 → 0.157."""


def by_groups(x_shape, stride: int, imagenet: bool = True) -> bool:
    """Whether the weight gradient runs by image groups (``weight_by_groups``): planes of at least
    ``GROUPS_MIN_PIXELS`` (``imagenet``, v45: ``IMAGENET_GROUPS_MIN_PIXELS``), and even ones at stride 2 (row
    pairs)."""
    if x_shape[2] * x_shape[3] < (IMAGENET_GROUPS_MIN_PIXELS if imagenet else GROUPS_MIN_PIXELS):
        return False
    return stride == 1 or (x_shape[2] % 2 == 0 and x_shape[3] % 2 == 0)


def run_backward_weight(x, dout, dw, stride: int, scratch, groups: bool = False) -> None:
    """groups: by image groups (``weight_by_groups``); False: the per-position accumulators over the
    full-resolution grid (``flat_backward_weight``, the study's v20 and earlier)."""
    threads = get_num_threads()
    if groups and by_groups(x.shape, stride):
        n, c = x.shape[0], x.shape[1]
        count = -(-n // IMAGE_GROUP)
        partials = scratch[: count * c * 9]
        rest = scratch[count * c * 9 : weight_workspace_size(x.shape, stride)]
        chunk = channels_per_chunk(x.shape)
        run_shares(lambda t: weight_by_groups(x, dout, stride, t, threads, chunk, partials, rest), threads)
        _sum_partials(partials, count, c * 9, dw.reshape(dw.size))
        return
    size = workspace_size(x.shape, stride)
    chunk, mine = channels_per_chunk(x.shape), scratch[:size]
    run_shares(lambda t: flat_backward_weight(x, dout, dw, stride, t, threads, chunk, mine), threads)


# ----------------------------------------------------------------------------------------------
# The weight gradient by image groups (v21): tap sums per plane, images streamed in memory order
# ----------------------------------------------------------------------------------------------

IMAGE_GROUP = 4
"""Images per partial sum of the weight gradient (``run_backward_weight``): the groups are the unit
of work, whatever the thread count, so the partials and their fixed-order sum are the same bits."""


def weight_workspace_size(x_shape, stride: int) -> int:
    """Scratch of ``run_backward_weight``: one partial dW (C·9) per image group, then per thread the
    tap masks (9 per plane position) and at stride 2 a chunk's even/odd input with margins and its
    dout on row pairs (``workspace_size`` where ``by_groups`` says no)."""
    if not by_groups(x_shape, stride):
        return workspace_size(x_shape, stride)
    n, c, height, width = x_shape
    plane = height * width
    chunk = channels_per_chunk(x_shape) * plane
    groups = -(-n // IMAGE_GROUP)
    per_thread = 9 * plane + (IMAGE_GROUP * (chunk + 4 * (width // 2 + 1) + chunk // 2) if stride == 2 else 0)
    return groups * c * 9 + get_num_threads() * per_thread


@njit(cache=True, nogil=True, fastmath={"reassoc", "contract"})
def _tap_sums(src, offsets, grad, g0, positions, mask, sums, s0):
    """sums[s0 + k] += Σ_q [mask[k·P + q] ≠ 0] · grad[g0 + q] · src[offsets[k] + q] for q < P.

    ``reassoc`` (this function and ``_tap_sums4`` only) lets LLVM split the nine sums into vector
    lanes; the lanes it picks depend on P only, so the bits do not depend on the thread count or the
    arrays' addresses. ``contract`` fuses the multiply-adds: ``_tap_sums4`` on one 8×8 plane of four
    images, hot in L1, one thread, 645 → 550 cycles a call (median of 5; the same flag on
    ``_flat_filter_s2``: 585 → 602, not kept).
    The mask is a select, not a product: a tap off the plane reads the neighbour plane's pixel, and an
    inf or NaN there must not reach this channel's sum. Every read must lie inside ``src``."""
    P = uint64(positions)
    g = uint64(g0)
    o0, o1, o2 = uint64(offsets[0]), uint64(offsets[1]), uint64(offsets[2])
    o3, o4, o5 = uint64(offsets[3]), uint64(offsets[4]), uint64(offsets[5])
    o6, o7, o8 = uint64(offsets[6]), uint64(offsets[7]), uint64(offsets[8])
    zero = np.float32(0.0)
    t0 = t1 = t2 = t3 = t4 = t5 = t6 = t7 = t8 = zero
    for qq in range(positions):
        q = uint64(qq)
        d = grad[g + q]
        t0 += d * src[o0 + q] if mask[q] != zero else zero
        t1 += d * src[o1 + q] if mask[P + q] != zero else zero
        t2 += d * src[o2 + q] if mask[2 * P + q] != zero else zero
        t3 += d * src[o3 + q] if mask[3 * P + q] != zero else zero
        t4 += d * src[o4 + q] if mask[4 * P + q] != zero else zero
        t5 += d * src[o5 + q] if mask[5 * P + q] != zero else zero
        t6 += d * src[o6 + q] if mask[6 * P + q] != zero else zero
        t7 += d * src[o7 + q] if mask[7 * P + q] != zero else zero
        t8 += d * src[o8 + q] if mask[8 * P + q] != zero else zero
    sums[s0] += t0
    sums[s0 + 1] += t1
    sums[s0 + 2] += t2
    sums[s0 + 3] += t3
    sums[s0 + 4] += t4
    sums[s0 + 5] += t5
    sums[s0 + 6] += t6
    sums[s0 + 7] += t7
    sums[s0 + 8] += t8


@njit(cache=True, nogil=True, fastmath={"reassoc", "contract"})
def _tap_sums4(src, offsets, step, grad, g0, grad_step, positions, mask, sums, s0):
    """_tap_sums over four images at once: image i reads src at offsets[k] + i·step and grad at
    g0 + i·grad_step. One horizontal sum per tap for four planes (on 8×8 and 4×4 planes the nine
    horizontal sums cost as much as the products)."""
    P = uint64(positions)
    zero = np.float32(0.0)
    a, b, c3 = uint64(step), uint64(2 * step), uint64(3 * step)
    g = uint64(g0)
    ga, gb, gc = g + uint64(grad_step), g + uint64(2 * grad_step), g + uint64(3 * grad_step)
    o0, o1, o2 = uint64(offsets[0]), uint64(offsets[1]), uint64(offsets[2])
    o3, o4, o5 = uint64(offsets[3]), uint64(offsets[4]), uint64(offsets[5])
    o6, o7, o8 = uint64(offsets[6]), uint64(offsets[7]), uint64(offsets[8])
    t0 = t1 = t2 = t3 = t4 = t5 = t6 = t7 = t8 = zero
    for qq in range(positions):
        q = uint64(qq)
        d0, d1, d2, d3 = grad[g + q], grad[ga + q], grad[gb + q], grad[gc + q]
        v = d0 * src[o0 + q] + d1 * src[o0 + a + q] + d2 * src[o0 + b + q] + d3 * src[o0 + c3 + q]
        t0 += v if mask[q] != zero else zero
        v = d0 * src[o1 + q] + d1 * src[o1 + a + q] + d2 * src[o1 + b + q] + d3 * src[o1 + c3 + q]
        t1 += v if mask[P + q] != zero else zero
        v = d0 * src[o2 + q] + d1 * src[o2 + a + q] + d2 * src[o2 + b + q] + d3 * src[o2 + c3 + q]
        t2 += v if mask[2 * P + q] != zero else zero
        v = d0 * src[o3 + q] + d1 * src[o3 + a + q] + d2 * src[o3 + b + q] + d3 * src[o3 + c3 + q]
        t3 += v if mask[3 * P + q] != zero else zero
        v = d0 * src[o4 + q] + d1 * src[o4 + a + q] + d2 * src[o4 + b + q] + d3 * src[o4 + c3 + q]
        t4 += v if mask[4 * P + q] != zero else zero
        v = d0 * src[o5 + q] + d1 * src[o5 + a + q] + d2 * src[o5 + b + q] + d3 * src[o5 + c3 + q]
        t5 += v if mask[5 * P + q] != zero else zero
        v = d0 * src[o6 + q] + d1 * src[o6 + a + q] + d2 * src[o6 + b + q] + d3 * src[o6 + c3 + q]
        t6 += v if mask[6 * P + q] != zero else zero
        v = d0 * src[o7 + q] + d1 * src[o7 + a + q] + d2 * src[o7 + b + q] + d3 * src[o7 + c3 + q]
        t7 += v if mask[7 * P + q] != zero else zero
        v = d0 * src[o8 + q] + d1 * src[o8 + a + q] + d2 * src[o8 + b + q] + d3 * src[o8 + c3 + q]
        t8 += v if mask[8 * P + q] != zero else zero
    sums[s0] += t0
    sums[s0 + 1] += t1
    sums[s0 + 2] += t2
    sums[s0 + 3] += t3
    sums[s0 + 4] += t4
    sums[s0 + 5] += t5
    sums[s0 + 6] += t6
    sums[s0 + 7] += t7
    sums[s0 + 8] += t8


@njit(cache=True, nogil=True)
def _tap_sums_checked(src, base, grad, g0, height, width, sums, s0):
    """_tap_sums at stride 1 for a plane at the tensor's ends: only the taps inside the plane are read."""
    for k in range(9):
        r, s = k // 3, k % 3
        total = np.float32(0.0)
        for y in range(max(0, 1 - r), min(height, height + 1 - r)):
            for x in range(max(0, 1 - s), min(width, width + 1 - s)):
                total += grad[g0 + y * width + x] * src[base + (y + r - 1) * width + x + s - 1]
        sums[s0 + k] += total


@njit(cache=True, nogil=True)
def _to_row_pairs(grad, base, rows, out_w, pairs):
    """pairs[R·2OW + x] = grad[base + R·OW + x] for x < OW: dout on the row-pair layout of
    ``_flat_filter_s2`` (the second halves are left as they are: their masks are 0)."""
    for row in range(rows):
        src0 = uint64(base + row * out_w)
        dst0 = uint64(row * 2 * out_w)
        for x in range(out_w):
            pairs[dst0 + uint64(x)] = grad[src0 + uint64(x)]


@njit(cache=True, nogil=True)
def weight_by_groups(x, dout, stride, t, threads, chunk, partials, scratch):
    """Thread ``t``'s image groups of the weight gradient: partials[g, c, k] = Σ over group g's images,
    in order, of Σ over the plane's positions where tap k is inside of dout · x(shifted).

    Each image is streamed in memory order, plane by plane (its chunks of channels), and each plane's
    nine tap sums run in one vector loop (``_tap_sums``) over the positions it keeps: stride 2 splits
    the input chunk into even and odd elements (``_deinterleave``) and lays dout on row pairs, so
    every tap is a contiguous run of the kept outputs only, never the full-resolution grid."""
    n, c, height, width = x.shape
    out_h, out_w = dout.shape[2], dout.shape[3]
    plane, small_plane = height * width, out_h * out_w
    groups = (n + IMAGE_GROUP - 1) // IMAGE_GROUP
    src, grad = x.reshape(x.size), dout.reshape(dout.size)
    share = scratch.size // threads
    mine = scratch[t * share : (t + 1) * share]
    pairs = stride == 2
    positions = plane // 2 if pairs else plane
    mask = mine[: 9 * positions]
    margin = out_w + 1
    room = IMAGE_GROUP * (chunk * plane + 4 * margin)
    eo = mine[9 * positions : 9 * positions + room]
    gp = mine[9 * positions + room :]
    mirrored = stride < 0  # False, typed bool: a literal False would compile _tap_masks a second time
    _tap_masks(height, width, mirrored, pairs, mask)
    offsets = np.empty(9, np.int64)
    reach = width + 1
    for grp in range(t * groups // threads, (t + 1) * groups // threads):
        sums = partials[grp * c * 9 : (grp + 1) * c * 9]
        for q in range(c * 9):
            sums[q] = 0.0
        first, last = grp * IMAGE_GROUP, min(n, (grp + 1) * IMAGE_GROUP)
        four = last - first == 4
        for c0 in range(0, c, chunk):
            channels = min(chunk, c - c0)
            if pairs:
                half = channels * plane // 2
                size = 2 * half + 4 * margin
                images = 4 if four else 1
                for i in range(first, last, images):
                    for m in range(images):
                        _deinterleave(src, ((i + m) * c + c0) * plane, half, margin, eo[m * size :])
                        _to_row_pairs(grad, ((i + m) * c + c0) * small_plane, channels * out_h, out_w, gp[m * half :])
                    e, o, w = margin, half + 3 * margin, out_w
                    for cc in range(channels):
                        at = cc * positions
                        offsets[0], offsets[1], offsets[2] = o - w - 1 + at, e - w + at, o - w + at
                        offsets[3], offsets[4], offsets[5] = o - 1 + at, e + at, o + at
                        offsets[6], offsets[7], offsets[8] = o + w - 1 + at, e + w + at, o + w + at
                        if four:
                            _tap_sums4(eo, offsets, size, gp, at, half, positions, mask, sums, (c0 + cc) * 9)
                        else:
                            _tap_sums(eo, offsets, gp, at, positions, mask, sums, (c0 + cc) * 9)
                continue
            step = c * plane
            for cc in range(channels):
                b = (first * c + c0 + cc) * plane
                end = ((last - 1) * c + c0 + cc) * plane
                if four and b >= reach and end + plane + reach <= src.size:
                    for k in range(9):
                        offsets[k] = b + (k // 3 - 1) * width + (k % 3 - 1)
                    _tap_sums4(src, offsets, step, grad, b, step, positions, mask, sums, (c0 + cc) * 9)
                    continue
                for i in range(first, last):
                    b = (i * c + c0 + cc) * plane
                    if b < reach or b + plane + reach > src.size:
                        _tap_sums_checked(src, b, grad, b, height, width, sums, (c0 + cc) * 9)
                        continue
                    for k in range(9):
                        offsets[k] = b + (k // 3 - 1) * width + (k % 3 - 1)
                    _tap_sums(src, offsets, grad, b, positions, mask, sums, (c0 + cc) * 9)


@njit(cache=True, nogil=True)
def _sum_partials(partials, groups, size, result):
    """result[j] = Σ_g partials[g·size + j], g in order: the same bits at any thread count."""
    for j in range(size):
        total = np.float32(0.0)
        for g in range(groups):
            total += partials[g * size + j]
        result[j] = total


# ----------------------------------------------------------------------------------------------
# Forward and backward-data plane by plane (v21): the channel's nine weights in registers
# ----------------------------------------------------------------------------------------------


@njit(cache=True, nogil=True)
def _plane_filter(src, offsets, weights, w0, mirrored, positions, mask, dst, d0):
    """dst[d0 + q] = Σ_k w_k · src[offsets[k] + q] where mask[k·P + q] ≠ 0, for q < P: one plane, its
    nine weights broadcast (w_k = weights[w0 + k], or weights[w0 + 8 − k] mirrored), the tap masks
    shared by every plane (``_tap_masks``) and applied as selects."""
    P = uint64(positions)
    o = uint64(d0)
    zero = np.float32(0.0)
    if mirrored:
        k0, k1, k2 = weights[w0 + 8], weights[w0 + 7], weights[w0 + 6]
        k3, k4, k5 = weights[w0 + 5], weights[w0 + 4], weights[w0 + 3]
        k6, k7, k8 = weights[w0 + 2], weights[w0 + 1], weights[w0]
    else:
        k0, k1, k2 = weights[w0], weights[w0 + 1], weights[w0 + 2]
        k3, k4, k5 = weights[w0 + 3], weights[w0 + 4], weights[w0 + 5]
        k6, k7, k8 = weights[w0 + 6], weights[w0 + 7], weights[w0 + 8]
    s0, s1, s2 = uint64(offsets[0]), uint64(offsets[1]), uint64(offsets[2])
    s3, s4, s5 = uint64(offsets[3]), uint64(offsets[4]), uint64(offsets[5])
    s6, s7, s8 = uint64(offsets[6]), uint64(offsets[7]), uint64(offsets[8])
    for qq in range(positions):
        q = uint64(qq)
        total = k0 * src[s0 + q] if mask[q] != zero else zero
        total += k1 * src[s1 + q] if mask[P + q] != zero else zero
        total += k2 * src[s2 + q] if mask[2 * P + q] != zero else zero
        total += k3 * src[s3 + q] if mask[3 * P + q] != zero else zero
        total += k4 * src[s4 + q] if mask[4 * P + q] != zero else zero
        total += k5 * src[s5 + q] if mask[5 * P + q] != zero else zero
        total += k6 * src[s6 + q] if mask[6 * P + q] != zero else zero
        total += k7 * src[s7 + q] if mask[7 * P + q] != zero else zero
        total += k8 * src[s8 + q] if mask[8 * P + q] != zero else zero
        dst[o + q] = total


@njit(cache=True, nogil=True)
def _plane_filter_checked(src, base, size, weights, w0, mirrored, positions, width, mask, dst, d0):
    """_plane_filter at stride 1 for a plane at the tensor's ends: reads outside ``src`` are skipped."""
    for q in range(positions):
        total = np.float32(0.0)
        for k in range(9):
            at = base + q + (k // 3 - 1) * width + (k % 3 - 1)
            if 0 <= at < size and mask[k * positions + q] != 0.0:
                total += weights[w0 + (8 - k if mirrored else k)] * src[at]
        dst[d0 + q] = total


@njit(cache=True, nogil=True)
def plane_forward(x, w, out, mirrored, stride, t, threads, chunk, scratch):
    """Thread ``t``'s share of out = depthwise 3×3 pad-1 conv of x (mirrored: dx from dout), plane by
    plane: the work is (image, channel chunk) pairs in memory order, split in contiguous ranges, and
    each plane is one loop with its nine weights in registers (``_plane_filter``). Each output is
    computed by one fixed expression whatever the split: the same bits at any thread count.

    Stride 2 forward: the chunk's even and odd input elements (``_deinterleave``), the kept outputs on
    row pairs (``_flat_filter_s2``'s taps), the kept halves copied out. Stride 2 backward-data: dout
    spread over the full-resolution grid (``_upsample``), then the stride-1 loop."""
    n, c = x.shape[0], x.shape[1]
    full_shape = out.shape if mirrored else x.shape
    small_shape = x.shape if mirrored else out.shape
    height, width, out_h, out_w = full_shape[2], full_shape[3], small_shape[2], small_shape[3]
    plane, small_plane = height * width, out_h * out_w
    chunks = (c + chunk - 1) // chunk
    share = scratch.size // threads
    src, dst, weights = x.reshape(x.size), out.reshape(out.size), w.reshape(w.size)
    pairs = stride == 2 and not mirrored
    positions = plane // 2 if pairs else plane
    mine = scratch[t * share : (t + 1) * share]
    mask = mine[: 9 * positions]
    buf = mine[9 * positions :]
    _tap_masks(height, width, mirrored, pairs, mask)
    offsets = np.empty(9, np.int64)
    items = n * chunks
    reach = width + 1
    for item in range(t * items // threads, (t + 1) * items // threads):
        i, k = item // chunks, item % chunks
        c0 = k * chunk
        channels = min(chunk, c - c0)
        base = (i * c + c0) * plane
        if pairs:
            margin = out_w + 1
            half = channels * plane // 2
            eo = buf[half:]
            _deinterleave(src, base, half, margin, eo)
            e, o, ww = margin, half + 3 * margin, out_w
            for cc in range(channels):
                at = cc * positions
                offsets[0], offsets[1], offsets[2] = o - ww - 1 + at, e - ww + at, o - ww + at
                offsets[3], offsets[4], offsets[5] = o - 1 + at, e + at, o + at
                offsets[6], offsets[7], offsets[8] = o + ww - 1 + at, e + ww + at, o + ww + at
                _plane_filter(eo, offsets, weights, (c0 + cc) * 9, mirrored, positions, mask, buf, at)
            _keep_first_halves(buf, channels * out_h, out_w, dst, (i * c + c0) * small_plane)
            continue
        if stride == 2:  # backward-data: dout upsampled, with margins of zeros at both ends
            margin = width + 1
            _upsample(src, (i * c + c0) * small_plane, out_h, out_w, channels, height, width, margin, buf)
            for cc in range(channels):
                at = margin + cc * plane
                for kk in range(9):
                    offsets[kk] = at + (kk // 3 - 1) * width + (kk % 3 - 1)
                _plane_filter(buf, offsets, weights, (c0 + cc) * 9, mirrored, plane, mask, dst, base + cc * plane)
            continue
        for cc in range(channels):
            b = base + cc * plane
            if b < reach or b + plane + reach > src.size:
                _plane_filter_checked(src, b, src.size, weights, (c0 + cc) * 9, mirrored, plane, width, mask, dst, b)
                continue
            for kk in range(9):
                offsets[kk] = b + (kk // 3 - 1) * width + (kk % 3 - 1)
            _plane_filter(src, offsets, weights, (c0 + cc) * 9, mirrored, plane, mask, dst, b)

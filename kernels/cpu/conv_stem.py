"""The 3-channel stems (v36): forward and weight gradient as one small im2col and one sgemm per image.

Why. ResNet-18's and MobileNetV2's stems (3→64 and 3→32, 3×3, stride 1, pad 1, on the network's input) were
the last layers of the CIFAR models on the general im2col path (``conv.gemm_forward``,
``gemm_backward_weight``). Their work is small (113 MFLOP per direction for 3→64 at batch 32), but those two
drivers are the largest compile jobs of a cold first run: in ResNet-18's warm-up the forward job takes 2.3–2.5 s
of CPU and the weight gradient's 5.0–5.7 s (``_backward_weight_images`` 5.1 s with ``im2col_row`` 1.9 s inside:
every variant of the general path, tiles of several images, gathers, in-place accumulation, output-channel
blocks). This module does what those paths do on a stem, and only that: each image's 27 rows of columns
(``_columns``: one flat copy per tap, ``columns.row_same``), then one sgemm ``out[n] (K × P) = W (K × 27) @
cols`` per image, or ``dW += dout[n] @ colsᵀ`` in blocks of ≤ ``conv.STEM_WEIGHT_K_BLOCK`` output channels (v26 measured
the weight gradient's 32-row blocks at ~100 GFLOP/s against ~56 for 64). Same shapes, same sgemm: the same
bits as the im2col path.
Backward-data is never called on a network's input and stays on the general path.

Threads: the forward splits the images into chunks of at least two images (each writes its own outputs; an image's
outputs do not depend on its chunk). One image per chunk cost the chunked layers' 8-image calls (engine/layers/
chunked.py) 83–89 ms for four calls on ResNet-18's 224 stem at batch 32, against 74–77 ms in one call of 32;
with two images per chunk 75 ms (median of 7, two runs; batches of 16 and more are cut as before). The weight
gradient gives each thread a fixed range of images summed into its own dW, added in thread order
(``conv.sum_image_shares``):
the same bits at a given thread count, as the im2col weight gradient.

Tried first and dropped: a direct kernel on the padded grid (every tap of an output channel one contiguous run
of the padded planes at a fixed offset, written out over unsigned offsets as
``conv_depthwise._flat_filter_fast``; the weight gradient as nine dot products per channel with ``reassoc``).
Its loops vectorized only while they wrote one stream: with four output channels sharing the nine loads
(42 µs per image of 3→64 in a loop with constant geometry, against 68 for one channel at a time) the runtime
geometry left LLVM with too many overlap checks and the loop scalar (380 µs per image). Batch 32, two threads,
median of 5 rounds of best-of-7, ms, im2col → direct: 3→64 forward 1.13 → 1.62 (one channel at a time),
weight 0.76 → 1.35 (two channels sharing the loads); 3→32 weight 0.50 → 0.68.

Measured: kernels/README.md's v36 row.

v39: the ImageNet stems (ResNet-18's 3→64 7×7 stride 2 pad 3 and MobileNetV2's 3→32 3×3 stride 2 pad 1, on 224×224
inputs) the same way (path "stem-strided", ``strided_supported``, ``conv.Paths.stem_strided``): they ran on the general
im2col drivers, whose forward and weight-gradient jobs were the largest compile work of a cold 224 first run (v36's
figures: 2.3–2.5 s and 5.0–5.7 s of CPU). One image's columns are 7.4 MB for the 7×7 stem at 224 (147 rows × 12,544
pixels), so the columns are built and multiplied in blocks of whole output rows of ≤ ``COLUMN_BUDGET`` floats (1 MiB,
15 rows of 112 for the 7×7 stem, 86 for the 3×3 one): the forward writes each block's K × rows·OW result into ``out``
with the plane as leading dimension, the weight gradient adds each block's ``dout[n][:, block] @ colsᵀ`` (β = 1 after
the first). Each tap's output row is one run of valid input columns (stride apart) between zeroed ends
(``_strided_columns``). A separate kernel from v36's (``_strided_images``, both directions): a CIFAR
run compiles none of them, an ImageNet run none of v36's. The weight gradient keeps v26's 32-channel sgemm blocks
(measured on the 27-column result of the 3×3 stems; for the 7×7 stem's 147 columns not measured). Speed against
im2col and PyTorch: not measured yet (``engine kernels --compare torch --image-size 224``, kernels/README.md).

v47 (``conv.Paths.stem_phases``, ``_phase_images``): what the strided stems' time was made of, one thread, eight
224×224 images, 7×7 stem: columns 7.4–8.0 ms, sgemms 23.7 ms (79 GFLOP/s of the ~97 a core's sgemm reaches on
this machine); the gathers of stride 2, one per tap and output row, were a quarter of the call. Now each image is
first split into its four phases (one strided pass over the image, padding included: ``_phases``), and every row of
the columns is a plain copy from one phase: tap (r, q) of output row oy is phase (r mod 2, q mod 2) at row
oy + r // 2, from column q // 2 on. The weight gradient was 32-channel blocks of dout @ colsᵀ (v26's choice for the
3×3 stems' 27 columns): on the 7×7 stem's 147 columns one sgemm of 64 rows ran 74 GFLOP/s against 55 for two of 32,
and the transposed product colsᵀ-side, dWᵀ (147 × 64) = cols @ doutᵀ, 85 (``numpy.dot`` on one thread, 1,680 columns
a block). Same forward bits (the same columns); the weight gradient's sums are the same K-long dot products, equal
to v39's bits wherever compared. Figures: kernels/README.md's v47 row.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from numba import njit, uint64

from kernels.cpu.columns import row_same
from kernels.cpu.conv_shifted import sgemm
from kernels.cpu.threads import chunk_count, run_chunks

MAX_CHANNELS = 4
"""Input channels at most: the stems (3). Wider inputs are ordinary convolutions."""


def supported(x_shape: tuple, w_shape: tuple, stride: int, pad: int, groups: int) -> bool:
    """3×3, stride 1, pad 1, one group, ≤ ``MAX_CHANNELS`` input channels, planes of ≥ 2×2 (every tap then
    has a valid row and column: ``columns.row_same``)."""
    return (
        groups == 1 and stride == 1 and pad == 1 and w_shape[1] <= MAX_CHANNELS and w_shape[2] == w_shape[3] == 3
        and x_shape[2] >= 2 and x_shape[3] >= 2
    )


def strided_supported(x_shape: tuple, w_shape: tuple, stride: int, pad: int, groups: int) -> bool:
    """v39: a square kernel (not 1×1: v33's path) at stride ≥ 2, pad < kernel, one group, ≤ ``MAX_CHANNELS`` input
    channels (the ImageNet stems: ResNet-18's 7×7 stride 2 pad 3, MobileNetV2's 3×3 stride 2 pad 1)."""
    return (
        groups == 1 and stride >= 2 and w_shape[1] <= MAX_CHANNELS and w_shape[2] == w_shape[3] > 1
        and 0 <= pad < w_shape[2] and x_shape[2] + 2 * pad >= w_shape[2] and x_shape[3] + 2 * pad >= w_shape[3]
    )


COLUMN_BUDGET = 1 << 18
"""v39: float32 elements (1 MiB) of one block of a strided stem's columns: whole output rows, so that the block
and the GEMM reading it stay in L2 (one 7×7 image's columns at 224×224 are 147 × 12,544 floats, 7.4 MB)."""


def _out_size(size: int, kernel: int, stride: int, pad: int) -> int:
    return (size + 2 * pad - kernel) // stride + 1


def block_rows(x_shape: tuple, w_shape: tuple, stride: int, pad: int) -> int:
    """Output rows per block of a strided stem's columns (``COLUMN_BUDGET``)."""
    depth = x_shape[1] * w_shape[2] * w_shape[3]
    out_h, out_w = _out_size(x_shape[2], w_shape[2], stride, pad), _out_size(x_shape[3], w_shape[3], stride, pad)
    return max(1, min(out_h, COLUMN_BUDGET // (depth * out_w)))


def phase_shape(x_shape: tuple, w_shape: tuple, stride: int, pad: int) -> tuple[int, int]:
    """v47: the rows and columns of each phase of a strided stem's phase-split image (``_phases``): output rows
    (columns) plus the taps' reach, (kernel − 1) // stride, so that every tap's run of an output row lies inside."""
    reach = (w_shape[2] - 1) // stride
    return (_out_size(x_shape[2], w_shape[2], stride, pad) + reach,
            _out_size(x_shape[3], w_shape[3], stride, pad) + reach)


def workspace_size(x_shape: tuple, threads: int, w_shape: tuple = (0, 0, 3, 3), stride: int = 1, pad: int = 1) -> int:
    """Per thread one image's columns (v36's 3×3 stride 1), or one block of output rows' (v39, strided), and
    since v47 one image split into its stride² phases and the weight gradient's transposed sum (C·R·S × K)."""
    if stride == 1:
        return threads * 9 * x_shape[1] * x_shape[2] * x_shape[3]
    return threads * sum(_slot_parts(x_shape, w_shape, stride, pad))


def _slot_parts(x_shape: tuple, w_shape: tuple, stride: int, pad: int) -> tuple[int, int, int]:
    """A thread's slot of a strided stem's scratch, float32 elements: one block of output rows' columns (v39), one
    image split into its stride² phases (v47) and the weight gradient's transposed sum, C·R·S × K (v47)."""
    depth = x_shape[1] * w_shape[2] * w_shape[3]
    out_w = _out_size(x_shape[3], w_shape[3], stride, pad)
    ph, pw = phase_shape(x_shape, w_shape, stride, pad)
    return depth * out_w * block_rows(x_shape, w_shape, stride, pad), x_shape[1] * stride * stride * ph * pw, \
        depth * w_shape[0]


@njit(cache=True, nogil=True, inline="always")
def _columns(x, n, cols):
    """cols[(3c + dy)·3 + dx, y·W + x'] = x[n, c, y + dy − 1, x' + dx − 1], 0 outside the image (pad 1, "same").

    With ``columns.row_same``: output pixel q reads input q + (dy − 1)·W + dx − 1, one offset for the whole
    plane, so each row of columns is one flat copy (it vectorizes; 32-pixel row copies from a zero-padded copy
    of the image took 16 µs per image of 3×32×32 against ~4 here), then the rows above or below the plane and
    the column that wrapped around to the neighbouring row's edge are zeroed."""
    c_in, height, width = x.shape[1], x.shape[2], x.shape[3]
    pixels = height * width
    src = x.reshape(x.size)
    for c in range(c_in):
        for t in range(9):
            line = uint64((c * 9 + t) * pixels)
            # np.int64(1), not 1: a literal would compile row_same a second time (Literal[int](1))
            row_same(src, cols, n, np.int64(1), c_in, c, height, width, t // 3 - 1, t % 3 - 1, line, pixels)


@njit(cache=True, nogil=True)
def _images(x, w_flat, y_flat, acc_flat, c_out, first, last, k_block, cols, weight):
    """Images [first, last) of a 3×3 stride-1 stem, each its columns (``_columns``), then one sgemm:
    forward ``out[n] (K × P) = W (K × 9C) @ cols`` into ``y_flat`` (3→64, one thread, per image with its columns: 87 µs
    in one sgemm against 105 in two 32-row ones); ``weight``: ``acc (K × 9C) = Σ dout[n] @ colsᵀ`` in order (zero when
    there are none), ``y_flat`` dout, in sgemms of ≤ ``k_block`` output channels.

    One compiled function for both directions, ``_columns`` inlined into it: compiled once (the two warm-up jobs are
    one family: the second loads it), and no per-image dispatch. As two compiled drivers each calling a compiled
    ``_columns`` it compiled the columns three times (1.48 s of a cold first run); as Python loops over it (the other
    drivers' way, ``conv.py``'s module docstring) the CIFAR stem's weight gradient cost +0.47 ms a call at batch 32
    (16 images a thread, three dispatches each)."""
    depth = 9 * x.shape[1]
    pixels = x.shape[2] * x.shape[3]
    scalars = np.empty(2, np.float32)
    if weight and first >= last:
        acc_flat[:] = 0.0
    for n in range(first, last):
        _columns(x, n, cols)
        if not weight:
            sgemm(False, False, c_out, pixels, depth, w_flat, depth, cols, pixels, 0.0, y_flat[n * c_out * pixels :],
                  pixels, scalars)
            continue
        beta = 0.0 if n == first else 1.0
        for k0 in range(0, c_out, k_block):
            rows = min(k_block, c_out - k0)
            sgemm(False, True, rows, depth, pixels, y_flat[(n * c_out + k0) * pixels :], pixels, cols, pixels,
                  beta, acc_flat[k0 * depth :], depth, scalars)


@njit(cache=True, inline="always")
def _gather(run, src, stride):
    """run[k] = src[stride·k]. Views from the run's first column, indices from 0: a loop over ``range(lo, hi)``
    from a run-time ``lo`` leaves the compiler to allow for NumPy's negative indices, and it does not vectorize
    (the 224 stem's columns of one image: 1.25 ms that way)."""
    for k in range(run.shape[0]):
        run[k] = src[stride * k]


@njit(cache=True, nogil=True, inline="always")
def _strided_columns(x, n, kernel, stride, pad, out_w, y0, y1, cols):
    """cols[(c·R + r)·R + s, (oy − y0)·OW + ox] = x[n, c, stride·oy + r − pad, stride·ox + s − pad] (0 outside the
    image) for output rows [y0, y1): per tap and output row one run of the valid columns between zeroed ends."""
    c_in, height, width = x.shape[1], x.shape[2], x.shape[3]
    span = (y1 - y0) * out_w
    for c in range(c_in):
        for r in range(kernel):
            for s in range(kernel):
                base = ((c * kernel + r) * kernel + s) * span
                lo = (pad - s + stride - 1) // stride if pad > s else 0  # first ox with stride·ox + s − pad ≥ 0
                hi = (width - 1 + pad - s) // stride + 1 if width - 1 + pad - s >= 0 else 0
                hi = max(lo, min(out_w, hi))
                for oy in range(y0, y1):
                    iy = stride * oy + r - pad
                    dst = base + (oy - y0) * out_w
                    if iy < 0 or iy >= height:
                        cols[dst : dst + out_w] = 0.0
                        continue
                    cols[dst : dst + lo] = 0.0
                    run, src = cols[dst + lo : dst + hi], x[n, c, iy, stride * lo + s - pad :]
                    if stride == 2:  # the ImageNet stems: a constant stride (run-time: 1.48 against 0.90 ms an image)
                        _gather(run, src, 2)
                    else:
                        _gather(run, src, stride)
                    cols[dst + hi : dst + out_w] = 0.0


@njit(cache=True, nogil=True)
def _strided_images(x, w_flat, y_flat, acc_flat, c_out, kernel, stride, pad, out_h, out_w, rows, first, last, k_block,
                    cols, weight):
    """Images [first, last) of a strided stem in blocks of ``rows`` output rows, each block's columns
    (``_strided_columns``), then forward ``out[n][:, block] (K × rows·OW, leading dimension OH·OW) = W (K × C·R·R) @
    cols`` into ``y_flat``, or (``weight``) ``acc (K × C·R·R) += dout[n][:, block] @ colsᵀ`` in order (zero when there
    are none), ``y_flat`` dout, in sgemms of ≤ ``k_block`` output channels. One compiled function for both directions,
    as ``_images``."""
    depth = x.shape[1] * kernel * kernel
    pixels = out_h * out_w
    scalars = np.empty(2, np.float32)
    if weight and first >= last:
        acc_flat[:] = 0.0
    for n in range(first, last):
        for y0 in range(0, out_h, rows):
            y1 = min(out_h, y0 + rows)
            span = (y1 - y0) * out_w
            _strided_columns(x, n, kernel, stride, pad, out_w, y0, y1, cols)
            if not weight:
                sgemm(False, False, c_out, span, depth, w_flat, depth, cols, span, 0.0,
                      y_flat[n * c_out * pixels + y0 * out_w :], pixels, scalars)
                continue
            beta = 0.0 if n == first and y0 == 0 else 1.0
            for k0 in range(0, c_out, k_block):
                count = min(k_block, c_out - k0)
                sgemm(False, True, count, depth, span, y_flat[(n * c_out + k0) * pixels + y0 * out_w :], pixels,
                      cols, span, beta, acc_flat[k0 * depth :], depth, scalars)


@njit(cache=True, nogil=True, inline="always")
def _phases(x, n, stride, pad, ph, pw, phase):
    """v47: phase[((c·s + a)·s + b)·ph·pw + i·pw + j] = x[n, c, s·i + a − pad, s·j + b − pad] (0 outside the
    image), s the stride: image n split into its s² phases, padding included. Each phase row is one run of a
    constant stride between zeroed ends (``_gather``)."""
    c_in, height, width = x.shape[1], x.shape[2], x.shape[3]
    s = stride
    for c in range(c_in):
        for a in range(s):
            for b in range(s):
                base = ((c * s + a) * s + b) * ph * pw
                lo = (pad - b + s - 1) // s if pad > b else 0  # first j with s·j + b − pad ≥ 0
                hi = (width - 1 + pad - b) // s + 1 if width - 1 + pad - b >= 0 else 0
                hi = max(lo, min(pw, hi))
                for i in range(ph):
                    y = s * i + a - pad
                    dst = base + i * pw
                    if y < 0 or y >= height:
                        phase[dst : dst + pw] = 0.0
                        continue
                    phase[dst : dst + lo] = 0.0
                    run, src = phase[dst + lo : dst + hi], x[n, c, y, s * lo + b - pad :]
                    if s == 2:  # the ImageNet stems: a constant stride
                        _gather(run, src, 2)
                    else:
                        _gather(run, src, s)
                    phase[dst + hi : dst + pw] = 0.0


@njit(cache=True, inline="always")
def _copy(run, src):
    """run[k] = src[k] (views from their first element, as ``_gather``)."""
    for k in range(run.shape[0]):
        run[k] = src[k]


@njit(cache=True, nogil=True)
def _phase_images(x, w_flat, y_flat, acc_flat, c_out, kernel, stride, pad, out_h, out_w, rows, first, last, cols,
                  phase, ph, pw, acc_t, weight):
    """v47: ``_strided_images`` with each image split into its phases first (``_phases``): tap (r, q) of output
    row oy reads phase (r mod s, q mod s) at row oy + r // s from column q // s on, so every row of a block's
    columns is a plain copy of ``out_w`` values. The weight gradient is one sgemm per block, ``acc_t (C·R·S × K)
    += cols @ dout[n][:, block]ᵀ`` (β = 1 after the first), written out transposed into ``acc_flat`` at the end
    (zero when there are no images). ``ph`` × ``pw``: a phase's size (``phase_shape``). Measured: kernels/README.md's
    v47 row."""
    depth = x.shape[1] * kernel * kernel
    pixels = out_h * out_w
    s = stride
    scalars = np.empty(2, np.float32)
    for n in range(first, last):
        _phases(x, n, s, pad, ph, pw, phase)
        for y0 in range(0, out_h, rows):
            y1 = min(out_h, y0 + rows)
            span = (y1 - y0) * out_w
            for c in range(x.shape[1]):
                for r in range(kernel):
                    for q in range(kernel):
                        line = ((c * kernel + r) * kernel + q) * span
                        src = ((c * s + r % s) * s + q % s) * ph * pw + (y0 + r // s) * pw + q // s
                        for oy in range(y1 - y0):
                            _copy(cols[line + oy * out_w : line + (oy + 1) * out_w], phase[src + oy * pw :])
            if not weight:
                sgemm(False, False, c_out, span, depth, w_flat, depth, cols, span, 0.0,
                      y_flat[n * c_out * pixels + y0 * out_w :], pixels, scalars)
                continue
            beta = 0.0 if n == first and y0 == 0 else 1.0
            sgemm(False, True, depth, c_out, span, cols, span, y_flat[n * c_out * pixels + y0 * out_w :], pixels,
                  beta, acc_t, c_out, scalars)
    if weight:
        for k in range(c_out):
            for j in range(depth):
                acc_flat[k * depth + j] = acc_t[j * c_out + k] if first < last else 0.0


_NOTHING = np.empty(1, np.float32)
"""The argument a direction does not use (``_images``' ``acc_flat`` forward, ``w_flat`` for the weight gradient)."""


def _buffers(mine: np.ndarray, x_shape: tuple, w_shape: tuple, stride: int, pad: int):
    """``mine``, a thread's slot, as its ``_slot_parts``: a block's columns, the phase-split image, the transposed
    weight-gradient sum."""
    cols, phases, transposed = _slot_parts(x_shape, w_shape, stride, pad)
    return mine[:cols], mine[cols : cols + phases], mine[cols + phases : cols + phases + transposed]


def forward(x: np.ndarray, w: np.ndarray, out: np.ndarray, threads: int, scratch: np.ndarray, stride: int = 1,
            pad: int = 1, phases: bool = False) -> None:
    """out = conv(x, w) (v36's 3×3 stride 1 pad 1, or v39's strided stems, ``phases``: v47's columns), no bias (the
    caller adds it); scratch: ``workspace_size``."""
    n, c_out = x.shape[0], w.shape[0]
    per_thread = workspace_size(x.shape, 1, w.shape, stride, pad)
    chunks = chunk_count(n, 2, threads)
    w_flat, out_flat = w.reshape(-1), out.reshape(-1)  # both C-contiguous (conv._check_array)
    rows = block_rows(x.shape, w.shape, stride, pad)
    kernel, out_h, out_w = w.shape[2], out.shape[2], out.shape[3]

    def work(chunk: int, slot: int) -> None:
        mine = scratch[slot * per_thread : (slot + 1) * per_thread]
        first, last = chunk * n // chunks, (chunk + 1) * n // chunks
        if stride == 1:
            _images(x, w_flat, out_flat, _NOTHING, c_out, first, last, 0, mine, False)
        elif phases:
            cols, phase, acc_t = _buffers(mine, x.shape, w.shape, stride, pad)
            _phase_images(x, w_flat, out_flat, _NOTHING, c_out, kernel, stride, pad, out_h, out_w, rows, first, last,
                          cols, phase, *phase_shape(x.shape, w.shape, stride, pad), acc_t, False)
        else:
            _strided_images(x, w_flat, out_flat, _NOTHING, c_out, kernel, stride, pad, out_h, out_w, rows, first, last,
                            0, mine, False)

    run_chunks(work, chunks, threads)


def weight_share(x, dout, k_block: int, w_shape: tuple = (0, 0, 3, 3), stride: int = 1,
                 pad: int = 1, phases: bool = False) -> Callable[[int, int, np.ndarray, np.ndarray], None]:
    """``conv.sum_image_shares``' ``share`` for the stem's weight gradient: images [first, last) into ``acc``,
    in sgemms of ≤ ``k_block`` output channels (``conv.STEM_WEIGHT_K_BLOCK``: v26's measured block), or with
    ``phases`` (v47, strided) one transposed sgemm of all of them per block (``_phase_images``)."""
    dout_flat, c_out, size = dout.reshape(-1), dout.shape[1], workspace_size(x.shape, 1, w_shape, stride, pad)
    rows = block_rows(x.shape, w_shape, stride, pad)
    kernel, out_h, out_w = w_shape[2], dout.shape[2], dout.shape[3]

    def share(first: int, last: int, acc, mine) -> None:
        if stride == 1:
            _images(x, _NOTHING, dout_flat, acc.reshape(-1), c_out, first, last, k_block, mine[:size], True)
        elif phases:
            cols, phase, acc_t = _buffers(mine, x.shape, w_shape, stride, pad)
            _phase_images(x, _NOTHING, dout_flat, acc.reshape(-1), c_out, kernel, stride, pad, out_h, out_w, rows,
                          first, last, cols, phase, *phase_shape(x.shape, w_shape, stride, pad), acc_t, True)
        else:
            _strided_images(x, _NOTHING, dout_flat, acc.reshape(-1), c_out, kernel, stride, pad, out_h, out_w, rows,
                            first, last, k_block, mine[:size], True)

    return share

"""Convolution on the CPU: im2col tiles that stay in cache, one BLAS GEMM per tile, and a direct
depthwise kernel.

Why this shape. A 3×3 convolution is a matrix product once the input is unrolled into columns
(im2col): ``out[K, pixels] = w[K, C·R·S] @ cols[C·R·S, pixels]``. The GEMM is where the flops are,
and BLAS (OpenBLAS, reached through ``np.dot`` inside ``@njit``) runs it at 100+ GFLOP/s on two
cores. Unrolling the whole batch at once would write a buffer nine times the input (75 MB for a
64-channel 32×32 layer at batch 32) and run at ~20 GFLOP/s, starved by memory traffic. So the
columns are built one *tile* at a time, a block of images small enough to stay in cache and large
enough to give the GEMM at least ``TARGET_COLUMNS`` columns, into the caller's ``scratch``.

The versions, numbered as in llm.c's dev/cuda, are kept side by side so the benchmark
(``engine kernels``) can show what each step bought:

- ``conv2d_forward_v1_direct``: seven nested loops, parallel over (image, output channel).
- ``conv2d_forward_v2_im2col``: im2col of one image into scratch, then one GEMM straight into
  ``out[n]``.
- ``conv2d_forward_v3_tiled``: blocks of images per tile, so the small late layers (8×8, 4×4) still
  hand BLAS a wide matrix; the tile's result is scattered back to NCHW.
- v4: one parallel region per call, each thread its share of the images, its own tiles and a
  single-threaded GEMM.
- v5 (exported): v4 plus fast paths for the shapes v4 handles badly: depthwise 3×3 stride 1 and 2 as flat
  vector runs across channel planes (``conv_depthwise.py``); 1×1 convolutions take smaller tiles
  (``POINTWISE_TARGET_COLUMNS``).

Backward to data is the transposed product, ``dcols = w.T @ dout``, then col2im adds each column
back into the pixels it came from. Backward to weights accumulates ``dw += dout_tile @ cols_tile.T``
over tiles in a fixed order. The im2col/col2im loops run in parallel (``prange``) and the GEMMs run
between them on BLAS's own threads, so the two thread pools never compete.

1×1 convolutions with stride 1 and no padding skip im2col entirely: the image already *is* its
column matrix. Depthwise convolutions (``groups == C == K``) have one input channel per filter, a
9-long dot product per pixel, far too thin for a GEMM: they use a direct kernel, one image plane
per parallel iteration.

Determinism: each output element is written by exactly one thread, weight gradients are summed
tile after tile in a fixed order, and BLAS splits its work the same way for the same thread count.
"""

from __future__ import annotations

import numpy as np
import scipy.linalg.cython_blas  # noqa: F401  the BLAS np.dot calls inside @njit: loaded now so it can be found
from numba import get_num_threads, njit, prange, uint64
from threadpoolctl import ThreadpoolController

from kernels.cpu import conv_depthwise
from kernels.reference.conv import check_conv2d_shapes

TARGET_COLUMNS = 1024
"""A tile holds whole images until its GEMM has at least this many columns (pixels)."""

WEIGHT_TARGET_COLUMNS = 4096
"""The weight gradient sums over a tile's columns inside the GEMM and adds tiles outside it:
longer tiles mean fewer partial sums to add (it pays most where C·R·S is small: 1×1 and the stem)."""

POINTWISE_TARGET_COLUMNS = 256
POINTWISE_WEIGHT_TARGET_COLUMNS = 1024
"""v5's targets for 1×1 convolutions. Their GEMMs are thin (C·R·S = C), so the column tile and the
result tile, not the weights, are what must stay in cache: smaller tiles ran the 1×1 stride-2
downsample forward 20-30% faster here, and a 32×32 image (1024 columns) then is a tile by itself,
used in place with no gather or scatter."""

TILE_BUDGET_ELEMENTS = 1 << 20
"""At most this many float32 (4 MiB) in one column tile, so it stays in the L2/L3 caches."""

EXPORTED_VERSION = 5
"""The version the kernel table uses (the fastest in ``engine kernels --ops conv2d``)."""


# ----------------------------------------------------------------------------------------------
# Planning: how many images per tile, and how much scratch that needs
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


def _is_depthwise(x_shape, w_shape, groups: int) -> bool:
    return groups > 1 and groups == x_shape[1] and groups == w_shape[0]


def _is_plain_1x1(w_shape, stride: int, pad: int) -> bool:
    return w_shape[2] == 1 and stride == 1 and pad == 0


def _threads(version: int) -> int:
    """Threads that each get their own tiles: all of Numba's for v4 and v5, one tile set for v2 and v3."""
    return get_num_threads() if version >= 4 else 1


def _tile_images(x_shape, w_shape, stride, pad, groups, version, direction) -> int:
    target = 1 if version == 2 else (WEIGHT_TARGET_COLUMNS if direction == "weight" else TARGET_COLUMNS)
    if version >= 5 and w_shape[2] == 1 and w_shape[3] == 1:
        target = POINTWISE_WEIGHT_TARGET_COLUMNS if direction == "weight" else POINTWISE_TARGET_COLUMNS
    threads = _threads(version)
    tile = images_per_tile(x_shape, w_shape, stride, pad, groups, target, threads)
    images_per_set = -(-x_shape[0] // threads)
    if direction == "weight" and version > 2 and tile < images_per_set:
        # a second tile needs a dw-sized partial sum; when that is bigger than the columns of the
        # whole set (deep layers: 512·4608 weights, 16 pixels an image), take the whole set at once
        oh, ow = check_conv2d_shapes(x_shape, w_shape, stride, pad, groups)
        rows = w_shape[1] * w_shape[2] * w_shape[3]
        if (w_shape[0] // groups) * rows >= rows * oh * ow * images_per_set:
            tile = images_per_set
    return tile


def _workspace_size(x_shape, w_shape, stride, pad, groups, direction: str, version: int) -> int:
    """Scratch elements. Per tile set: a column tile, a K-side tile (when it holds several images)
    and, for the weight gradient, a partial dw when a set has several tiles; v4 has one tile set per
    thread and one dw-sized partial sum per extra thread."""
    if version > 2 and _is_depthwise(x_shape, w_shape, groups):
        if version >= 5 and conv_depthwise.supported(x_shape, w_shape, stride, pad, direction):
            return conv_depthwise.workspace_size(x_shape, stride)
        return 0
    oh, ow = check_conv2d_shapes(x_shape, w_shape, stride, pad, groups)
    threads = _threads(version)
    tile = _tile_images(x_shape, w_shape, stride, pad, groups, version, direction)
    rows = w_shape[1] * w_shape[2] * w_shape[3]
    k_group = w_shape[0] // groups
    columns = tile * oh * ow
    cols = 0 if (_is_plain_1x1(w_shape, stride, pad) and tile == 1) else rows * columns
    k_side = k_group * columns if tile > 1 else 0
    size = cols + k_side
    if direction == "weight":
        images_per_set = -(-x_shape[0] // threads)
        size += k_group * rows if tile < images_per_set else 0
        return threads * size + (threads - 1) * int(np.prod(w_shape))
    return threads * size


def conv2d_forward_workspace_size(x_shape, w_shape, stride: int, pad: int, groups: int) -> int:
    """Scratch (float32 elements) for ``conv2d_forward``: a column tile and output tile per thread."""
    return _workspace_size(x_shape, w_shape, stride, pad, groups, "forward", EXPORTED_VERSION)


def conv2d_backward_data_workspace_size(x_shape, w_shape, stride: int, pad: int, groups: int) -> int:
    """Scratch for ``conv2d_backward_data``: a gradient-column tile and dout tile per thread."""
    return _workspace_size(x_shape, w_shape, stride, pad, groups, "data", EXPORTED_VERSION)


def conv2d_backward_weight_workspace_size(x_shape, w_shape, stride: int, pad: int, groups: int) -> int:
    """Scratch for ``conv2d_backward_weight``: tiles per thread plus a dw-sized partial sum per extra thread."""
    return _workspace_size(x_shape, w_shape, stride, pad, groups, "weight", EXPORTED_VERSION)


def conv2d_version_workspace_size(version: int, direction: str, x_shape, w_shape, stride, pad, groups) -> int:
    """Scratch for a numbered version (2 to 5) and direction ("forward", "data" or "weight")."""
    return _workspace_size(x_shape, w_shape, stride, pad, groups, direction, version)


# ----------------------------------------------------------------------------------------------
# Tile movers: im2col, col2im, gather and scatter between NCHW and a [channels, tile pixels] tile
# ----------------------------------------------------------------------------------------------


@njit(cache=True, inline="always")
def _valid_outputs(size: int, out_size: int, offset: int, stride: int, pad: int) -> tuple[int, int]:
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


@njit(cache=True, nogil=True)
def _im2col_row_same(src, dst, n0, images, channels, c, height, width, dy, dx, line0, pixels):
    """One im2col row of a stride-1 "same" convolution (output as wide as the input) in one copy.

    Output pixel q = y·W + ox reads input q + dy·W + dx: one offset for the whole plane, so the
    valid rows are a single flat copy (long enough to vectorize, unlike 4–32-pixel row copies).
    The copy also fills the column that falls off the plane (|dx| = 1: the neighbouring row's edge
    pixel), which is then zeroed, as are the rows above or below the plane.
    """
    y_lo = max(0, -dy)
    y_hi = min(height, height - dy)
    x_lo = max(0, -dx)
    x_hi = min(width, width - dx)
    first = y_lo * width + x_lo  # the first and last outputs whose input lies inside the plane
    last = (y_hi - 1) * width + x_hi
    shift = dy * width + dx
    for i in range(images):
        plane = uint64(((n0 + i) * channels + c) * height * width)
        line = line0 + uint64(i * pixels)
        start = plane + uint64(first + shift)  # an in-plane input index, never negative
        copy_to = line + uint64(first)
        for q in range(first):
            dst[line + uint64(q)] = 0.0
        for q in range(last - first):
            dst[copy_to + uint64(q)] = src[start + uint64(q)]
        for q in range(last, pixels):
            dst[line + uint64(q)] = 0.0
        for y in range(y_lo, y_hi):  # the wrapped-around column, where there is one
            row_start = line + uint64(y * width)
            for ox in range(x_lo):
                dst[row_start + uint64(ox)] = 0.0
            for ox in range(x_hi, width):
                dst[row_start + uint64(ox)] = 0.0


@njit(cache=True, nogil=True)
def _im2col_row(x, n0, images, c0, stride, pad, kernel, out_h, out_w, cols, row):
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
    y_lo, y_hi = _valid_outputs(height, out_h, r, stride, pad)
    x_lo, x_hi = _valid_outputs(width, out_w, s, stride, pad)
    src, dst = x.reshape(x.size), cols.reshape(cols.size)
    line0 = uint64(row * cols.shape[1])
    if stride == 1 and out_w == width and y_lo < y_hi and x_lo < x_hi:
        _im2col_row_same(src, dst, n0, images, channels, c0 + c, height, width, r - pad, s - pad, line0, pixels)
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


@njit(cache=True, nogil=True)
def _col2im_plane(dcols, n0, c0, stride, pad, kernel, out_h, out_w, dx, c, i):
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
        y_lo, y_hi = _valid_outputs(height, out_h, r, stride, pad)
        for s in range(kernel):
            x_lo, x_hi = _valid_outputs(width, out_w, s, stride, pad)
            line = uint64(((c * kernel + r) * kernel + s) * dcols.shape[1] + i * pixels)
            if same and y_lo < y_hi and x_lo < x_hi:
                # As in _im2col_row_same: one flat run per offset. The wrapped-around column's
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


@njit(parallel=True, cache=True, nogil=True)
def im2col_tile(x, n0, images, c0, stride, pad, kernel, out_h, out_w, cols):
    """cols[(c·R + r)·S + s, i·OH·OW + oh·OW + ow] = x_padded[n0 + i, c0 + c, oh·stride + r, ow·stride + s]."""
    for row in prange(cols.shape[0]):
        _im2col_row(x, n0, images, c0, stride, pad, kernel, out_h, out_w, cols, row)


@njit(cache=True, nogil=True)
def im2col_tile_serial(x, n0, images, c0, stride, pad, kernel, out_h, out_w, cols):
    """im2col_tile on the calling thread only (for kernels that are already inside a parallel loop)."""
    for row in range(cols.shape[0]):
        _im2col_row(x, n0, images, c0, stride, pad, kernel, out_h, out_w, cols, row)


@njit(parallel=True, cache=True, nogil=True)
def col2im_tile(dcols, n0, images, c0, channels, stride, pad, kernel, out_h, out_w, dx):
    """The transpose of im2col. One parallel iteration owns one whole (image, channel) plane, so
    there are no write races and every pixel's sum runs in the same order."""
    for job in prange(channels * images):
        _col2im_plane(dcols, n0, c0, stride, pad, kernel, out_h, out_w, dx, job // images, job % images)


@njit(cache=True, nogil=True)
def col2im_tile_serial(dcols, n0, images, c0, channels, stride, pad, kernel, out_h, out_w, dx):
    for job in range(channels * images):
        _col2im_plane(dcols, n0, c0, stride, pad, kernel, out_h, out_w, dx, job // images, job % images)


@njit(cache=True, nogil=True)
def gather_tile(a, n0, images, k0, tile):
    """tile[k, i·P + p] = a[n0 + i, k0 + k, p] (a seen as N×K×P): channels of several images side by side."""
    pixels = a.shape[2] * a.shape[3]
    for k in range(tile.shape[0]):
        for i in range(images):
            tile[k, i * pixels : (i + 1) * pixels] = a[n0 + i, k0 + k].reshape(pixels)


@njit(cache=True, nogil=True)
def scatter_tile(tile, n0, images, k0, a):
    """The inverse of gather_tile: a[n0 + i, k0 + k, p] = tile[k, i·P + p]."""
    pixels = a.shape[2] * a.shape[3]
    for k in range(tile.shape[0]):
        for i in range(images):
            a[n0 + i, k0 + k].reshape(pixels)[:] = tile[k, i * pixels : (i + 1) * pixels]


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
# The GEMM convolutions (any stride, padding and groups)
# ----------------------------------------------------------------------------------------------


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
                scatter_tile(result, n0, images, g * k_group, out)


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
                gather_tile(dout, n0, images, g * k_group, d_tile)
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
                gather_tile(dout, n0, images, g * k_group, d_tile)
                used += k_group * columns
            dw_g = dw[g * k_group : (g + 1) * k_group].reshape(k_group, rows)
            if n0 == 0:
                np.dot(d_tile, cols.T, dw_g)
            else:
                partial = scratch[used : used + k_group * rows].reshape(k_group, rows)
                np.dot(d_tile, cols.T, partial)
                dw_g += partial


# ----------------------------------------------------------------------------------------------
# v4: one parallel region per call, each thread owns a share of the images and its own tiles
# ----------------------------------------------------------------------------------------------


@njit(cache=True, nogil=True)
def _forward_images(x, w, out, stride, pad, groups, first, last, tile_images, scratch):
    """Images [first, last) on the calling thread: serial im2col, single-threaded GEMM."""
    k_total, c_group, kernel = w.shape[0], w.shape[1], w.shape[2]
    out_h, out_w = out.shape[2], out.shape[3]
    pixels = out_h * out_w
    k_group = k_total // groups
    rows = c_group * kernel * kernel
    plain_1x1 = kernel == 1 and stride == 1 and pad == 0
    for n0 in range(first, last, tile_images):
        images = min(tile_images, last - n0)
        columns = images * pixels
        for g in range(groups):
            w_g = w[g * k_group : (g + 1) * k_group].reshape(k_group, rows)
            if plain_1x1 and images == 1:
                cols = x[n0, g * c_group : (g + 1) * c_group].reshape(c_group, pixels)
            else:
                cols = scratch[: rows * columns].reshape(rows, columns)
                im2col_tile_serial(x, n0, images, g * c_group, stride, pad, kernel, out_h, out_w, cols)
            if images == 1:
                np.dot(w_g, cols, out[n0, g * k_group : (g + 1) * k_group].reshape(k_group, pixels))
            else:
                start = rows * columns
                result = scratch[start : start + k_group * columns].reshape(k_group, columns)
                np.dot(w_g, cols, result)
                scatter_tile(result, n0, images, g * k_group, out)


@njit(parallel=True, cache=True, nogil=True)
def _forward_per_thread(x, w, out, stride, pad, groups, tile_images, threads, scratch):
    n_images = x.shape[0]
    share = scratch.size // threads
    for t in prange(threads):
        mine = scratch[t * share : (t + 1) * share]
        first, last = t * n_images // threads, (t + 1) * n_images // threads
        _forward_images(x, w, out, stride, pad, groups, first, last, tile_images, mine)


@njit(cache=True, nogil=True)
def _backward_data_images(dout, w, dx, stride, pad, groups, first, last, tile_images, scratch):
    k_total, c_group, kernel = w.shape[0], w.shape[1], w.shape[2]
    out_h, out_w = dout.shape[2], dout.shape[3]
    pixels = out_h * out_w
    k_group = k_total // groups
    rows = c_group * kernel * kernel
    plain_1x1 = kernel == 1 and stride == 1 and pad == 0
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
                np.dot(w_g.T, d_tile, dx[n0, g * c_group : (g + 1) * c_group].reshape(c_group, pixels))
            else:
                start = k_group * columns if images > 1 else 0
                dcols = scratch[start : start + rows * columns].reshape(rows, columns)
                np.dot(w_g.T, d_tile, dcols)
                col2im_tile_serial(dcols, n0, images, g * c_group, c_group, stride, pad, kernel, out_h, out_w, dx)


@njit(parallel=True, cache=True, nogil=True)
def _backward_data_per_thread(dout, w, dx, stride, pad, groups, tile_images, threads, scratch):
    n_images = dx.shape[0]
    share = scratch.size // threads
    for t in prange(threads):
        mine = scratch[t * share : (t + 1) * share]
        first, last = t * n_images // threads, (t + 1) * n_images // threads
        _backward_data_images(dout, w, dx, stride, pad, groups, first, last, tile_images, mine)


@njit(cache=True, nogil=True)
def _backward_weight_images(x, dout, acc, stride, pad, groups, first, last, tile_images, scratch):
    """acc = Σ over images [first, last) of dout_tile @ cols_tile.T, tile after tile in order."""
    k_total, c_group, kernel = acc.shape[0], acc.shape[1], acc.shape[2]
    out_h, out_w = dout.shape[2], dout.shape[3]
    pixels = out_h * out_w
    k_group = k_total // groups
    rows = c_group * kernel * kernel
    plain_1x1 = kernel == 1 and stride == 1 and pad == 0
    if first >= last:
        acc[...] = 0.0
    for n0 in range(first, last, tile_images):
        images = min(tile_images, last - n0)
        columns = images * pixels
        for g in range(groups):
            used = 0
            if plain_1x1 and images == 1:
                cols = x[n0, g * c_group : (g + 1) * c_group].reshape(c_group, pixels)
            else:
                cols = scratch[: rows * columns].reshape(rows, columns)
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
                np.dot(d_tile, cols.T, acc_g)
            else:
                partial = scratch[used : used + k_group * rows].reshape(k_group, rows)
                np.dot(d_tile, cols.T, partial)
                acc_g += partial


@njit(parallel=True, cache=True, nogil=True)
def _backward_weight_per_thread(x, dout, dw, stride, pad, groups, tile_images, threads, scratch):
    """Thread 0 sums into dw, thread t > 0 into its own dw-sized slot; the slots are added in order."""
    n_images = x.shape[0]
    slots = (threads - 1) * dw.size
    share = (scratch.size - slots) // threads
    sums = scratch[scratch.size - slots :]
    for t in prange(threads):
        mine = scratch[t * share : (t + 1) * share]
        first, last = t * n_images // threads, (t + 1) * n_images // threads
        if t == 0:
            _backward_weight_images(x, dout, dw, stride, pad, groups, first, last, tile_images, mine)
        else:
            acc = sums[(t - 1) * dw.size : t * dw.size].reshape(dw.shape)
            _backward_weight_images(x, dout, acc, stride, pad, groups, first, last, tile_images, mine)
    flat = dw.reshape(dw.size)
    for i in prange(dw.size):
        total = flat[i]
        for t in range(1, threads):
            total += sums[(t - 1) * dw.size + i]
        flat[i] = total


# ----------------------------------------------------------------------------------------------
# Direct kernels: depthwise (groups == C == K) and the naive v1 baseline
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
            y_lo, y_hi = _valid_outputs(height, out_h, r, stride, pad)
            for s in range(kernel):
                x_lo, x_hi = _valid_outputs(width, out_w, s, stride, pad)
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
            y_lo, y_hi = _valid_outputs(height, out_h, r, stride, pad)
            for s in range(kernel):
                x_lo, x_hi = _valid_outputs(width, out_w, s, stride, pad)
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
            y_lo, y_hi = _valid_outputs(height, out_h, r, stride, pad)
            for s in range(kernel):
                x_lo, x_hi = _valid_outputs(width, out_w, s, stride, pad)
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


class _BlasOnCallingThread:
    """Run SciPy's OpenBLAS (the one ``np.dot`` inside @njit calls) single-threaded for a while.

    v4 calls BLAS from inside a parallel loop, one GEMM per Numba thread; a multithreaded BLAS
    there would start threads of its own and oversubscribe the cores. NumPy's own BLAS is a
    different library and is left alone.
    """

    def __init__(self) -> None:
        self._libraries = None
        self._saved: list[int] = []

    def __enter__(self):
        if self._libraries is None:
            blas = ThreadpoolController().select(user_api="blas").lib_controllers
            scipys = [lib for lib in blas if "scipy" in lib.filepath.replace("\\", "/").split("/")[-2]]
            self._libraries = scipys or blas  # unknown layout: limit every BLAS rather than oversubscribe
        self._saved = [lib.num_threads for lib in self._libraries]
        for lib in self._libraries:
            lib.set_num_threads(1)
        return self

    def __exit__(self, *exc) -> None:
        for lib, threads in zip(self._libraries, self._saved):
            lib.set_num_threads(threads)


_blas_on_calling_thread = _BlasOnCallingThread()


def conv2d_forward(x, w, bias, out, stride: int, pad: int, groups: int, scratch) -> None:
    """out = conv2d(x, w) + bias, written into ``out``; scratch sized by conv2d_forward_workspace_size."""
    _forward(x, w, bias, out, stride, pad, groups, scratch, EXPORTED_VERSION)


def conv2d_backward_data(dout, w, dx, stride: int, pad: int, groups: int, scratch) -> None:
    """dx = the gradient of conv2d's output ``dout`` with respect to its input."""
    _backward_data(dout, w, dx, stride, pad, groups, scratch, EXPORTED_VERSION)


def conv2d_backward_weight(x, dout, dw, dbias, stride: int, pad: int, groups: int, scratch) -> None:
    """dw (and dbias when given) = the gradients of conv2d's output ``dout`` w.r.t. weights and bias."""
    _backward_weight(x, dout, dw, dbias, stride, pad, groups, scratch, EXPORTED_VERSION)


def conv2d_forward_v1_direct(x, w, bias, out, stride: int, pad: int, groups: int, scratch=None) -> None:
    """Version 1: the direct loop nest (no scratch). The baseline the tour starts from."""
    stride, pad, groups = int(stride), int(pad), int(groups)
    _check_forward_args(x, w, bias, out, stride, pad, groups)
    direct_forward(x, w, out, stride, pad, groups)
    if bias is not None:
        add_bias(out, bias)


def conv2d_version(version: int, direction: str):
    """A numbered version's kernel for "forward" (1-5), "data" or "weight" (2-5), with the table's signature.

    1 direct loops, 2 im2col one image at a time, 3 tiles of several images, 4 a tile set per thread,
    5 as 4 plus the fast paths: depthwise v2 (``conv_depthwise``), smaller tiles for 1×1.
    """
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


def _check_forward_args(x, w, bias, out, stride, pad, groups) -> None:
    _check_array("x", x, x.shape)
    _check_array("w", w, w.shape)
    _check_array("out", out, _check_conv(x.shape, w, stride, pad, groups))
    if bias is not None:
        _check_array("bias", bias, (w.shape[0],))


def _forward(x, w, bias, out, stride, pad, groups, scratch, version) -> None:
    stride, pad, groups = int(stride), int(pad), int(groups)
    _check_forward_args(x, w, bias, out, stride, pad, groups)
    if version >= 5 and _is_depthwise(x.shape, w.shape, groups) and conv_depthwise.supported(
        x.shape, w.shape, stride, pad, "forward"
    ):
        needed = _workspace_size(x.shape, w.shape, stride, pad, groups, "forward", version)
        scratch = _check_scratch(scratch, needed, "conv2d_forward_workspace_size")
        conv_depthwise.run_forward(x, w, out, stride, scratch)
    elif version > 2 and _is_depthwise(x.shape, w.shape, groups):
        depthwise_forward(x, w, out, stride, pad)
    else:
        needed = _workspace_size(x.shape, w.shape, stride, pad, groups, "forward", version)
        scratch = _check_scratch(scratch, needed, "conv2d_forward_workspace_size")
        tile = _tile_images(x.shape, w.shape, stride, pad, groups, version, "forward")
        if version >= 4:
            with _blas_on_calling_thread:
                _forward_per_thread(x, w, out, stride, pad, groups, tile, _threads(version), scratch[:needed])
        else:
            _forward_gemm(x, w, out, stride, pad, groups, tile, scratch)
    if bias is not None:
        add_bias(out, bias)


def _backward_data(dout, w, dx, stride, pad, groups, scratch, version) -> None:
    stride, pad, groups = int(stride), int(pad), int(groups)
    _check_array("dx", dx, dx.shape)
    _check_array("w", w, w.shape)
    _check_array("dout", dout, _check_conv(dx.shape, w, stride, pad, groups))
    if version >= 5 and _is_depthwise(dx.shape, w.shape, groups) and conv_depthwise.supported(
        dx.shape, w.shape, stride, pad, "data"
    ):
        needed = _workspace_size(dx.shape, w.shape, stride, pad, groups, "data", version)
        scratch = _check_scratch(scratch, needed, "conv2d_backward_data_workspace_size")
        conv_depthwise.run_backward_data(dout, w, dx, stride, scratch)
        return
    if version > 2 and _is_depthwise(dx.shape, w.shape, groups):
        depthwise_backward_data(dout, w, dx, stride, pad)
        return
    needed = _workspace_size(dx.shape, w.shape, stride, pad, groups, "data", version)
    scratch = _check_scratch(scratch, needed, "conv2d_backward_data_workspace_size")
    tile = _tile_images(dx.shape, w.shape, stride, pad, groups, version, "data")
    if version >= 4:
        with _blas_on_calling_thread:
            _backward_data_per_thread(dout, w, dx, stride, pad, groups, tile, _threads(version), scratch[:needed])
    else:
        _backward_data_gemm(dout, w, dx, stride, pad, groups, tile, scratch)


def _backward_weight(x, dout, dw, dbias, stride, pad, groups, scratch, version) -> None:
    stride, pad, groups = int(stride), int(pad), int(groups)
    _check_array("x", x, x.shape)
    _check_array("dw", dw, dw.shape)
    _check_array("dout", dout, _check_conv(x.shape, dw, stride, pad, groups))
    if dbias is not None:
        _check_array("dbias", dbias, (dw.shape[0],))
    if version >= 5 and _is_depthwise(x.shape, dw.shape, groups) and conv_depthwise.supported(
        x.shape, dw.shape, stride, pad, "weight"
    ):
        needed = _workspace_size(x.shape, dw.shape, stride, pad, groups, "weight", version)
        scratch = _check_scratch(scratch, needed, "conv2d_backward_weight_workspace_size")
        conv_depthwise.run_backward_weight(x, dout, dw, stride, scratch)
    elif version > 2 and _is_depthwise(x.shape, dw.shape, groups):
        depthwise_backward_weight(x, dout, dw, stride, pad)
    else:
        needed = _workspace_size(x.shape, dw.shape, stride, pad, groups, "weight", version)
        scratch = _check_scratch(scratch, needed, "conv2d_backward_weight_workspace_size")
        tile = _tile_images(x.shape, dw.shape, stride, pad, groups, version, "weight")
        if version >= 4:
            with _blas_on_calling_thread:
                _backward_weight_per_thread(
                    x, dout, dw, stride, pad, groups, tile, _threads(version), scratch[:needed]
                )
        else:
            _backward_weight_gemm(x, dout, dw, stride, pad, groups, tile, scratch)
    if dbias is not None:
        bias_gradient(dout, dbias)

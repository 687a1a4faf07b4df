"""The one im2col row copy that both the general im2col path (``conv.im2col_row``) and the stems
(``conv_stem``) build their columns with."""

from __future__ import annotations

from numba import njit, uint64


@njit(cache=True, nogil=True)
def row_same(src, dst, n0, images, channels, c, height, width, dy, dx, line0, pixels):
    """One im2col row of a stride-1 "same" convolution (output as wide as the input) in one copy, for
    ``images`` images from ``n0``: channel ``c``, tap offset (``dy``, ``dx``), written from ``dst[line0]``,
    ``pixels`` per image.

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

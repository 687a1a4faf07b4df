"""3×3 stride-1 pad-1 convolution as three shifted GEMMs per tile (no im2col): version 7, exported.

Why. im2col writes every input pixel nine times into a column tile and reads it back for one GEMM
of depth C·9; col2im does the same in reverse. On ResNet-18's 3×3 layers that traffic was 15–20%
of each convolution (kernels/README.md). Here the input is copied THREE times, once per
horizontal tap dx, into a row-expanded tile ``P3[(c, dx), q]`` (zeros where x + dx − 1 leaves the
plane), and the vertical taps dy are shifts of that tile by whole rows:

    O[K, q] = Σ_dy W_dy[K, 3C] @ P3[3C, q + dy·W]

Each dy's operand is ``P3`` itself at an offset, a strided view whose leading dimension is the
tile's row length: BLAS reads it in place (``sgemm`` with β = 1 adding the second and third dy).
The images of a tile are stacked with ONE zero row between them (the bottom pad of one image is
the top pad of the next), so the output grid wastes (H+1)/H of its columns: 1.03 at 32×32, 1.25 at
4×4. A tile of one image writes its GEMM straight into ``out[n]``; stacked tiles (small planes)
copy each image's block out of the grid.

- forward: ``P3`` from x (C channels), ``W_dy[k, 3c + dx] = w[k, c, dy, dx]``.
- backward-data: the same kernel on dout (K channels) with the flipped filter,
  ``W_dy[c, 3k + dx] = w[k, c, 2−dy, 2−dx]``, stored as its transpose (3K × C, in w's own order)
  and read transposed by the GEMM: a transposing copy of 512×512×9 weights cost several ms.
- backward-weight: ``dW_dy[K, 3C] += D[K, q] @ P3[3C, q + dy·W]ᵀ`` with D = dout (in place for a
  one-image tile; stacked tiles copy dout with zero separator rows).

Versus v6 (nine shifted GEMMs of depth C over zero-padded planes, ``conv_study.py``): deeper GEMMs
(3C instead of C) run closer to sgemm's peak and the grid wastes less, for a 3× copy of the input
(~1 ms per call on 64 ch @32×32). One thread, CPU ms, batch 32, best-of medians on this shared
machine (v6 / v7 / v5 im2col / torch): 64 ch @32×32 forward 25.5 / 26.2 / 33.8 / 52.7, weight
27.9 / 24.6 / 29.9 / 46.6; 256 ch @8×8 forward 25.2 / 24.3 / 27.4 / 38.2; 512 ch @4×4 forward
34.4 / 28.4 / 24.4 / 26.6 (so 4×4 stays on im2col, ``conv.SHIFTED_MIN_PIXELS``).

BLAS is called through Numba's own ``numba_xxgemm`` helper (the function ``np.dot`` in ``@njit``
uses, which forwards to SciPy's ``cython_blas.sgemm``): unlike ``np.dot`` it takes leading
dimensions, so the shifted views need no copy, and it is an external symbol resolved at load
time, so the kernels stay in Numba's on-disk cache.

Threads: one parallel region per call; thread ``t`` owns images ``[t·N/T, (t+1)·N/T)``, its own
slice of scratch and a single-threaded GEMM (the caller runs SciPy's BLAS on one thread). The
weight gradient's per-thread partial sums are added in thread order: the same bits every call.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import scipy.linalg.cython_blas  # noqa: F401  numba_xxgemm forwards to it: loaded before any kernel runs
from numba import njit, types, uint64

from kernels.cpu.threads import run_shares

TARGET_COLUMNS = 256
"""Images stack into one tile until the GEMM has at least this many output columns. Small on
purpose: a one-image tile writes its GEMM straight into ``out`` (and reads ``dout`` in place for
the weight gradient), and the output tile stays in cache. Swept at one thread, thread CPU ms
(forward / weight): 128 ch @16×16 26.1 / 22.5 at 1024 (4 images a tile), 22.2 / 20.6 at 512,
20.3 / 19.3 at 256 (one image); 256 ch @8×8 26.3 / 21.2 → 25.4 / 20.1 (4 images); 64 ch @32×32
unchanged (one image either way); 2048 and 4096 were 5–30% slower everywhere."""

TILE_BUDGET_ELEMENTS = 1 << 19
"""At most this many float32 (2 MiB) in the row-expanded tile, so it stays in L2/L3."""

_gemm = types.ExternalFunction(
    "numba_xxgemm",
    types.intc(
        types.char,
        types.char,
        types.char,
        types.intp,
        types.intp,
        types.intp,
        types.CPointer(types.float32),
        types.CPointer(types.float32),
        types.intp,
        types.CPointer(types.float32),
        types.intp,
        types.CPointer(types.float32),
        types.CPointer(types.float32),
        types.intp,
    ),
)


def supported(x_shape, w_shape, stride: int, pad: int, groups: int) -> bool:
    """Dense (groups 1) 3×3 convolutions with stride 1 and padding 1."""
    return groups == 1 and w_shape[2] == 3 and w_shape[3] == 3 and stride == 1 and pad == 1


@njit(cache=True, nogil=True, inline="always")
def sgemm(trans_a, trans_b, m, n, k, a, lda, b, ldb, beta, c, ldc, scalars):
    """Row-major C[m, n] = op(A)[m, k] @ op(B)[k, n] + β·C through column-major sgemm (Cᵀ = Bᵀ·Aᵀ).

    ``a``, ``b``, ``c`` are 1-D views starting at the first element; ``scalars`` holds [1, β]."""
    scalars[0] = 1.0
    scalars[1] = beta
    _gemm(
        np.int8(115),
        np.int8(116 if trans_b else 110),
        np.int8(116 if trans_a else 110),
        n,
        m,
        k,
        scalars[0:].ctypes,
        b.ctypes,
        ldb,
        a.ctypes,
        lda,
        scalars[1:].ctypes,
        c.ctypes,
        ldc,
    )


@njit(cache=True, nogil=True)
def row_block(rows, depth, columns, limit):
    """Rows of C per sgemm: the fewest near-equal blocks with rows × depth × columns ≤ ``limit``
    multiply-adds, where SciPy's OpenBLAS takes its small-matrix kernel (``conv_pointwise``'s
    ``SMALL_GEMM_MNK``); ``limit`` ≤ 0: all rows in one. Called from Python and from the drivers."""
    if limit <= 0:
        return rows
    most = max(1, limit // max(1, depth * columns))
    blocks = max(1, (rows + most - 1) // most)
    return (rows + blocks - 1) // blocks


GEMM_FIELDS = ("trans_a", "trans_b", "m", "n", "k", "a", "lda", "b", "ldb", "beta", "c", "ldc")
"""The columns of a ``gemm_list`` table: one sgemm per row, ``a``, ``b``, ``c`` the offsets into the three arrays
and ``beta`` 0 or 1."""


@njit(cache=True, nogil=True)
def gemm_list(a, b, c, table):
    """One sgemm per row of ``table`` (``GEMM_FIELDS``), in order: C[c:] = op(A[a:]) @ op(B[b:]) + β·C.

    Why. The Winograd paths' blocks each ran their 16 or 36 GEMMs from a small compiled loop of their own (six such
    loops, 0.15–0.42 s of a cold first run's CPU each, the slicing and the inlined call more than the loop); this one
    runs any of them from a table that the caller builds once per block shape (``gemm_table``, cached). The same
    calls in the same order: the same bits."""
    scalars = np.empty(2, np.float32)
    for i in range(table.shape[0]):
        r = table[i]
        sgemm(r[0] != 0, r[1] != 0, r[2], r[3], r[4], a[r[5] :], r[6], b[r[7] :], r[8], 1.0 if r[9] != 0 else 0.0,
              c[r[10] :], r[11], scalars)


def gemm_table(rows) -> np.ndarray:
    """A ``gemm_list`` table from rows of ``GEMM_FIELDS`` values (bools and ints)."""
    return np.array([[int(v) for v in row] for row in rows], dtype=np.int64).reshape(-1, len(GEMM_FIELDS))


@lru_cache(maxsize=1024)
def _one_gemm(trans_a: bool, trans_b: bool, m: int, n: int, k: int, lda: int, ldb: int, ldc: int) -> np.ndarray:
    return gemm_table([(trans_a, trans_b, m, n, k, 0, lda, 0, ldb, False, 0, ldc)])


def gemm(a: np.ndarray, b: np.ndarray, c: np.ndarray, trans_a: bool = False, trans_b: bool = False) -> None:
    """c = op(a) @ op(b) for C-contiguous 2-D float32 arrays (views included), one sgemm through ``gemm_list``.

    Why not ``np.dot`` inside ``@njit`` (what the im2col path and the dense layers called until 2026-11-28): every
    compiled caller of it cost 0.15–0.20 s of a cold first run's CPU, and Numba's ``np.dot`` implementations another
    0.32 s (``linalg.<lambda>``, ``numba:compile`` events); ``gemm_list`` is compiled for the Winograd paths anyway.
    The same sgemm with the same operands: the same bits (compared on the dense layers' and im2col's shapes)."""
    if not (a.flags.c_contiguous and b.flags.c_contiguous and c.flags.c_contiguous):
        # a strided view's reshape(-1) is a copy: c's result would be written there and lost
        raise ValueError("conv_shifted.gemm: a, b and c must be C-contiguous (pass np.ascontiguousarray copies)")
    m, n = c.shape
    k = a.shape[0] if trans_a else a.shape[1]
    op_a = (a.shape[1], a.shape[0]) if trans_a else a.shape
    op_b = (b.shape[1], b.shape[0]) if trans_b else b.shape
    if op_a != (m, k) or op_b != (k, n):  # sgemm would read or write past the arrays
        raise ValueError(f"conv_shifted.gemm: op(a) {op_a} @ op(b) {op_b} does not make c {c.shape}; pass operands "
                         f"whose shapes agree (trans_a={bool(trans_a)}, trans_b={bool(trans_b)})")
    table = _one_gemm(bool(trans_a), bool(trans_b), m, n, k, a.shape[1], b.shape[1], n)
    gemm_list(a.reshape(-1), b.reshape(-1), c.reshape(-1), table)


def tile_images(x_shape, channels: int, threads: int) -> int:
    """Images per tile: enough for ``TARGET_COLUMNS`` columns, within the budget, ≤ a thread's share."""
    n, _, h, w = x_shape
    share = -(-n // threads)
    wanted = -(-TARGET_COLUMNS // (h * w))
    fits = max(1, TILE_BUDGET_ELEMENTS // (3 * channels * (h + 1) * w))
    return max(1, min(share, wanted, fits))


def workspace_size(x_shape, w_shape, direction: str, threads: int) -> int:
    """Scratch (float32 elements): per thread the row-expanded tile (and the output grid when a tile
    holds several images); the three reordered filters, or per thread a partial dw (weight gradient)."""
    _, _, h, w = x_shape
    k, c = w_shape[0], w_shape[1]
    c_in, c_out = (k, c) if direction == "data" else (c, k)
    images = tile_images(x_shape, c_in, threads)
    row = (images * (h + 1) + 1) * w
    m = ((images - 1) * (h + 1) + h) * w
    grid = c_out * m if images > 1 else 0
    per_thread = 3 * c_in * row + grid
    filters = 9 * k * c
    return threads * per_thread + (threads * filters if direction == "weight" else filters)


@njit(cache=True, nogil=True)
def _pack(src, n0, images, channels, height, width, row, dst):
    """dst[3c + dx, (1 + i·(H+1) + y)·W + x] = src[n0 + i, c, y, x + dx − 1], zero where off the plane."""
    plane = height * width
    for c in range(channels):
        for dx in range(3):
            base = uint64((3 * c + dx) * row)
            for q in range(width):
                dst[base + uint64(q)] = 0.0
            for i in range(images):
                s0 = uint64(((n0 + i) * channels + c) * plane)
                d0 = base + uint64((1 + i * (height + 1)) * width)
                for y in range(height):
                    sr = s0 + uint64(y * width)
                    dr = d0 + uint64(y * width)
                    if dx == 1:
                        for x in range(width):
                            dst[dr + uint64(x)] = src[sr + uint64(x)]
                    elif dx == 0:
                        dst[dr] = 0.0
                        for x in range(1, width):
                            dst[dr + uint64(x)] = src[sr + uint64(x - 1)]
                    else:
                        for x in range(width - 1):
                            dst[dr + uint64(x)] = src[sr + uint64(x + 1)]
                        dst[dr + uint64(width - 1)] = 0.0
                sep = d0 + uint64(height * width)
                for x in range(width):
                    dst[sep + uint64(x)] = 0.0


@njit(cache=True, nogil=True)
def _filters(w, flipped, out):
    """out[dy][K, 3C] = w[k, c, dy, dx] at (k, 3c + dx); flipped: out[dy][3K, C] = w[k, c, 2 − dy, 2 − dx]
    at (3k + dx, c), which the GEMM reads transposed (C × 3K): built in w's own order, no strided
    transpose (a transposing copy took several ms on 512 channels)."""
    k, c = w.shape[0], w.shape[1]
    for dy in range(3):
        base = dy * 3 * k * c
        if flipped:
            for kk in range(k):
                for dx in range(3):
                    for cc in range(c):
                        out[base + (3 * kk + dx) * c + cc] = w[kk, cc, 2 - dy, 2 - dx]
        else:
            for kk in range(k):
                for cc in range(c):
                    for dx in range(3):
                        out[base + kk * 3 * c + 3 * cc + dx] = w[kk, cc, dy, dx]


@njit(cache=True, nogil=True)
def _forward_images(x, filters, out, flipped, first, last, tile, mine):
    """Images [first, last) on the calling thread: pack, three GEMMs, copy out (stacked tiles only)."""
    c_in, height, width = x.shape[1], x.shape[2], x.shape[3]
    c_out = out.shape[1]
    plane = height * width
    row = (tile * (height + 1) + 1) * width
    m = ((tile - 1) * (height + 1) + height) * width
    depth = 3 * c_in
    src, dst = x.reshape(x.size), out.reshape(out.size)
    packed = mine[: 3 * c_in * row]
    scalars = np.empty(2, np.float32)
    for n0 in range(first, last, tile):
        images = min(tile, last - n0)
        cols = ((images - 1) * (height + 1) + height) * width
        _pack(src, n0, images, c_in, height, width, row, packed)
        if tile == 1:
            target, ld = dst[n0 * c_out * plane :], plane
        else:
            target, ld = mine[3 * c_in * row :], m
        for dy in range(3):
            sgemm(
                flipped,
                False,
                c_out,
                cols,
                depth,
                filters[dy * depth * c_out :],
                c_out if flipped else depth,
                packed[dy * width :],
                row,
                0.0 if dy == 0 else 1.0,
                target,
                ld,
                scalars,
            )
        if tile > 1:
            for kk in range(c_out):
                for i in range(images):
                    s0 = uint64(kk * m + i * (height + 1) * width)
                    d0 = uint64(((n0 + i) * c_out + kk) * plane)
                    for q in range(plane):
                        dst[d0 + uint64(q)] = target[s0 + uint64(q)]


def forward(x, w, out, flipped: bool, threads: int, tile: int, scratch) -> None:
    """out = conv3×3(x, w), stride 1, pad 1, as three GEMMs of depth 3·C per tile (flipped: backward-data)."""
    c_in, height, width = x.shape[1], x.shape[2], x.shape[3]
    c_out = out.shape[1]
    row = (tile * (height + 1) + 1) * width
    m = ((tile - 1) * (height + 1) + height) * width
    filters = scratch[: 9 * c_in * c_out]
    _filters(w, flipped, filters)
    per_thread = 3 * c_in * row + (c_out * m if tile > 1 else 0)
    start, n = 9 * c_in * c_out, x.shape[0]

    def work(t: int) -> None:
        mine = scratch[start + t * per_thread : start + (t + 1) * per_thread]
        _forward_images(x, filters, out, flipped, t * n // threads, (t + 1) * n // threads, tile, mine)

    run_shares(work, threads)


@njit(cache=True, nogil=True)
def _backward_weight_images(x, dout, first, last, tile, mine, acc):
    """acc[dy][K, 3C] = Σ over images [first, last) of D @ P3 shifted by dy rows, transposed."""
    c_in, height, width = x.shape[1], x.shape[2], x.shape[3]
    c_out = dout.shape[1]
    plane = height * width
    row = (tile * (height + 1) + 1) * width
    m = ((tile - 1) * (height + 1) + height) * width
    depth = 3 * c_in
    src, grad = x.reshape(x.size), dout.reshape(dout.size)
    packed = mine[: 3 * c_in * row]
    scalars = np.empty(2, np.float32)
    if first >= last:
        acc[:] = 0.0
    for n0 in range(first, last, tile):
        images = min(tile, last - n0)
        cols = ((images - 1) * (height + 1) + height) * width
        _pack(src, n0, images, c_in, height, width, row, packed)
        if tile == 1:
            d, ld = grad[n0 * c_out * plane :], plane
        else:
            d, ld = mine[3 * c_in * row :], m
            for kk in range(c_out):
                for i in range(images):
                    d0 = uint64(kk * m + i * (height + 1) * width)
                    s0 = uint64(((n0 + i) * c_out + kk) * plane)
                    for q in range(plane):
                        d[d0 + uint64(q)] = grad[s0 + uint64(q)]
                    if i < images - 1:
                        for q in range(plane, plane + width):
                            d[d0 + uint64(q)] = 0.0
        for dy in range(3):
            sgemm(
                False,
                True,
                c_out,
                depth,
                cols,
                d,
                ld,
                packed[dy * width :],
                row,
                0.0 if n0 == first else 1.0,
                acc[dy * depth * c_out :],
                depth,
                scalars,
            )


@njit(cache=True, nogil=True)
def _collect(sums, threads, dw, k_lo, k_hi):
    """dw[k, c, dy, dx] = Σ_t sums[t][dy][k, 3c + dx] in thread order, for k in [k_lo, k_hi)."""
    k, c = dw.shape[0], dw.shape[1]
    depth = 3 * c
    filters = 9 * k * c
    for kk in range(k_lo, k_hi):
        for cc in range(c):
            for dy in range(3):
                for dx in range(3):
                    at = dy * depth * k + kk * depth + 3 * cc + dx
                    total = sums[at]
                    for t in range(1, threads):
                        total += sums[t * filters + at]
                    dw[kk, cc, dy, dx] = total


def backward_weight(x, dout, dw, threads: int, tile: int, scratch) -> None:
    """dw[k, c, dy, dx]: three GEMMs dW_dy[K, 3C] += D[K, grid] @ P3[3C, grid + dy·W]ᵀ per tile; each
    thread sums its images into its own partial, and the partials are added in thread order."""
    n, c_in, height, width = x.shape
    c_out = dout.shape[1]
    row = (tile * (height + 1) + 1) * width
    m = ((tile - 1) * (height + 1) + height) * width
    filters = 9 * c_in * c_out
    per_thread = 3 * c_in * row + (c_out * m if tile > 1 else 0)
    sums = scratch[threads * per_thread : threads * per_thread + threads * filters]

    def work(t: int) -> None:
        mine = scratch[t * per_thread : (t + 1) * per_thread]
        acc = sums[t * filters : (t + 1) * filters]
        _backward_weight_images(x, dout, t * n // threads, (t + 1) * n // threads, tile, mine, acc)

    run_shares(work, threads)
    run_shares(lambda t: _collect(sums, threads, dw, t * c_out // threads, (t + 1) * c_out // threads), threads)

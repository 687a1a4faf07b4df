"""2-D convolution on the GPU: implicit GEMM over the whole batch, and direct kernels for depthwise.

Two paths, picked from the shapes:

- depthwise-style (one input channel per group, groups > 1): direct kernels, one thread per output
  (forward), per input gradient (backward data) and one block per weight (backward weight). A
  GEMM with one input channel per group would be a GEMM with K = R·S = 9: all launch, no work.
- everything else: one GEMM launch per direction for the whole batch and every group (the group is
  ``blockIdx.z``), with operands that index the tensors directly (implicit GEMM):

  | direction | M | N | K | A | B | C |
  |---|---|---|---|---|---|---|
  | forward | K/g | N·OH·OW | C/g·R·S | w | x read as its im2col columns | out, NCHW |
  | backward data | C/g | N·⌈H/st⌉·⌈W/st⌉ | K/g·⌈R/st⌉·⌈S/st⌉ | w, the phase's taps | dout gathered (col2im folded in) | dx, NCHW |
  | backward weight | K/g | C/g·R·S | N·OH·OW | dout | x's columns, transposed | dw (or split-K partials) |

  The images are folded into the GEMM's N (forward, data) or K (weight) dimension, so a 64-channel
  32×32 layer at batch 32 is 512 blocks of v3's 64×64 tile, not 16 per image. Backward data
  *gathers*: each dx element is one GEMM output summing, over (k, r, s), the dout entries whose
  windows read it, so it needs neither a column buffer nor atomics. At stride st, the dx pixels
  fall into st² phases (h mod st, w mod st), each read only through the taps r ≡ h + pad (mod st):
  one launch covers every phase (grid z = groups·st²), each a dense GEMM over its own taps. Gathering
  over all R·S taps instead multiplied zeros for 3 of 4 taps at stride 2: ResNet-18's backward data
  was 47.5 GFLOP a step at batch 32 against forward's 35.5 (roofline, kernels/README.md).

Why: the per-image version launched im2col and the GEMM once per image and group (ResNet-18 at
batch 32: 3,876 launches a training step, each tens of µs of host time with CuPy arrays, and 16
blocks per GEMM on a 64-channel 32×32 layer). Counted the same way after this change (see
engine/bench/cuda_launches.py) it is 174 (MobileNetV2: 3,649 → 388), and the 75 MB column
buffer of ResNet-18's largest layer at batch 32 is gone.

Weight gradients reduce over N·OH·OW (32,768 products for the first layers at batch 32) into a small
dw (64×576: 9 tiles of 64×64): unsplit, that GEMM would leave most of a GPU idle, so the k range is
cut into fixed chunks (grid z), each writing a partial dw to scratch, and ``sum_splits`` adds them in
split order. Deep layers' forward and backward data split the same way (512→512 on 4×4 at batch 32 is
64 output tiles for 132 SMs): ``split_rule`` decides from the shapes, the GEMM table may override it
per shape (measured), and the split's partials are [splits·N, ...] copies of the output's layout.
The split count depends only on the shapes and the table, so the sum's rounding is the same on every
run; no path uses atomics. Scratch: splits × the direction's output, else none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from numba import cuda, float32

from kernels.cuda._launch import (  # the integer casts: numba's on a GPU, exact Python ints in the simulator
    MAX_REDUCTION_THREADS,
    THREADS_PER_BLOCK,
    blocks_for,
    check_scratch,
    int64,
    launch,
    pair_shape,
    reduction_threads,
    uint32,
    uint64,
)
from kernels.cuda.channels import add_bias, sum_channels
from kernels.cuda.gemm import choose, compose_operands
from kernels.cuda.reduce import block_sum

# --- implicit-GEMM operands --------------------------------------------------------------------------
# geom = (Cg, H, W, Kg, OH, OW, R, S, stride, pad, phases, splits);
# z = blockIdx.z = (group · phases + phase) · splits + split. Phases are backward data's stride² (1 otherwise).
# Each operand comes in the tile family's split form (gemm.Operands): ``prep`` decodes the fixed row or
# column of a thread once, ``at`` the per-k rest.


@cuda.jit(device=True)
def _divider(d):
    """(m, p) with n // d == (n·m) >> p for every 0 <= n < 2**31, given 1 <= d < 2**31.

    Division by an invariant integer as a multiply and a shift (Granlund & Montgomery 1994, CUTLASS's
    FastDivmod): l = ceil(log2 d), p = 31 + l, m = ceil(2**p / d) < 2**32. The per-k loads below divide
    every k by a few sizes fixed for the launch (R·S, S, OH·OW, OW, the stride); numba's int64 floor
    division was ptxas's 64-bit division subroutine there (40 calls a k-slab in 128×128 backward data),
    a 32-bit one still ~20 instructions; ``_fdiv`` is a wide multiply and a shift. The prep functions
    compute the pairs once per thread, outside the k loop."""
    l = 32 - cuda.clz(uint32(d - 1))
    p = uint64(31 + l)
    return uint32(((uint64(1) << p) + uint64(d - 1)) // uint64(d)), p  # m < 2**32: a 32×32-bit wide multiply


@cuda.jit(device=True)
def _fdiv(n, m, p):
    """n // d for 0 <= n < 2**31, with (m, p) = _divider(d)."""
    return int64((uint64(uint32(n)) * uint64(m)) >> p)


@cuda.jit(device=True)
def _z_parts(z, geom):
    """(group, phase, split) of a launch's blockIdx.z."""
    splits = geom[11]
    zz = z // splits
    group = zz // geom[10]
    return group, zz - group * geom[10], z - zz * splits


@cuda.jit(device=True)
def _forward_prep_a(w2, i, z, geom):
    group, phase, split = _z_parts(z, geom)
    return (group * geom[3] + i, 0, 0, 0, 0, 0)


@cuda.jit(device=True)
def _row_at(w2, prep, k, z, geom):
    return w2[uint32(prep[0]), uint32(k)]  # unsigned indices: no wraparound test (neither is negative)


@cuda.jit(device=True)
def _forward_prep_b(x, j, z, geom):
    """Column j = n·OH·OW + oh·OW + ow of the im2col matrix: (n, first channel, oh·stride − pad, ow·stride − pad),
    and the dividers of k by R·S and by S."""
    OH, OW, stride, pad = geom[4], geom[5], geom[8], geom[9]
    group, phase, split = _z_parts(z, geom)
    P = OH * OW
    n = j // P
    p = j - n * P
    oh = p // OW
    ow = p - oh * OW
    m_rs, p_rs = _divider(geom[6] * geom[7])
    m_s, p_s = _divider(geom[7])
    return (n, group * geom[0], oh * stride - pad, ow * stride - pad, m_rs, p_rs, m_s, p_s)


@cuda.jit(device=True)
def _forward_b_at(x, prep, k, z, geom):
    """Entry (k, column) of the im2col matrix: k = (c·R + r)·S + s; 0 in the padding."""
    R, S = geom[6], geom[7]
    c = _fdiv(k, prep[4], prep[5])
    rs = k - c * (R * S)
    r = _fdiv(rs, prep[6], prep[7])
    h = prep[2] + r
    w = prep[3] + rs - r * S
    if uint32(h) < uint32(geom[1]) and uint32(w) < uint32(geom[2]):  # 0 <= h < H: a negative h wraps past H
        # unsigned indices: no wraparound test (all are >= 0 here)
        return x[uint32(prep[0]), uint32(prep[1] + c), uint32(h), uint32(w)]
    return float32(0.0)


@cuda.jit(device=True)
def _forward_store(out3, i, j, z, geom, value, accumulate):
    """out3 is [splits·N, K, OH·OW]: split s writes images s·N ... (with one split, out itself)."""
    group, phase, split = _z_parts(z, geom)
    P = geom[4] * geom[5]
    n = j // P
    out3[split * (out3.shape[0] // geom[11]) + n, group * geom[3] + i, j - n * P] = value


@cuda.jit(device=True)
def _phase_offsets(z, geom):
    """(group, ph, pw, r0, s0) of backward data's z: the phase's pixel offsets and its first taps
    r0 = (ph + pad) mod stride, s0 likewise, the only taps (with steps of stride) that reach it."""
    stride, pad = geom[8], geom[9]
    group, phase, split = _z_parts(z, geom)
    ph = phase // stride
    pw = phase - ph * stride
    return group, ph, pw, (ph + pad) % stride, (pw + pad) % stride


@cuda.jit(device=True)
def _phase_pixel(j, ph, pw, geom):
    """(n, h, w) of backward data's column j: pixel (ph + stride·hh, pw + stride·ww) of image n (h, w may
    fall past H, W on the last row or column of a phase)."""
    H, W, stride = geom[1], geom[2], geom[8]
    HP = (H + stride - 1) // stride
    WP = (W + stride - 1) // stride
    n = j // (HP * WP)
    q = j - n * (HP * WP)
    hh = q // WP
    return n, ph + stride * hh, pw + stride * (q - hh * WP)


@cuda.jit(device=True)
def _phase_taps(geom):
    """A phase's taps per channel TR·TS and per row TS, with their dividers (once per thread)."""
    R, S, stride = geom[6], geom[7], geom[8]
    TS = (S + stride - 1) // stride
    taps = ((R + stride - 1) // stride) * TS
    m_taps, p_taps = _divider(taps)
    m_ts, p_ts = _divider(TS)
    return taps, TS, m_taps, p_taps, m_ts, p_ts


@cuda.jit(device=True)
def _phase_tap(k, r0, s0, stride, taps, TS, m_taps, p_taps, m_ts, p_ts):
    """(kk, r, s) of backward data's reduction index k = (kk, rr, ss): output channel kk and tap
    r = r0 + stride·rr, s = s0 + stride·ss (r, s may fall past R, S)."""
    kk = _fdiv(k, m_taps, p_taps)
    t = k - kk * taps
    rr = _fdiv(t, m_ts, p_ts)
    return kk, r0 + stride * rr, s0 + stride * (t - rr * TS)


@cuda.jit(device=True)
def _data_prep_a(w2, i, z, geom):
    group, ph, pw, r0, s0 = _phase_offsets(z, geom)
    taps, TS, m_taps, p_taps, m_ts, p_ts = _phase_taps(geom)
    return (i, group * geom[3], r0, s0, taps, TS, m_taps, p_taps, m_ts, p_ts)


@cuda.jit(device=True)
def _data_a_at(w2, prep, k, z, geom):
    """A[c, (k, rr, ss)] = w[group·Kg + k, c, r, s] with r = r0 + stride·rr, s = s0 + stride·ss (0 past R, S)."""
    R, S = geom[6], geom[7]
    kk, r, s = _phase_tap(k, prep[2], prep[3], geom[8], prep[4], prep[5], prep[6], prep[7], prep[8], prep[9])
    if uint32(r) < uint32(R) and uint32(s) < uint32(S):  # never negative: one 32-bit test each
        return w2[uint32(prep[1] + kk), uint32((prep[0] * R + r) * S + s)]
    return float32(0.0)


@cuda.jit(device=True)
def _data_prep_b(dout, j, z, geom):
    group, ph, pw, r0, s0 = _phase_offsets(z, geom)
    n, h, w = _phase_pixel(j, ph, pw, geom)
    taps, TS, m_taps, p_taps, m_ts, p_ts = _phase_taps(geom)
    m_st, p_st = _divider(geom[8])
    return (n, h, w, group * geom[3], r0, s0, taps, TS, m_taps, p_taps, m_ts, p_ts, m_st, p_st)


@cuda.jit(device=True)
def _data_b_at(dout, prep, k, z, geom):
    """B[(k, rr, ss), (n, hh, ww)] = dout[n, group·Kg + k, oh, ow] where dx pixel (h, w) is read by output
    (oh, ow) through tap (r, s); 0 where no output reads it."""
    OH, OW, R, S, stride, pad = geom[4], geom[5], geom[6], geom[7], geom[8], geom[9]
    h, w = prep[1], prep[2]
    kk, r, s = _phase_tap(k, prep[4], prep[5], stride, prep[6], prep[7], prep[8], prep[9], prep[10], prep[11])
    # 32-bit unsigned tests (h, w, r, s are never negative); 0 <= th and th // stride < OH is th < OH·stride.
    if uint32(h) < uint32(geom[1]) and uint32(w) < uint32(geom[2]) and uint32(r) < uint32(R) and uint32(s) < uint32(S):
        th = h + pad - r  # a multiple of stride: r ≡ h + pad (mod stride) by the choice of r0
        tw = w + pad - s
        if uint32(th) < uint32(OH * stride) and uint32(tw) < uint32(OW * stride):
            oh = _fdiv(th, prep[12], prep[13])
            ow = _fdiv(tw, prep[12], prep[13])
            return dout[uint32(prep[0]), uint32(prep[3] + kk), uint32(oh), uint32(ow)]
    return float32(0.0)


@cuda.jit(device=True)
def _data_store(dx3, i, j, z, geom, value, accumulate):
    """dx3 is [splits·N, C, H·W]: split s writes images s·N ... (with one split, dx itself)."""
    W = geom[2]
    group, ph, pw, r0, s0 = _phase_offsets(z, geom)
    n, h, w = _phase_pixel(j, ph, pw, geom)
    if h < geom[1] and w < W:
        split = z - (z // geom[11]) * geom[11]
        dx3[split * (dx3.shape[0] // geom[11]) + n, group * geom[0] + i, h * W + w] = value


@cuda.jit(device=True)
def _weight_prep_a(dout3, i, z, geom):
    group, phase, split = _z_parts(z, geom)
    m_p, p_p = _divider(geom[4] * geom[5])
    return (group * geom[3] + i, m_p, p_p)


@cuda.jit(device=True)
def _weight_a_at(dout3, prep, k, z, geom):
    """A[k_out, (n, p)] = dout[n, group·Kg + k_out, p]."""
    n = _fdiv(k, prep[1], prep[2])
    return dout3[uint32(n), uint32(prep[0]), uint32(k - n * (geom[4] * geom[5]))]


@cuda.jit(device=True)
def _weight_prep_b(x, j, z, geom):
    """Column j = (c·R + r)·S + s of dw: (input channel, r − pad, s − pad), and the dividers of k by OH·OW
    and by OW."""
    R, S, pad = geom[6], geom[7], geom[9]
    group, phase, split = _z_parts(z, geom)
    c = j // (R * S)
    rs = j - c * (R * S)
    r = rs // S
    m_p, p_p = _divider(geom[4] * geom[5])
    m_ow, p_ow = _divider(geom[5])
    return (group * geom[0] + c, r - pad, rs - r * S - pad, m_p, p_p, m_ow, p_ow)


@cuda.jit(device=True)
def _weight_b_at(x, prep, k, z, geom):
    """B[(n, oh, ow), (c, r, s)] = x[n, c, oh·stride − pad + r, ow·stride − pad + s] or 0."""
    OH, OW, stride = geom[4], geom[5], geom[8]
    P = OH * OW
    n = _fdiv(k, prep[3], prep[4])
    p = k - n * P
    oh = _fdiv(p, prep[5], prep[6])
    h = oh * stride + prep[1]
    w = (p - oh * OW) * stride + prep[2]
    if uint32(h) < uint32(geom[1]) and uint32(w) < uint32(geom[2]):  # 0 <= h < H in one unsigned test
        return x[uint32(n), uint32(prep[0]), uint32(h), uint32(w)]
    return float32(0.0)


@cuda.jit(device=True)
def _weight_store(partial3, i, j, z, geom, value, accumulate):
    """Split s of group g writes partial3[s, g·Kg + i, j] (with one split partial3 is dw itself, [1, K, Cg·R·S])."""
    group, phase, split = _z_parts(z, geom)
    partial3[split, group * geom[3] + i, j] = value


CONV_FORWARD = compose_operands("conv_forward", _forward_prep_a, _row_at, _forward_prep_b, _forward_b_at,
                                _forward_store)
CONV_BACKWARD_DATA = compose_operands("conv_backward_data", _data_prep_a, _data_a_at, _data_prep_b, _data_b_at,
                                      _data_store)
CONV_BACKWARD_WEIGHT = compose_operands("conv_backward_weight", _weight_prep_a, _weight_a_at, _weight_prep_b,
                                        _weight_b_at, _weight_store)
OPERANDS = (CONV_FORWARD, CONV_BACKWARD_DATA, CONV_BACKWARD_WEIGHT)


@cuda.jit
def sum_splits(partial, out):
    """out[e] = Σ_s partial[s, e], splits added in order s = 0, 1, ...: the split-K weight gradient's last step."""
    e = cuda.grid(1)
    if e < out.size:
        acc = partial[0, e]
        for s in range(1, partial.shape[0]):
            acc += partial[s, e]
        out[e] = acc


# --- direct kernels (depthwise and other one-channel-per-group convolutions) ------------------------


@cuda.jit
def direct_conv_forward(x, w, out, stride, pad, groups):
    """out[n, k, oh, ow] = Σ_{c in k's group, r, s} w[k, c, r, s] · x[n, c, oh·stride − pad + r, ...]."""
    e = cuda.grid(1)
    N, K, OH, OW = out.shape
    Cg = w.shape[1]
    R = w.shape[2]
    S = w.shape[3]
    if e < N * K * OH * OW:
        n = e // (K * OH * OW)
        rest = e - n * (K * OH * OW)
        k = rest // (OH * OW)
        p = rest - k * (OH * OW)
        oh = p // OW
        ow = p - oh * OW
        c0 = (k // (K // groups)) * Cg
        acc = float32(0.0)
        for c in range(Cg):
            for r in range(R):
                h = oh * stride - pad + r
                if 0 <= h < x.shape[2]:
                    for s in range(S):
                        ww = ow * stride - pad + s
                        if 0 <= ww < x.shape[3]:
                            acc += w[k, c, r, s] * x[n, c0 + c, h, ww]
        out[n, k, oh, ow] = acc


@cuda.jit
def direct_conv_backward_data(dout, w, dx, stride, pad, groups):
    """dx[n, c, h, w] = Σ over the outputs whose windows read (h, w): one thread per dx element."""
    e = cuda.grid(1)
    N, C, H, W = dx.shape
    K = dout.shape[1]
    OH = dout.shape[2]
    OW = dout.shape[3]
    Cg = w.shape[1]
    R = w.shape[2]
    S = w.shape[3]
    Kg = K // groups
    if e < N * C * H * W:
        n = e // (C * H * W)
        rest = e - n * (C * H * W)
        c = rest // (H * W)
        hw = rest - c * (H * W)
        h = hw // W
        ww = hw - h * W
        g = c // Cg
        ci = c - g * Cg
        acc = float32(0.0)
        for k in range(g * Kg, (g + 1) * Kg):
            for r in range(R):
                th = h + pad - r
                if th >= 0 and th % stride == 0 and th // stride < OH:
                    oh = th // stride
                    for s in range(S):
                        tw = ww + pad - s
                        if tw >= 0 and tw % stride == 0 and tw // stride < OW:
                            acc += dout[n, k, oh, tw // stride] * w[k, ci, r, s]
        dx[n, c, h, ww] = acc


@cuda.jit
def direct_conv_backward_weight(x, dout, dw, stride, pad, groups):
    """dw[k, c, r, s] = Σ_{n, oh, ow} dout[n, k, oh, ow] · x[n, c0 + c, ...]: one block per weight."""
    partial = cuda.shared.array(shape=MAX_REDUCTION_THREADS, dtype=float32)
    K, Cg, R, S = dw.shape
    weight = cuda.blockIdx.x
    k = weight // (Cg * R * S)
    crs = weight - k * (Cg * R * S)
    c = crs // (R * S)
    rs = crs - c * (R * S)
    r = rs // S
    s = rs - r * S
    c_in = (k // (K // groups)) * Cg + c
    N = dout.shape[0]
    OH = dout.shape[2]
    OW = dout.shape[3]
    tid = cuda.threadIdx.x
    threads = cuda.blockDim.x
    acc = float32(0.0)
    for e in range(tid, N * OH * OW, threads):
        n = e // (OH * OW)
        p = e - n * (OH * OW)
        oh = p // OW
        ow = p - oh * OW
        h = oh * stride - pad + r
        ww = ow * stride - pad + s
        if 0 <= h < x.shape[2] and 0 <= ww < x.shape[3]:
            acc += dout[n, k, oh, ow] * x[n, c_in, h, ww]
    total = block_sum(partial, acc)
    if tid == 0:
        dw[k, c, r, s] = total


# --- host side ---------------------------------------------------------------------------------------

SPLIT_TARGET_BLOCKS = 264
"""Blocks a split GEMM aims for: two per SM of an H100 SXM (132 SMs), more than an A100's 108.
Reasoned, not measured: the tile search (benchmarks/gpu_tile_search.py) writes measured split counts
into the table, which overrides this rule shape by shape."""
SPLIT_MIN_K = 1024
"""Fewest products per split: a split's partial result is written and read back once, so it must carry
work (1,024 FMAs per output against one extra write and read). Reasoned, not measured."""
SPLIT_TILE = 64
"""The C tile the split rule assumes (v3's 64×64), fixed so scratch sizes do not depend on the tile chosen."""
SPLIT_K_ALIGN = 8
"""Chunks are whole multiples of 8 (the common k-slab), so no slab of an 8-deep tile straddles two splits."""


def split_rule(M: int, N: int, K: int, z: int) -> int:
    """How many k-splits a GEMM gets when the table names none: enough blocks for the GPU, never a split
    under SPLIT_MIN_K products. Deep layers (512→512 on 4×4 at batch 32: 64 tiles of 64×64, K = 4,608)
    split 4 ways; ResNet-18's first layers (512 tiles) not at all."""
    tiles = -(-M // SPLIT_TILE) * -(-N // SPLIT_TILE) * z
    return max(1, min(K // SPLIT_MIN_K, -(-SPLIT_TARGET_BLOCKS // tiles)))


def split_chunk(K: int, splits: int) -> tuple[int, int]:
    """(splits, k_chunk) for ``splits`` wanted: chunks aligned to SPLIT_K_ALIGN, so the count may drop."""
    if splits <= 1:
        return 1, max(1, K)
    chunk = -(-K // splits)
    chunk = -(-chunk // SPLIT_K_ALIGN) * SPLIT_K_ALIGN
    return -(-K // chunk), chunk


@dataclass(frozen=True)
class GemmShape:
    """One direction's implicit GEMM: sizes, grid depth (groups × phases), the choice and its k-chunks."""

    op: str
    M: int
    N: int
    K: int
    z: int  # groups × phases, before the splits
    phases: int
    choice: Any
    splits: int
    k_chunk: int


@dataclass(frozen=True)
class ConvGeometry:
    """Every size a convolution launch needs, checked once."""

    N: int
    C: int
    H: int
    W: int
    K: int
    Cg: int
    R: int
    S: int
    OH: int
    OW: int
    stride: int
    pad: int
    groups: int

    @property
    def Kg(self) -> int:
        return self.K // self.groups

    @property
    def direct(self) -> bool:
        return self.Cg == 1 and self.groups > 1

    @property
    def columns(self) -> int:
        """Rows of the im2col matrix of one group: Cg·R·S."""
        return self.Cg * self.R * self.S

    def geom(self, phases: int = 1, splits: int = 1) -> tuple[int, ...]:
        """The ``geom`` tuple the implicit-GEMM operands read (order fixed by the device functions)."""
        return (self.Cg, self.H, self.W, self.Kg, self.OH, self.OW, self.R, self.S, self.stride, self.pad, phases,
                splits)

    def gemm(self, direction: str) -> GemmShape:
        """The GEMM of one direction ("forward", "data", "weight"), with the table's or the rule's split."""
        st = self.stride
        if direction == "forward":
            op, M, N, K, phases = CONV_FORWARD.name, self.Kg, self.N * self.OH * self.OW, self.columns, 1
        elif direction == "data":
            op, M, phases = CONV_BACKWARD_DATA.name, self.Cg, st * st
            N = self.N * -(-self.H // st) * -(-self.W // st)
            K = self.Kg * -(-self.R // st) * -(-self.S // st)
        else:
            op, M, N, K, phases = CONV_BACKWARD_WEIGHT.name, self.Kg, self.columns, self.N * self.OH * self.OW, 1
        z = self.groups * phases
        choice = choose(op, M, N, K, z, split_rule(M, N, K, z))
        splits, chunk = split_chunk(K, 1 if self.direct else choice.splits)
        return GemmShape(op, M, N, K, z, phases, choice, splits, chunk)

    @property
    def weight_splits(self) -> tuple[int, int]:
        """(splits, k_chunk) of the weight gradient's GEMM over K = N·OH·OW; (1, K) when not split."""
        shape = self.gemm("weight")
        return shape.splits, shape.k_chunk

    def scratch_size(self, direction: str) -> int:
        """Floats of one direction's split-K partial results (0 when its GEMM is not split)."""
        if self.direct:
            return 0
        splits = self.gemm(direction).splits
        if splits == 1:
            return 0
        output = {"forward": self.N * self.K * self.OH * self.OW, "data": self.N * self.C * self.H * self.W,
                  "weight": self.K * self.columns}[direction]
        return splits * output

    @property
    def weight_scratch_size(self) -> int:
        return self.scratch_size("weight")


def conv_geometry(x_shape: Any, w_shape: Any, stride: Any, pad: Any, groups: int) -> ConvGeometry:
    """Check the shapes against each other and return the sizes; errors say what to fix."""
    stride = pair_shape(stride, "stride")
    pad = pair_shape(pad, "pad")
    groups = int(groups)
    if len(x_shape) != 4 or len(w_shape) != 4:
        raise ValueError(f"conv2d: x {tuple(x_shape)} and w {tuple(w_shape)} must both be 4-D (NCHW, KCRS)")
    N, C, H, W = (int(v) for v in x_shape)
    K, Cg, R, S = (int(v) for v in w_shape)
    if groups < 1 or C % groups or K % groups:
        raise ValueError(f"conv2d: groups={groups} must divide input channels {C} and output channels {K}")
    if Cg != C // groups:
        raise ValueError(f"conv2d: w has {Cg} input channels per group, x has {C} channels / {groups} groups")
    if stride < 1 or pad < 0:
        raise ValueError(f"conv2d: stride {stride} must be >= 1 and pad {pad} >= 0")
    OH = (H + 2 * pad - R) // stride + 1
    OW = (W + 2 * pad - S) // stride + 1
    if OH < 1 or OW < 1:
        raise ValueError(f"conv2d: a {R}x{S} kernel does not fit a {H}x{W} input with pad {pad}")
    return ConvGeometry(N, C, H, W, K, Cg, R, S, OH, OW, stride, pad, groups)


def _check_output(name: str, array: Any, shape: tuple[int, ...]) -> None:
    if tuple(array.shape) != shape:
        raise ValueError(f"conv2d: {name} has shape {tuple(array.shape)}, expected {shape}")


def conv2d_forward_workspace_size(x_shape: Any, w_shape: Any, stride: Any, pad: Any, groups: int) -> int:
    """0 unless the forward GEMM is split along K (deep layers): then the partial outputs."""
    return conv_geometry(x_shape, w_shape, stride, pad, groups).scratch_size("forward")


def conv2d_backward_data_workspace_size(x_shape: Any, w_shape: Any, stride: Any, pad: Any, groups: int) -> int:
    """0 unless the backward-data GEMM is split along K: then the partial dx."""
    return conv_geometry(x_shape, w_shape, stride, pad, groups).scratch_size("data")


def conv2d_backward_weight_workspace_size(x_shape: Any, w_shape: Any, stride: Any, pad: Any, groups: int) -> int:
    return conv_geometry(x_shape, w_shape, stride, pad, groups).scratch_size("weight")


def _run_gemm(g: ConvGeometry, direction: str, operands: Any, A: Any, B: Any, out: Any, scratch: Any,
              op_name: str) -> None:
    """One direction's GEMM; split along K, into scratch, then ``sum_splits`` adds the splits in order.

    ``out`` is the direction's output as the store expects it with one split ([N, K, P], [N, C, H·W] or
    [1, K, Cg·R·S]); a split launch writes [splits·N, ...] (or [splits, ...]) partials of the same layout."""
    shape = g.gemm(direction)
    target = out
    if shape.splits > 1:
        flat = check_scratch(scratch, g.scratch_size(direction), op_name)
        target = flat.reshape((shape.splits * out.shape[0],) + tuple(out.shape[1:]))
    shape.choice.version.run(operands, A, B, target, shape.M, shape.N, shape.K, g.geom(shape.phases, shape.splits),
                             z=shape.z * shape.splits, k_chunk=shape.k_chunk)
    if shape.splits > 1:
        launch(sum_splits, blocks_for(out.size), THREADS_PER_BLOCK, target.reshape(shape.splits, -1),
               out.reshape(-1))


def conv2d_forward(x: Any, w: Any, bias: Any, out: Any, stride: Any, pad: Any, groups: int, scratch: Any = None) -> None:
    g = conv_geometry(x.shape, w.shape, stride, pad, groups)
    _check_output("out", out, (g.N, g.K, g.OH, g.OW))
    if g.direct:
        launch(direct_conv_forward, blocks_for(out.size), THREADS_PER_BLOCK, x, w, out, g.stride, g.pad, g.groups)
    else:
        _run_gemm(g, "forward", CONV_FORWARD, w.reshape(g.K, g.columns), x, out.reshape(g.N, g.K, g.OH * g.OW),
                  scratch, "conv2d_forward")
    if bias is not None:
        add_bias(out.reshape(g.N, g.K, g.OH * g.OW), bias)


def conv2d_backward_data(dout: Any, w: Any, dx: Any, stride: Any, pad: Any, groups: int, scratch: Any = None) -> None:
    g = conv_geometry(dx.shape, w.shape, stride, pad, groups)
    _check_output("dout", dout, (g.N, g.K, g.OH, g.OW))
    if g.direct:
        launch(direct_conv_backward_data, blocks_for(dx.size), THREADS_PER_BLOCK, dout, w, dx, g.stride, g.pad, g.groups)
        return
    _run_gemm(g, "data", CONV_BACKWARD_DATA, w.reshape(g.K, g.columns), dout, dx.reshape(g.N, g.C, g.H * g.W),
              scratch, "conv2d_backward_data")


def conv2d_backward_weight(
    x: Any, dout: Any, dw: Any, dbias: Any, stride: Any, pad: Any, groups: int, scratch: Any = None
) -> None:
    g = conv_geometry(x.shape, dw.shape, stride, pad, groups)
    _check_output("dout", dout, (g.N, g.K, g.OH, g.OW))
    if g.direct:
        threads = reduction_threads(g.N * g.OH * g.OW)  # one block per weight
        launch(direct_conv_backward_weight, dw.size, threads, x, dout, dw, g.stride, g.pad, g.groups)
    else:
        _run_gemm(g, "weight", CONV_BACKWARD_WEIGHT, dout.reshape(g.N, g.K, g.OH * g.OW), x,
                  dw.reshape(1, g.K, g.columns), scratch, "conv2d_backward_weight")
    if dbias is not None:
        sum_channels(dout.reshape(g.N, g.K, g.OH * g.OW), dbias)

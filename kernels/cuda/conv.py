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
cut into ``weight_splits`` fixed chunks (grid z), each writing a partial dw to scratch, and
``sum_splits`` adds them in split order. The split count depends only on the shapes, so the sum's
rounding is the same on every run; no path uses atomics. Scratch: ``splits·K·C/g·R·S`` floats for
a split weight gradient, else none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from numba import cuda, float32

from kernels.cuda._launch import (
    MAX_REDUCTION_THREADS,
    THREADS_PER_BLOCK,
    blocks_for,
    check_scratch,
    launch,
    pair_shape,
    reduction_threads,
)
from kernels.cuda.channels import add_bias, sum_channels
from kernels.cuda.gemm import Operands, active_gemm
from kernels.cuda.reduce import block_sum

# --- implicit-GEMM operands --------------------------------------------------------------------------
# geom = (Cg, H, W, Kg, OH, OW, R, S, stride, pad, splits); z = blockIdx.z = group · splits + split.
# Backward data puts stride² (its phases) where the weight gradient puts its splits.


@cuda.jit(device=True)
def _column(x, row, col, group, geom):
    """Entry (row, col) of the group's im2col matrix: x[n, c, oh·stride − pad + r, ow·stride − pad + s] or 0.

    row = (c·R + r)·S + s, col = n·OH·OW + oh·OW + ow.
    """
    Cg, H, W = geom[0], geom[1], geom[2]
    OH, OW, R, S, stride, pad = geom[4], geom[5], geom[6], geom[7], geom[8], geom[9]
    P = OH * OW
    n = col // P
    p = col - n * P
    oh = p // OW
    ow = p - oh * OW
    c = row // (R * S)
    rs = row - c * (R * S)
    r = rs // S
    s = rs - r * S
    h = oh * stride - pad + r
    w = ow * stride - pad + s
    if 0 <= h < H and 0 <= w < W:
        return x[n, group * Cg + c, h, w]
    return float32(0.0)


@cuda.jit(device=True)
def _forward_a(w2, i, k, z, geom):
    return w2[(z // geom[10]) * geom[3] + i, k]


@cuda.jit(device=True)
def _forward_b(x, k, j, z, geom):
    return _column(x, k, j, z // geom[10], geom)


@cuda.jit(device=True)
def _forward_store(out3, i, j, z, geom, value, accumulate):
    P = geom[4] * geom[5]
    n = j // P
    out3[n, (z // geom[10]) * geom[3] + i, j - n * P] = value


@cuda.jit(device=True)
def _phase(z, geom):
    """(group, ph, pw) of backward data's z = group·stride² + ph·stride + pw (geom[10] = stride²)."""
    stride = geom[8]
    group = z // geom[10]
    p = z - group * geom[10]
    ph = p // stride
    return group, ph, p - ph * stride


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
def _phase_tap(k, ph, pw, geom):
    """(kk, r, s) of backward data's reduction index k = (kk, rr, ss): output channel kk and tap
    r = r0 + stride·rr, s = s0 + stride·ss, the only taps that reach phase (ph, pw) (r, s may fall past
    R, S)."""
    R, S, stride, pad = geom[6], geom[7], geom[8], geom[9]
    TR = (R + stride - 1) // stride
    TS = (S + stride - 1) // stride
    kk = k // (TR * TS)
    t = k - kk * (TR * TS)
    rr = t // TS
    return kk, (ph + pad) % stride + stride * rr, (pw + pad) % stride + stride * (t - rr * TS)


@cuda.jit(device=True)
def _data_a(w2, i, k, z, geom):
    """A[c, (k, rr, ss)] = w[group·Kg + k, c, r, s] with r = r0 + stride·rr, s = s0 + stride·ss (0 past R, S).

    r0 = (ph + pad) mod stride: the only taps that reach dx rows of phase ph.
    """
    R, S = geom[6], geom[7]
    group, ph, pw = _phase(z, geom)
    kk, r, s = _phase_tap(k, ph, pw, geom)
    if r < R and s < S:
        return w2[group * geom[3] + kk, (i * R + r) * S + s]
    return float32(0.0)


@cuda.jit(device=True)
def _data_b(dout, k, j, z, geom):
    """B[(k, rr, ss), (n, hh, ww)] = dout[n, group·Kg + k, oh, ow] where dx pixel (ph + stride·hh, pw + stride·ww)
    is read by output (oh, ow) through tap (r, s); 0 where no output reads it."""
    H, W, Kg = geom[1], geom[2], geom[3]
    OH, OW, R, S, stride, pad = geom[4], geom[5], geom[6], geom[7], geom[8], geom[9]
    group, ph, pw = _phase(z, geom)
    n, h, w = _phase_pixel(j, ph, pw, geom)
    kk, r, s = _phase_tap(k, ph, pw, geom)
    if h < H and w < W and r < R and s < S:
        th = h + pad - r  # a multiple of stride: r ≡ h + pad (mod stride) by the choice of r0
        tw = w + pad - s
        if th >= 0 and tw >= 0:
            oh = th // stride
            ow = tw // stride
            if oh < OH and ow < OW:
                return dout[n, group * Kg + kk, oh, ow]
    return float32(0.0)


@cuda.jit(device=True)
def _data_store(dx3, i, j, z, geom, value, accumulate):
    H, W = geom[1], geom[2]
    group, ph, pw = _phase(z, geom)
    n, h, w = _phase_pixel(j, ph, pw, geom)
    if h < H and w < W:
        dx3[n, group * geom[0] + i, h * W + w] = value


@cuda.jit(device=True)
def _weight_a(dout3, i, k, z, geom):
    """A[k_out, (n, p)] = dout[n, group·Kg + k_out, p]."""
    P = geom[4] * geom[5]
    n = k // P
    return dout3[n, (z // geom[10]) * geom[3] + i, k - n * P]


@cuda.jit(device=True)
def _weight_b(x, k, j, z, geom):
    return _column(x, j, k, z // geom[10], geom)


@cuda.jit(device=True)
def _weight_store(partial3, i, j, z, geom, value, accumulate):
    """Split s of group g writes partial3[s, g·Kg + i, j] (with one split partial3 is dw itself, [1, K, Cg·R·S])."""
    splits = geom[10]
    group = z // splits
    partial3[z - group * splits, group * geom[3] + i, j] = value


CONV_FORWARD = Operands("conv_forward", _forward_a, _forward_b, _forward_store)
CONV_BACKWARD_DATA = Operands("conv_backward_data", _data_a, _data_b, _data_store)
CONV_BACKWARD_WEIGHT = Operands("conv_backward_weight", _weight_a, _weight_b, _weight_store)
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
"""Blocks a split weight gradient aims for: two per SM of an H100 SXM (132 SMs), more than an A100's 108.
Reasoned, not measured (no GPU here): the acceptance run's timings are where to tune it."""
SPLIT_MIN_K = 1024
"""Fewest products per split: a split's partial dw is written and read back once, so it must carry
work (1,024 FMAs per output against one extra write and read). Reasoned, not measured."""
SPLIT_TILE = 64
"""The C tile the split count assumes (v3's 64×64), fixed so scratch sizes do not depend on the GEMM chosen."""
SPLIT_K_ALIGN = 8
"""Chunks are whole multiples of v3's k-slab, so no slab straddles two splits."""


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

    def geom(self, splits: int = 1) -> tuple[int, ...]:
        """The ``geom`` tuple the implicit-GEMM operands read (order fixed by the device functions)."""
        return (self.Cg, self.H, self.W, self.Kg, self.OH, self.OW, self.R, self.S, self.stride, self.pad, splits)

    @property
    def weight_splits(self) -> tuple[int, int]:
        """(splits, k_chunk) of the weight gradient's GEMM over K = N·OH·OW; (1, K) when not split."""
        k = self.N * self.OH * self.OW
        tiles = -(-self.Kg // SPLIT_TILE) * -(-self.columns // SPLIT_TILE) * self.groups
        wanted = min(k // SPLIT_MIN_K, -(-SPLIT_TARGET_BLOCKS // tiles))
        if self.direct or wanted <= 1:
            return 1, max(1, k)
        chunk = -(-k // wanted)
        chunk = -(-chunk // SPLIT_K_ALIGN) * SPLIT_K_ALIGN
        return -(-k // chunk), chunk

    @property
    def weight_scratch_size(self) -> int:
        """Floats of the split-K partial weight gradients (0 when the GEMM is not split)."""
        splits, _ = self.weight_splits
        return 0 if splits == 1 else splits * self.K * self.columns


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
    """0: the implicit GEMM reads x in place of a column matrix."""
    conv_geometry(x_shape, w_shape, stride, pad, groups)
    return 0


def conv2d_backward_data_workspace_size(x_shape: Any, w_shape: Any, stride: Any, pad: Any, groups: int) -> int:
    """0: backward data gathers dout straight into dx."""
    conv_geometry(x_shape, w_shape, stride, pad, groups)
    return 0


def conv2d_backward_weight_workspace_size(x_shape: Any, w_shape: Any, stride: Any, pad: Any, groups: int) -> int:
    return conv_geometry(x_shape, w_shape, stride, pad, groups).weight_scratch_size


def conv2d_forward(x: Any, w: Any, bias: Any, out: Any, stride: Any, pad: Any, groups: int, scratch: Any = None) -> None:
    g = conv_geometry(x.shape, w.shape, stride, pad, groups)
    _check_output("out", out, (g.N, g.K, g.OH, g.OW))
    if g.direct:
        launch(direct_conv_forward, blocks_for(out.size), THREADS_PER_BLOCK, x, w, out, g.stride, g.pad, g.groups)
    else:
        w2 = w.reshape(g.K, g.columns)
        out3 = out.reshape(g.N, g.K, g.OH * g.OW)
        active_gemm().run(CONV_FORWARD, w2, x, out3, g.Kg, g.N * g.OH * g.OW, g.columns, g.geom(), z=g.groups)
    if bias is not None:
        add_bias(out.reshape(g.N, g.K, g.OH * g.OW), bias)


def conv2d_backward_data(dout: Any, w: Any, dx: Any, stride: Any, pad: Any, groups: int, scratch: Any = None) -> None:
    g = conv_geometry(dx.shape, w.shape, stride, pad, groups)
    _check_output("dout", dout, (g.N, g.K, g.OH, g.OW))
    if g.direct:
        launch(direct_conv_backward_data, blocks_for(dx.size), THREADS_PER_BLOCK, dout, w, dx, g.stride, g.pad, g.groups)
        return
    w2 = w.reshape(g.K, g.columns)
    dx3 = dx.reshape(g.N, g.C, g.H * g.W)
    st = g.stride
    phase_pixels = g.N * -(-g.H // st) * -(-g.W // st)
    taps = g.Kg * -(-g.R // st) * -(-g.S // st)
    active_gemm().run(
        CONV_BACKWARD_DATA, w2, dout, dx3, g.Cg, phase_pixels, taps, g.geom(st * st), z=g.groups * st * st
    )


def conv2d_backward_weight(
    x: Any, dout: Any, dw: Any, dbias: Any, stride: Any, pad: Any, groups: int, scratch: Any = None
) -> None:
    g = conv_geometry(x.shape, dw.shape, stride, pad, groups)
    _check_output("dout", dout, (g.N, g.K, g.OH, g.OW))
    if g.direct:
        threads = reduction_threads(g.N * g.OH * g.OW)  # one block per weight
        launch(direct_conv_backward_weight, dw.size, threads, x, dout, dw, g.stride, g.pad, g.groups)
    else:
        splits, chunk = g.weight_splits
        if splits == 1:
            target = dw.reshape(1, g.K, g.columns)
        else:
            target = check_scratch(scratch, g.weight_scratch_size, "conv2d_backward_weight")
            target = target.reshape(splits, g.K, g.columns)
        dout3 = dout.reshape(g.N, g.K, g.OH * g.OW)
        active_gemm().run(
            CONV_BACKWARD_WEIGHT,
            dout3,
            x,
            target,
            g.Kg,
            g.columns,
            g.N * g.OH * g.OW,
            g.geom(splits),
            z=g.groups * splits,
            k_chunk=chunk,
        )
        if splits > 1:
            launch(sum_splits, blocks_for(dw.size), THREADS_PER_BLOCK, target.reshape(splits, -1), dw.reshape(-1))
    if dbias is not None:
        sum_channels(dout.reshape(g.N, g.K, g.OH * g.OW), dbias)

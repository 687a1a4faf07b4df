"""2-D convolution on the GPU: im2col + GEMM, a 1×1 fast path, and direct kernels for depthwise.

Three paths, picked from the shapes:

- depthwise-style (one input channel per group, groups > 1): direct kernels, one thread per output
  (forward), per input gradient (backward data) and one block per weight (backward weight). A
  GEMM with one input channel per group would be a GEMM with K = R·S = 9: all launch, no work.
- 1×1, stride 1, pad 0: the image is already the column matrix: ``x[n]`` viewed as [C, H·W] goes
  straight into the GEMM, no scratch.
- everything else: per image and group, im2col writes the [Cg·R·S, OH·OW] column matrix into the
  caller's scratch, and the tiled GEMM of kernels/cuda/gemm.py multiplies it with the weights.
  Backward data runs the GEMM with the weights transposed into the columns, then col2im gathers
  them back into dx. Backward weight accumulates one GEMM per image in a fixed order.

No path uses atomics: col2im and the direct backward-data kernel *gather* (each thread owns one dx
element and sums what reaches it), and weight/bias gradients add images in order, so every result
is the same bits on every run. Scratch: ``Cg·R·S·OH·OW`` floats for the im2col path, else none.
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
from kernels.cuda.gemm import gemm

# --- im2col / col2im -------------------------------------------------------------------------------


@cuda.jit
def im2col(x, col, n, c0, R, S, stride, pad, OW):
    """col[(c·R + r)·S + s, oh·OW + ow] = x[n, c0 + c, oh·stride − pad + r, ow·stride − pad + s] (0 off the image)."""
    e = cuda.grid(1)
    rows = col.shape[0]
    P = col.shape[1]
    if e < rows * P:
        row = e // P
        p = e - row * P
        c = row // (R * S)
        rs = row - c * (R * S)
        r = rs // S
        s = rs - r * S
        oh = p // OW
        ow = p - oh * OW
        h = oh * stride - pad + r
        w = ow * stride - pad + s
        if 0 <= h < x.shape[2] and 0 <= w < x.shape[3]:
            col[row, p] = x[n, c0 + c, h, w]
        else:
            col[row, p] = float32(0.0)


@cuda.jit
def col2im(col, dx, n, c0, Cg, R, S, stride, pad, OW):
    """dx[n, c0 + c, h, w] = Σ of the column entries that im2col copied from (h, w): a gather, no atomics."""
    e = cuda.grid(1)
    H = dx.shape[2]
    W = dx.shape[3]
    OH = col.shape[1] // OW
    if e < Cg * H * W:
        c = e // (H * W)
        hw = e - c * (H * W)
        h = hw // W
        w = hw - h * W
        acc = float32(0.0)
        for r in range(R):
            th = h + pad - r
            if th >= 0 and th % stride == 0 and th // stride < OH:
                oh = th // stride
                for s in range(S):
                    tw = w + pad - s
                    if tw >= 0 and tw % stride == 0 and tw // stride < OW:
                        acc += col[(c * R + r) * S + s, oh * OW + tw // stride]
        dx[n, c0 + c, h, w] = acc


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
    partial[tid] = acc
    cuda.syncthreads()
    step = threads // 2
    while step > 0:  # fixed-order tree: slot t adds slot t + step, halving until slot 0 holds the total
        if tid < step:
            partial[tid] += partial[tid + step]
        cuda.syncthreads()
        step //= 2
    if tid == 0:
        dw[k, c, r, s] = partial[0]


# --- host side ---------------------------------------------------------------------------------------


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
    def pointwise(self) -> bool:
        return self.R == 1 and self.S == 1 and self.stride == 1 and self.pad == 0

    @property
    def scratch_size(self) -> int:
        """Floats of the im2col column matrix for one image and group (0 where no columns are built)."""
        if self.direct or self.pointwise:
            return 0
        return self.Cg * self.R * self.S * self.OH * self.OW


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
    return conv_geometry(x_shape, w_shape, stride, pad, groups).scratch_size


def conv2d_backward_data_workspace_size(x_shape: Any, w_shape: Any, stride: Any, pad: Any, groups: int) -> int:
    return conv_geometry(x_shape, w_shape, stride, pad, groups).scratch_size


def conv2d_backward_weight_workspace_size(x_shape: Any, w_shape: Any, stride: Any, pad: Any, groups: int) -> int:
    return conv_geometry(x_shape, w_shape, stride, pad, groups).scratch_size


def _columns(x: Any, g: ConvGeometry, n: int, c0: int, scratch: Any) -> Any:
    """The [Cg·R·S, OH·OW] column matrix of image n, group starting at channel c0."""
    if g.pointwise:
        return x[n, c0 : c0 + g.Cg].reshape(g.Cg, g.H * g.W)
    col = scratch.reshape(g.Cg * g.R * g.S, g.OH * g.OW)
    launch(im2col, blocks_for(col.size), THREADS_PER_BLOCK, x, col, n, c0, g.R, g.S, g.stride, g.pad, g.OW)
    return col


def _group_weights(w: Any, g: ConvGeometry, group: int) -> Any:
    return w[group * g.Kg : (group + 1) * g.Kg].reshape(g.Kg, g.Cg * g.R * g.S)


def conv2d_forward(x: Any, w: Any, bias: Any, out: Any, stride: Any, pad: Any, groups: int, scratch: Any = None) -> None:
    g = conv_geometry(x.shape, w.shape, stride, pad, groups)
    _check_output("out", out, (g.N, g.K, g.OH, g.OW))
    if g.direct:
        launch(direct_conv_forward, blocks_for(out.size), THREADS_PER_BLOCK, x, w, out, g.stride, g.pad, g.groups)
    else:
        scratch = check_scratch(scratch, g.scratch_size, "conv2d_forward")
        for n in range(g.N):
            for group in range(g.groups):
                col = _columns(x, g, n, group * g.Cg, scratch)
                out_ng = out[n, group * g.Kg : (group + 1) * g.Kg].reshape(g.Kg, g.OH * g.OW)
                gemm(_group_weights(w, g, group), col, out_ng)
    if bias is not None:
        add_bias(out.reshape(g.N, g.K, g.OH * g.OW), bias)


def conv2d_backward_data(dout: Any, w: Any, dx: Any, stride: Any, pad: Any, groups: int, scratch: Any = None) -> None:
    g = conv_geometry(dx.shape, w.shape, stride, pad, groups)
    _check_output("dout", dout, (g.N, g.K, g.OH, g.OW))
    if g.direct:
        launch(direct_conv_backward_data, blocks_for(dx.size), THREADS_PER_BLOCK, dout, w, dx, g.stride, g.pad, g.groups)
        return
    scratch = check_scratch(scratch, g.scratch_size, "conv2d_backward_data")
    for n in range(g.N):
        for group in range(g.groups):
            c0 = group * g.Cg
            dout_ng = dout[n, group * g.Kg : (group + 1) * g.Kg].reshape(g.Kg, g.OH * g.OW)
            if g.pointwise:  # the columns are dx itself
                gemm(_group_weights(w, g, group).T, dout_ng, dx[n, c0 : c0 + g.Cg].reshape(g.Cg, g.H * g.W))
                continue
            col = scratch.reshape(g.Cg * g.R * g.S, g.OH * g.OW)
            gemm(_group_weights(w, g, group).T, dout_ng, col)
            blocks = blocks_for(g.Cg * g.H * g.W)
            launch(col2im, blocks, THREADS_PER_BLOCK, col, dx, n, c0, g.Cg, g.R, g.S, g.stride, g.pad, g.OW)


def conv2d_backward_weight(
    x: Any, dout: Any, dw: Any, dbias: Any, stride: Any, pad: Any, groups: int, scratch: Any = None
) -> None:
    g = conv_geometry(x.shape, dw.shape, stride, pad, groups)
    _check_output("dout", dout, (g.N, g.K, g.OH, g.OW))
    if g.direct:
        threads = reduction_threads(g.N * g.OH * g.OW)  # one block per weight
        launch(direct_conv_backward_weight, dw.size, threads, x, dout, dw, g.stride, g.pad, g.groups)
    else:
        scratch = check_scratch(scratch, g.scratch_size, "conv2d_backward_weight")
        for group in range(g.groups):
            dw_g = dw[group * g.Kg : (group + 1) * g.Kg].reshape(g.Kg, g.Cg * g.R * g.S)
            for n in range(g.N):  # images in order: the same sum, bit for bit, on every run
                col = _columns(x, g, n, group * g.Cg, scratch)
                dout_ng = dout[n, group * g.Kg : (group + 1) * g.Kg].reshape(g.Kg, g.OH * g.OW)
                gemm(dout_ng, col.T, dw_g, accumulate=n > 0)
    if dbias is not None:
        sum_channels(dout.reshape(g.N, g.K, g.OH * g.OW), dbias)

"""Depthwise 3×3 convolution with whole planes in vector registers (v25, issue 13 item 2).

Why. MobileNetV2's depthwise layers (CIFAR sizes) have planes of 32×32, 16×16, 8×8 and 4×4
pixels: one plane is 64, 16, 4 or 1 vectors of 16 floats. The chunk runs of ``conv_depthwise``
(nine position-weights and nine misaligned tap loads per 16 outputs) and its plane loops (nine mask
loads per 16 outputs, a loop set-up per plane of one to four vectors) were bound by their loads:
30–130 cycles per 16 outputs (``conv_depthwise``'s docstring; below) where the nine multiply-adds
need nine.

The kernel. Each plane's input is loaded once, as its vectors (4×4: one, 8×8: four, 16×16: sixteen,
32×32: 64), and every tap of every output vector is built from those registers by a constant shuffle
(``shufflevector`` with a zero vector: LLVM emits ``vpermt2ps``/``valignd`` with zero-masking), so a
tap that leaves the plane is an exact zero, never a neighbour plane's pixel (an inf or NaN stays in
its channel). The nine weights are broadcast from memory; the nine products are chained ``fma``s in
tap order. Everything about the plane's geometry (which lanes, which zeros) is a compile-time
constant: this module writes the LLVM IR of one whole plane per geometry (``_Emitter``), and the
Numba loops around it only walk the planes.

- Stride 1: tap (r, s) of an output vector is the input vector(s) of rows y + r − 1 shifted by
  s − 1 lanes, zeros where the tap leaves the plane; one or two source vectors a tap.
- Stride 2, forward and the weight gradient: the input's four phase planes (even/odd rows × even/odd
  columns, at the output's resolution) are built first, then each tap is one phase shifted by zero
  or one output row/column: only the kept outputs, never the full-resolution grid.
- Stride 2, backward-data: each output vector sums only the taps with a non-zero lane (the parity of
  its rows decides: an even row takes r = 1 only), each a shuffle of dout's vectors: dout is never
  spread over the full-resolution grid.
- Weight gradient: one channel at a time (4×4: two), all images, nine vector accumulators each
  (``acc_k += dout ⊙ tap_k``) in an IR loop, summed across lanes in lane order at the end.

Threads: forward and backward-data split the planes (image-major) into one contiguous range per
thread; the weight gradient splits the channels. Every output and every dW sum is one fixed
expression whatever the split: the same bits at any thread count. No scratch.

How the geometry is chosen (``_Emitter.build``): every vector wanted is a lane map (lane → plane
position or zero); it is built greedily from the vectors already at hand (inputs, phase planes,
taps built earlier), the one that covers most lanes first, then merged by further shuffles.
32×32 planes (64 vectors) do not fit the registers; LLVM keeps the plane's loads near their uses,
and the same code still wins (below).

Measured (AMD EPYC Zen 4, 2 vCPUs, batch 32, two threads; ``benchmarks/depthwise_versions.py
--versions 23,25 --max-pixels 1024``: the two study versions alternating in one process, median of 5
rounds of best-of-7, ms), v23 → v25, forward / backward-data / weight:

- 960 ch @4×4: 0.229 → 0.139 / 0.244 → 0.124 / 0.291 → 0.164
- 384 ch @8×8: 0.321 → 0.160 / 0.283 → 0.134 / 0.294 → 0.144
- 576 ch @8×8: 0.459 → 0.205 / 0.379 → 0.197 / 0.404 → 0.221
- 576 ch s2 @8×8: 0.372 → 0.124 / 0.566 → 0.215 / 0.415 → 0.154
- 192 ch @16×16: 0.515 → 0.211 / 0.544 → 0.209 / 0.498 → 0.194
- 192 ch s2 @16×16: 0.492 → 0.121 / 0.753 → 0.134 / 0.404 → 0.146
- 32 ch @32×32: 0.448 → 0.196 / 0.335 → 0.176 / 0.313 → 0.148
- 96 ch @32×32: 1.345 → 0.557 / 1.188 → 0.509 / 0.895 → 0.609
- 144 ch @32×32: 1.997 → 0.861 / 2.232 → 0.797 / 1.314 → 1.403 (the weight gradient level: three
  runs 1.48 → 1.49, 1.45 → 1.37, 1.31 → 1.40; x and dout are 38 MB, more than the L3, and both
  versions stream them from memory)
- 144 ch s2 @32×32: 1.381 → 0.337 / 2.595 → 0.431 / 1.386 → 0.562

Where the time goes now: the small planes are bound by moving the data, not by the loop. 576 ch s2
@8×8 forward takes 0.154 ms on one thread and 0.152 on two (it reads 4.7 MB and writes 1.2 MB; a
plain copy of the 4.7 MB input takes 0.11 ms on one thread or two here); 960 ch @4×4 forward 0.168
→ 0.111, backward-data 0.137 → 0.104, weight 0.209 → 0.168 (one → two threads, before the pairs
below). Before (v23), one thread: 0.65 ms for the same forward, ~130 cycles per 16 outputs.

The 4×4 weight gradient runs two channels a pass (``weight_share``): each image's planes are 64
bytes 61 KB apart, and two of them a pass keep twice the loads in flight; one → two → four channels a
pass, 960 ch @4×4, two runs: 0.204 → 0.167 → 0.182, 0.186 → 0.136 → 0.137 ms; on 8×8 level (576 ch s2
0.121 / 0.112 / 0.119, 0.128 / 0.128 / 0.129; 384 ch 0.149 / 0.155 / 0.157), so one there.
Tried and dropped: ``llvm.prefetch`` of the next planes in the weight gradient, 2, 4 or 8 images ahead:
960 ch @4×4 0.19 → 0.26 / 0.28 / 0.28 ms, 576 ch s2 @8×8 0.158 → 0.156 / 0.175 / 0.175, 192 ch s2 @16×16
0.112 → 0.124 / 0.124 / 0.133.

Cold compile (empty ``NUMBA_CACHE_DIR``): ``filter_share`` 1.1 s (forward and backward-data share it),
``weight_share`` 0.7 s. MobileNetV2's depthwise warm-up jobs (``engine.warmup.model_jobs``, each run
cold, two runs): v23's four (``depthwise-groups``, ``-flat`` weight, ``-planes``, ``-flat`` forward)
9.90 / 10.00 s → these two 1.84 / 1.88 s; every MobileNetV2 depthwise layer takes this path now.
"""

from __future__ import annotations

from llvmlite import ir
from numba import get_num_threads, njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from kernels.cpu.threads import run_shares

LANES = 16
_VEC = ir.VectorType(ir.FloatType(), LANES)
_MASK = ir.VectorType(ir.IntType(32), LANES)
_BITS = ir.VectorType(ir.IntType(1), LANES)

GEOMETRIES = ((4, 4, 1), (8, 8, 1), (8, 8, 2), (16, 16, 1), (16, 16, 2), (32, 32, 1), (32, 32, 2))
"""(H, W, stride) of the input planes this module's kernels are written for (every 3×3 depthwise
layer of the CIFAR MobileNetV2, pad 1)."""


def _source(direction: str, stride: int, height: int, width: int, out_w: int, position: int, r: int, s: int):
    """The plane position tap (r, s) of output ``position`` reads, or None where it is a zero.

    forward: the output (OH×OW) reads the input (H×W); data: dx (H×W) reads dout (OH×OW)."""
    out_h = (height - 1) // stride + 1
    if direction == "forward":
        oy, ox = divmod(position, out_w)
        y, x = stride * oy + r - 1, stride * ox + s - 1
        return y * width + x if 0 <= y < height and 0 <= x < width else None
    y, x = divmod(position, width)
    ty, tx = y - r + 1, x - s + 1
    if ty % stride or tx % stride:
        return None
    oy, ox = ty // stride, tx // stride
    return oy * out_w + ox if 0 <= oy < out_h and 0 <= ox < out_w else None


class _Emitter:
    """Builds wanted vectors (lane maps over the source plane) out of vectors at hand by shuffles."""

    def __init__(self, builder: ir.IRBuilder, inputs: list) -> None:
        self.builder = builder
        self.zero = ir.Constant(_VEC, None)
        self.pool: list[tuple[ir.Value, tuple]] = [
            (value, tuple(LANES * i + lane for lane in range(LANES))) for i, value in enumerate(inputs)
        ]
        self.built: dict[tuple, ir.Value] = {}

    def build(self, want: tuple) -> ir.Value:
        if all(p is None for p in want):
            return self.zero
        if want in self.built:
            return self.built[want]
        for value, content in self.pool:
            if content == want:
                return value
        remaining = {lane for lane, p in enumerate(want) if p is not None}
        chosen = []
        while remaining:
            best, best_lanes = None, set()
            for value, content in self.pool:
                where = {p: i for i, p in enumerate(content) if p is not None}
                lanes = {lane for lane in remaining if want[lane] in where}
                if len(lanes) > len(best_lanes):
                    best, best_lanes = (value, where), lanes
            if best is None:
                raise ValueError("a wanted position is in no vector at hand")
            chosen.append((best, best_lanes))
            remaining -= best_lanes
        b = self.builder
        zeros = [lane for lane, p in enumerate(want) if p is None]
        (first, first_where), first_lanes = chosen[0]
        if len(chosen) == 1:
            mask = [first_where[want[lane]] if lane in first_lanes else LANES for lane in range(LANES)]
            value = b.shuffle_vector(first, self.zero, ir.Constant(_MASK, mask))
        else:
            (second, second_where), second_lanes = chosen[1]
            mask = [
                first_where[want[lane]] if lane in first_lanes
                else LANES + second_where[want[lane]] if lane in second_lanes else 0
                for lane in range(LANES)
            ]
            value = b.shuffle_vector(first, second, ir.Constant(_MASK, mask))
            done = first_lanes | second_lanes
            for (other, other_where), lanes in chosen[2:]:
                mask = [LANES + other_where[want[lane]] if lane in lanes else lane for lane in range(LANES)]
                value = b.shuffle_vector(value, other, ir.Constant(_MASK, mask))
                done |= lanes
            if zeros:
                keep = ir.Constant(_BITS, [0 if lane in zeros else 1 for lane in range(LANES)])
                value = b.select(keep, value, self.zero)
        self.pool.append((value, want))
        self.built[want] = value
        return value


def _taps(direction: str, height: int, width: int, stride: int):
    """Per output vector, the nine taps' lane maps (None for a tap with no non-zero lane)."""
    out_h, out_w = (height - 1) // stride + 1, (width - 1) // stride + 1
    out_plane = height * width if direction == "data" else out_h * out_w
    vectors = []
    for j in range(out_plane // LANES):
        taps = []
        for k in range(9):
            want = tuple(
                _source(direction, stride, height, width, out_w, LANES * j + lane, k // 3, k % 3)
                for lane in range(LANES)
            )
            taps.append(None if all(p is None for p in want) else want)
        vectors.append(taps)
    return vectors


def _phases(height: int, width: int):
    """Stride 2: the input's four phase planes at the output's resolution, as lane maps per output vector."""
    out_w, out_plane = width // 2, (height // 2) * (width // 2)
    maps = []
    for j in range(out_plane // LANES):
        for a in (0, 1):
            for c in (0, 1):
                want = []
                for lane in range(LANES):
                    oy, ox = divmod(LANES * j + lane, out_w)
                    want.append((2 * oy + a) * width + 2 * ox + c)
                maps.append(tuple(want))
    return maps


def _pointer(builder, base, offset):
    return builder.bitcast(builder.gep(base, [offset]), _VEC.as_pointer())


def _load_plane(builder, base, offset, count):
    return [builder.load(_pointer(builder, base, builder.add(offset, ir.Constant(offset.type, LANES * i))), align=4)
            for i in range(count)]


def _fma(builder):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VEC, [_VEC] * 3), "llvm.fma.v16f32")


def _int64(context, builder, signature, args, index):
    return context.cast(builder, args[index], signature.args[index], types.int64)


def _filter_codegen(height: int, width: int, stride: int, direction: str):
    """Emits one plane, ``(src, s0, dst, d0, w, w0, …)``: dst[d0 + q] = Σ_k w[w0 + k] · tap_k(src plane at s0)."""
    out_h, out_w = (height - 1) // stride + 1, (width - 1) // stride + 1
    source_plane = height * width if direction == "forward" else out_h * out_w
    taps = _taps(direction, height, width, stride)

    def codegen(context, builder, signature, args):
        src = context.make_array(signature.args[0])(context, builder, args[0]).data
        dst = context.make_array(signature.args[2])(context, builder, args[2]).data
        weights = context.make_array(signature.args[4])(context, builder, args[4]).data
        s0, d0, w0 = (_int64(context, builder, signature, args, i) for i in (1, 3, 5))
        emitter = _Emitter(builder, _load_plane(builder, src, s0, source_plane // LANES))
        if stride == 2 and direction == "forward":
            for want in _phases(height, width):
                emitter.build(want)
        fma = _fma(builder)
        splats = []
        for k in range(9):
            scalar = builder.load(builder.gep(weights, [builder.add(w0, ir.Constant(w0.type, k))]))
            one = builder.insert_element(ir.Constant(_VEC, ir.Undefined), scalar, ir.Constant(ir.IntType(32), 0))
            splats.append(builder.shuffle_vector(one, ir.Constant(_VEC, ir.Undefined), ir.Constant(_MASK, None)))
        for j, vector_taps in enumerate(taps):
            total = None
            for k, want in enumerate(vector_taps):
                if want is None:
                    continue
                tap = emitter.build(want)
                total = builder.fmul(tap, splats[k]) if total is None else builder.call(fma, [tap, splats[k], total])
            if total is None:
                total = emitter.zero
            builder.store(total, _pointer(builder, dst, builder.add(d0, ir.Constant(d0.type, LANES * j))), align=4)

    return codegen


def _weight_codegen(height: int, width: int, stride: int, block: int = 1):
    """Emits ``(x, x0, x_step, g, g0, g_step, n, dw, o, …)``: dw[o + k] = Σ_i Σ_q g(image i)[q] · tap_k(x
    of image i)[q], over the ``n`` planes at x0 + i·x_step and g0 + i·g_step, i in order; the lanes
    summed in lane order at the end. ``block`` channels a pass (the planes that follow in memory,
    their sums at o + 9b + k), each with its own nine accumulators."""
    out_h, out_w = (height - 1) // stride + 1, (width - 1) // stride + 1
    taps = _taps("forward", height, width, stride)
    out_vectors = out_h * out_w // LANES

    def codegen(context, builder, signature, args):
        xs = context.make_array(signature.args[0])(context, builder, args[0]).data
        gs = context.make_array(signature.args[3])(context, builder, args[3]).data
        dw = context.make_array(signature.args[7])(context, builder, args[7]).data
        x0, x_step, g0, g_step, n, o = (_int64(context, builder, signature, args, i) for i in (1, 2, 4, 5, 6, 8))
        fma = _fma(builder)
        accumulators = [cgutils.alloca_once_value(builder, ir.Constant(_VEC, None)) for _ in range(9 * block)]
        with cgutils.for_range(builder, n) as loop:
            xi = builder.add(x0, builder.mul(loop.index, x_step))
            gi = builder.add(g0, builder.mul(loop.index, g_step))
            for b in range(block):
                xb = builder.add(xi, ir.Constant(xi.type, b * height * width))
                gb = builder.add(gi, ir.Constant(gi.type, b * out_h * out_w))
                emitter = _Emitter(builder, _load_plane(builder, xs, xb, height * width // LANES))
                if stride == 2:
                    for want in _phases(height, width):
                        emitter.build(want)
                grads = _load_plane(builder, gs, gb, out_vectors)
                totals = [builder.load(a) for a in accumulators[9 * b : 9 * b + 9]]
                for j, vector_taps in enumerate(taps):
                    for k, want in enumerate(vector_taps):
                        if want is not None:
                            totals[k] = builder.call(fma, [grads[j], emitter.build(want), totals[k]])
                for a, t in zip(accumulators[9 * b : 9 * b + 9], totals):
                    builder.store(t, a)
        for k in range(9 * block):
            vector = builder.load(accumulators[k])
            total = builder.extract_element(vector, ir.Constant(ir.IntType(32), 0))
            for lane in range(1, LANES):
                total = builder.fadd(total, builder.extract_element(vector, ir.Constant(ir.IntType(32), lane)))
            builder.store(total, builder.gep(dw, [builder.add(o, ir.Constant(o.type, k))]))

    return codegen


def _by_case(codegens: list):
    """Emits every body in ``codegens`` behind an LLVM ``switch`` on the call's last argument, so the
    Numba loops below make one call, not a chain of ``if``s, one per geometry."""

    def codegen(context, builder, signature, args):
        case = _int64(context, builder, signature, args, len(args) - 1)
        end = builder.append_basic_block("end")
        switch = builder.switch(case, end)
        for i, emit in enumerate(codegens):
            block = builder.append_basic_block(f"case{i}")
            switch.add_case(ir.Constant(case.type, i), block)
            builder.position_at_end(block)
            emit(context, builder, signature, args)
            builder.branch(end)
        builder.position_at_end(end)
        return context.get_dummy_value()

    return codegen


DATA = len(GEOMETRIES)
"""``_filter``'s cases: the geometry's index for the forward, ``DATA`` + it for backward-data."""
PAIRS = len(GEOMETRIES)
"""``_weight``'s cases: the geometry's index, or ``PAIRS`` for 4×4 two channels a pass (``weight_share``)."""
_FILTER_CASES = [_filter_codegen(h, w, s, d) for d in ("forward", "data") for h, w, s in GEOMETRIES]
_WEIGHT_CASES = [_weight_codegen(h, w, s) for h, w, s in GEOMETRIES] + [_weight_codegen(4, 4, 1, 2)]


@intrinsic
def _filter(typingctx, src, s0, dst, d0, w, w0, case):
    return types.void(src, s0, dst, d0, w, w0, case), _by_case(_FILTER_CASES)


@intrinsic
def _weight(typingctx, x, x0, x_step, g, g0, g_step, n, dw, o, case):
    return types.void(x, x0, x_step, g, g0, g_step, n, dw, o, case), _by_case(_WEIGHT_CASES)


def geometry(x_shape, stride: int) -> int:
    """The index in ``GEOMETRIES`` of a full-resolution plane shape and stride, −1 where none fits."""
    key = (x_shape[2], x_shape[3], stride)
    return GEOMETRIES.index(key) if key in GEOMETRIES else -1


def supported(x_shape, w_shape, stride: int, pad: int) -> bool:
    return w_shape[2] == 3 and w_shape[3] == 3 and pad == 1 and geometry(x_shape, stride) >= 0


@njit(cache=True, nogil=True)
def filter_share(src, dst, w, planes, channels, src_plane, dst_plane, kind, data, t, threads):
    """Thread ``t``'s contiguous range of the ``planes`` (image-major) planes: dst plane p = the 3×3
    filter of channel p mod C over src plane p (``data``: the backward-data taps)."""
    case = kind + DATA if data else kind
    for p in range(t * planes // threads, (t + 1) * planes // threads):
        _filter(src, p * src_plane, dst, p * dst_plane, w, (p % channels) * 9, case)


@njit(cache=True, nogil=True)
def weight_share(x, g, dw, images, channels, plane, out_plane, kind, t, threads):
    """Thread ``t``'s contiguous range of channels: dw[c, :] over every image, in image order.

    4×4 planes (one vector each) go two channels a pass (``PAIRS``: twice the loads in flight per
    image; each channel's sums are the same operations in the same order as alone, so the same bits);
    an odd last channel goes alone, the last share's last unit."""
    xs, gs = channels * plane, channels * out_plane
    step = 2 if kind == 0 else 1
    units = (channels + step - 1) // step
    for u in range(t * units // threads, (t + 1) * units // threads):
        c = step * u
        case = PAIRS if step == 2 and c + 1 < channels else kind
        _weight(x, c * plane, xs, g, c * out_plane, gs, images, dw, c * 9, case)  # one call site: one switch


def _run_filter(src, w, dst, stride: int, data: bool) -> None:
    """dst = the filter over src (forward), or its transposed filter (``data``: src = dout, dst = dx);
    the geometry is the input plane's, ``dst`` for backward-data."""
    threads = get_num_threads()
    n, c = src.shape[0], src.shape[1]
    kind = geometry((dst if data else src).shape, stride)
    plane, out_plane = src.shape[2] * src.shape[3], dst.shape[2] * dst.shape[3]
    s, d, weights = src.reshape(src.size), dst.reshape(dst.size), w.reshape(w.size)
    run_shares(lambda t: filter_share(s, d, weights, n * c, c, plane, out_plane, kind, data, t, threads), threads)


def run_forward(x, w, out, stride: int) -> None:
    _run_filter(x, w, out, stride, False)


def run_backward_data(dout, w, dx, stride: int) -> None:
    _run_filter(dout, w, dx, stride, True)


def run_backward_weight(x, dout, dw, stride: int) -> None:
    threads = get_num_threads()
    n, c = x.shape[0], x.shape[1]
    kind = geometry(x.shape, stride)
    xs, gs, result = x.reshape(x.size), dout.reshape(dout.size), dw.reshape(dw.size)
    plane, out_plane = x.shape[2] * x.shape[3], dout.shape[2] * dout.shape[3]
    run_shares(lambda t: weight_share(xs, gs, result, n, c, plane, out_plane, kind, t, threads), threads)

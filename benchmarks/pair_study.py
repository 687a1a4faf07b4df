"""Two chunked chains as one (issue 30's "(node, chunk)" units, studied before building): validate, then time.

    python benchmarks/pair_study.py                      # MobileNetV2's 224 pairs at batch 32, three rounds
    python benchmarks/pair_study.py --batch-size 128 --rounds 2
    python benchmarks/pair_study.py --check-only         # tiny shapes: the bits and the math, no timing

Why. At 224 every chunked chain (``engine.layers.chunked.ChunkedConvBN``) still hands its whole output to the next
node, and takes the whole gradient back. Where two chunked chains follow each other, the tensor between them is the
largest of the step and exists twice in backward: MobileNetV2's 112-pixel expansion (16→96, then a depthwise stride-2
conv) makes a 147 MiB activation at batch 32 (588 MiB at 128), which the depthwise chain keeps for its weight
gradient (a swapped or rebuilt offload unit), and its 147 MiB gradient, made whole by the depthwise chain's backward
before the expansion's backward starts. A pair run chunk by chunk never holds either whole: each pass recomputes the
first chain's chunk from the pair's input and feeds it to the second.

What it costs, per pass over the chunks, against the separate chains each recomputing (timed at their best: the
intermediate kept from the forward, where a run under a limit rebuilds or swaps it):

* forward: the first conv twice (its statistics, then its output for the second conv) instead of once;
* backward: three passes instead of two per chain: (1) both chains' rebuilt outputs, the second batch norm's sums;
  (2) again, the second chain's dx, the second conv's backward-data, the first batch norm's sums; (3) again, last
  chunk first, both chains' dx and weight gradients. The first conv runs three times, the second conv three times
  and its backward-data twice.

Exactness: every kernel runs on the same chunks of the same values as in the separate chains, the carried sums in
image order and the weight gradients last chunk first, so the pair gives the separate chains' bits. ``check``
compares them bit for bit (outputs, running statistics, every gradient) and both against PyTorch in float64.

Memory at the pair's worst moment (its backward), counted from the buffers each way holds: the separate chains hold
the intermediate and its gradient whole plus a chain's chunk buffers; the pair holds two chunks of the intermediate,
one of the second chain's output, and the conv workspaces.

This is the study (llm.c's dev/ style) the production layer follows call for call:
``engine.layers.chunked.ChunkedPair``, ``engine train --chunks pairs``; docs/offload.md ("Two chained chains as
one") has what was measured.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.layers.chunked import CHUNK_IMAGES  # noqa: E402
from kernels.cpu import batchnorm as bnk  # noqa: E402
from kernels.cpu import conv as convk  # noqa: E402
from kernels.cpu import elementwise as ew  # noqa: E402

MOMENTUM, EPS = 0.1, 1e-5


@dataclass
class Stage:
    """One conv (no bias) → batch norm → [ReLU6] chain's parameters and geometry."""

    w: np.ndarray
    stride: int
    pad: int
    groups: int
    gamma: np.ndarray
    beta: np.ndarray
    act: str | None  # "relu6" or None

    def fresh_running(self) -> tuple[np.ndarray, np.ndarray]:
        C = self.w.shape[0]
        return np.zeros(C, np.float32), np.ones(C, np.float32)

    def out_shape(self, x_shape: tuple[int, ...]) -> tuple[int, ...]:
        N, _, H, W = x_shape
        K, _, R, S = self.w.shape
        return (N, K, (H + 2 * self.pad - R) // self.stride + 1, (W + 2 * self.pad - S) // self.stride + 1)

    def ws(self, x_shape: tuple[int, ...], direction: str) -> np.ndarray:
        size = getattr(convk, f"conv2d_{direction}_workspace_size")(x_shape, self.w.shape, self.stride, self.pad,
                                                                    self.groups)
        return np.empty(max(int(size), 1), np.float32)

    def conv(self, x: np.ndarray, out: np.ndarray, ws: np.ndarray) -> None:
        convk.conv2d_forward(x, self.w, None, out, self.stride, self.pad, self.groups, ws)

    def data(self, d: np.ndarray, dx: np.ndarray, ws: np.ndarray) -> None:
        convk.conv2d_backward_data(d, self.w, dx, self.stride, self.pad, self.groups, ws)

    def weight(self, x: np.ndarray, d: np.ndarray, dw: np.ndarray, ws: np.ndarray) -> None:
        convk.conv2d_backward_weight(x, d, dw, None, self.stride, self.pad, self.groups, ws)


def chunks(n: int) -> list[tuple[int, int]]:
    return [(a, min(a + CHUNK_IMAGES, n)) for a in range(0, n, CHUNK_IMAGES)]


def chunk_of(shape: tuple[int, ...]) -> tuple[int, ...]:
    return (min(shape[0], CHUNK_IMAGES), *shape[1:])


class Peak:
    """The most bytes the buffers named alive at once held (each way counts what it allocates)."""

    def __init__(self) -> None:
        self.alive: dict[str, int] = {}
        self.most = 0

    def hold(self, name: str, array: np.ndarray) -> np.ndarray:
        self.alive[name] = array.nbytes
        self.most = max(self.most, sum(self.alive.values()))
        return array

    def drop(self, *names: str) -> None:
        for name in names:
            self.alive.pop(name, None)


# ---- the separate chains: ChunkedConvBN's recompute mode without a pool, call for call ---------------------------

def stage_forward(st: Stage, x: np.ndarray, running: tuple[np.ndarray, np.ndarray]) -> tuple:
    """Pass 1: each chunk's conv into the output, its statistics carried; the barrier; pass 2 (last chunk first):
    normalized and activated in place."""
    out = np.empty(st.out_shape(x.shape), np.float32)
    C = out.shape[1]
    sums, ss, invstd = np.empty((C, 3)), np.empty((C, 2)), np.empty(C, np.float32)
    ws = st.ws(chunk_of(x.shape), "forward")
    for a, b in chunks(x.shape[0]):
        st.conv(x[a:b], out[a:b], ws)
        bnk.batchnorm_chunk_statistics(out[a:b], sums, a == 0)
    bnk.batchnorm_chunk_finish(sums, out.shape[0] * out.shape[2] * out.shape[3], st.gamma, st.beta, *running, ss,
                               invstd, MOMENTUM, EPS)
    for a, b in reversed(chunks(x.shape[0])):
        bnk.batchnorm_chunk_apply(out[a:b], ss, st.act, None, out[a:b])
    return out, ss, invstd


def stage_backward(st: Stage, x: np.ndarray, ss: np.ndarray, invstd: np.ndarray, dout: np.ndarray, peak: Peak,
                   tag: str) -> tuple:
    """Pass 1: each chunk's y rebuilt (conv, then the batch norm with the saved scale and shift), (Σdy, Σdy·x̂)
    carried; pass 2, last chunk first: y rebuilt again (the last chunk's kept from pass 1), dx of the batch norm over
    it, the conv's backward-data into dx and its weight gradient, summed last chunk first."""
    z_shape = st.out_shape(x.shape)
    C = z_shape[1]
    sums = np.empty((C, 2))
    y = peak.hold(f"{tag}.y", np.empty(chunk_of(z_shape), np.float32))
    ws_f = peak.hold(f"{tag}.wsf", st.ws(chunk_of(x.shape), "forward"))
    ws_b = peak.hold(f"{tag}.wsb", np.empty(max(st.ws(chunk_of(x.shape), "backward_data").size,
                                                st.ws(chunk_of(x.shape), "backward_weight").size), np.float32))
    dx = peak.hold(f"{tag}.dx", np.empty(x.shape, np.float32))
    dw, partial = np.empty_like(st.w), np.empty_like(st.w)

    def rebuild(a: int, b: int) -> np.ndarray:
        yc = y[:b - a]
        st.conv(x[a:b], yc, ws_f)
        bnk.batchnorm_chunk_apply(yc, ss, None, None, yc)
        return yc

    for a, b in chunks(x.shape[0]):
        yc = rebuild(a, b)
        bnk.batchnorm_chunk_gradient_sums(yc, dout[a:b], st.gamma, st.beta, sums, a == 0, st.act)
    last = yc
    dbeta, dgamma = sums[:, 0].copy(), sums[:, 1].copy()
    count = z_shape[0] * z_shape[2] * z_shape[3]
    for i, (a, b) in enumerate(reversed(chunks(x.shape[0]))):
        yc = last if i == 0 else rebuild(a, b)
        bnk.batchnorm_chunk_dx(yc, dout[a:b], st.gamma, st.beta, invstd, sums, count, yc, st.act)
        st.data(yc, dx[a:b], ws_b)
        st.weight(x[a:b], yc, dw if i == 0 else partial, ws_b)
        if i:
            np.add(dw, partial, out=dw)
    peak.drop(f"{tag}.y", f"{tag}.wsf", f"{tag}.wsb")
    return dx, dw, dgamma, dbeta


def separate(s1: Stage, s2: Stage, x: np.ndarray, dout: np.ndarray, rebuild: bool = False) -> dict[str, np.ndarray]:
    """The two chains one after the other: the intermediate whole (kept from the forward, or with ``rebuild`` made
    again before the second chain's backward, as the offload plan's "x" rebuild does under a limit: each chunk's
    conv and batch norm with the saved scale and shift) and its gradient whole."""
    peak = Peak()
    r1, r2 = s1.fresh_running(), s2.fresh_running()
    a1, ss1, inv1 = stage_forward(s1, x, r1)
    out, ss2, inv2 = stage_forward(s2, a1, r2)
    if rebuild:
        ws = s1.ws(chunk_of(x.shape), "forward")
        for a, b in chunks(x.shape[0]):
            s1.conv(x[a:b], a1[a:b], ws)
            bnk.batchnorm_chunk_apply(a1[a:b], ss1, s1.act, None, a1[a:b])
    peak.hold("dout", dout)
    peak.hold("x", x)
    peak.hold("a1", a1)  # the second chain keeps its input for its weight gradient
    da1, dw2, dg2, db2 = stage_backward(s2, a1, ss2, inv2, dout, peak, "2")
    peak.drop("a1")
    dx, dw1, dg1, db1 = stage_backward(s1, x, ss1, inv1, da1, peak, "1")
    return {"out": out, "rm1": r1[0], "rv1": r1[1], "rm2": r2[0], "rv2": r2[1], "dx": dx, "dw1": dw1, "dg1": dg1,
            "db1": db1, "dw2": dw2, "dg2": dg2, "db2": db2, "peak": np.array(peak.most)}


# ---- the pair ---------------------------------------------------------------------------------------------------

def pair(s1: Stage, s2: Stage, x: np.ndarray, dout: np.ndarray) -> dict[str, np.ndarray]:
    """Both chains chunk by chunk (module docstring): the intermediate is never whole."""
    peak = Peak()
    r1, r2 = s1.fresh_running(), s2.fresh_running()
    N = x.shape[0]
    z1_shape = s1.out_shape(x.shape)
    z2_shape = s2.out_shape(z1_shape)
    C1, C2 = z1_shape[1], z2_shape[1]
    count1, count2 = N * z1_shape[2] * z1_shape[3], N * z2_shape[2] * z2_shape[3]
    sums1, sums2 = np.empty((C1, 3)), np.empty((C2, 3))
    ss1, ss2 = np.empty((C1, 2)), np.empty((C2, 2))
    inv1, inv2 = np.empty(C1, np.float32), np.empty(C2, np.float32)
    ws1 = s1.ws(chunk_of(x.shape), "forward")
    ws2 = s2.ws(chunk_of(z1_shape), "forward")
    z1 = np.empty(chunk_of(z1_shape), np.float32)
    out = np.empty(z2_shape, np.float32)
    for a, b in chunks(N):  # pass A: the first statistics
        s1.conv(x[a:b], z1[:b - a], ws1)
        bnk.batchnorm_chunk_statistics(z1[:b - a], sums1, a == 0)
    bnk.batchnorm_chunk_finish(sums1, count1, s1.gamma, s1.beta, *r1, ss1, inv1, MOMENTUM, EPS)
    for a, b in chunks(N):  # pass B: the first chain's output chunk, the second conv, its statistics
        c = z1[:b - a]
        s1.conv(x[a:b], c, ws1)
        bnk.batchnorm_chunk_apply(c, ss1, s1.act, None, c)
        s2.conv(c, out[a:b], ws2)
        bnk.batchnorm_chunk_statistics(out[a:b], sums2, a == 0)
    bnk.batchnorm_chunk_finish(sums2, count2, s2.gamma, s2.beta, *r2, ss2, inv2, MOMENTUM, EPS)
    for a, b in reversed(chunks(N)):  # pass C: normalized and activated in place
        bnk.batchnorm_chunk_apply(out[a:b], ss2, s2.act, None, out[a:b])

    peak.hold("dout", dout)
    peak.hold("x", x)
    dx = peak.hold("dx", np.empty(x.shape, np.float32))
    y1 = peak.hold("y1", np.empty(chunk_of(z1_shape), np.float32))
    a1 = peak.hold("a1", np.empty(chunk_of(z1_shape), np.float32))  # then da1: a1 is read for the last time first
    y2 = peak.hold("y2", np.empty(chunk_of(z2_shape), np.float32))
    wsf1, wsf2 = peak.hold("wsf1", s1.ws(chunk_of(x.shape), "forward")), peak.hold("wsf2", ws2)
    wsb = peak.hold("wsb", np.empty(max(s.ws(chunk_of(shape), d).size for s, shape in ((s1, x.shape), (s2, z1_shape))
                                        for d in ("backward_data", "backward_weight")), np.float32))
    g1, g2 = np.empty((C1, 2)), np.empty((C2, 2))
    dw1, dw2, p1, p2 = np.empty_like(s1.w), np.empty_like(s2.w), np.empty_like(s1.w), np.empty_like(s2.w)

    def rebuild(a: int, b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        n = b - a
        y1c, a1c, y2c = y1[:n], a1[:n], y2[:n]
        s1.conv(x[a:b], y1c, wsf1)
        bnk.batchnorm_chunk_apply(y1c, ss1, None, None, y1c)
        if s1.act is None:
            a1c[...] = y1c
        else:
            getattr(ew, f"{s1.act}_forward")(y1c, a1c)
        s2.conv(a1c, y2c, wsf2)
        bnk.batchnorm_chunk_apply(y2c, ss2, None, None, y2c)
        return y1c, a1c, y2c

    for a, b in chunks(N):  # pass 1: the second batch norm's sums
        _, _, y2c = rebuild(a, b)
        bnk.batchnorm_chunk_gradient_sums(y2c, dout[a:b], s2.gamma, s2.beta, g2, a == 0, s2.act)
    for a, b in chunks(N):  # pass 2: the second chain's dx and backward-data, the first batch norm's sums
        y1c, a1c, y2c = rebuild(a, b)
        bnk.batchnorm_chunk_dx(y2c, dout[a:b], s2.gamma, s2.beta, inv2, g2, count2, y2c, s2.act)
        s2.data(y2c, a1c, wsb)  # a1c is dead after the second conv: da1 goes over it
        bnk.batchnorm_chunk_gradient_sums(y1c, a1c, s1.gamma, s1.beta, g1, a == 0, s1.act)
    for i, (a, b) in enumerate(reversed(chunks(N))):  # pass 3, last chunk first: dx and the weight gradients
        y1c, a1c, y2c = rebuild(a, b)
        bnk.batchnorm_chunk_dx(y2c, dout[a:b], s2.gamma, s2.beta, inv2, g2, count2, y2c, s2.act)
        s2.weight(a1c, y2c, dw2 if i == 0 else p2, wsb)  # a1c's last read
        s2.data(y2c, a1c, wsb)
        bnk.batchnorm_chunk_dx(y1c, a1c, s1.gamma, s1.beta, inv1, g1, count1, y1c, s1.act)
        s1.data(y1c, dx[a:b], wsb)
        s1.weight(x[a:b], y1c, dw1 if i == 0 else p1, wsb)
        if i:
            np.add(dw2, p2, out=dw2)
            np.add(dw1, p1, out=dw1)
    return {"out": out, "rm1": r1[0], "rv1": r1[1], "rm2": r2[0], "rv2": r2[1], "dx": dx, "dw1": dw1,
            "dg1": g1[:, 1].copy(), "db1": g1[:, 0].copy(), "dw2": dw2, "dg2": g2[:, 1].copy(),
            "db2": g2[:, 0].copy(), "peak": np.array(peak.most)}


# ---- the reference, the cases, validate then time ---------------------------------------------------------------

def torch_float64(s1: Stage, s2: Stage, x: np.ndarray, dout: np.ndarray) -> dict[str, np.ndarray]:
    """The same two chains in PyTorch float64 (training-mode batch norm): the math the bits must round."""
    import torch
    import torch.nn.functional as F

    def chain(st: Stage, inp):
        w = torch.tensor(st.w, dtype=torch.float64, requires_grad=True)
        g = torch.tensor(st.gamma, dtype=torch.float64, requires_grad=True)
        b = torch.tensor(st.beta, dtype=torch.float64, requires_grad=True)
        z = F.conv2d(inp, w, None, st.stride, st.pad, 1, st.groups)
        y = F.batch_norm(z, None, None, g, b, training=True, eps=EPS)
        return (F.hardtanh(y, 0.0, 6.0) if st.act == "relu6" else y), (w, g, b)

    xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    a1, p1 = chain(s1, xt)
    out, p2 = chain(s2, a1)
    out.backward(torch.tensor(dout, dtype=torch.float64))
    return {"out": out.detach().numpy(), "dx": xt.grad.numpy(), "dw1": p1[0].grad.numpy(), "dg1": p1[1].grad.numpy(),
            "db1": p1[2].grad.numpy(), "dw2": p2[0].grad.numpy(), "dg2": p2[1].grad.numpy(),
            "db2": p2[2].grad.numpy()}


CASES = {
    # MobileNetV2 at 224 (torchvision's features.N), its pairs of chunked chains: (input channels, plane), then each
    # stage's (weight shape, stride, pad, groups, activation)
    "features.1 dw 32 @112 → 1×1 32→16":
        ((32, 112), ((32, 1, 3, 3), 1, 1, 32, "relu6"), ((16, 32, 1, 1), 1, 0, 1, None)),
    "features.2 1×1 16→96 @112 → dw s2":
        ((16, 112), ((96, 16, 1, 1), 1, 0, 1, "relu6"), ((96, 1, 3, 3), 2, 1, 96, "relu6")),
    "features.3 1×1 24→144 @56 → dw":
        ((24, 56), ((144, 24, 1, 1), 1, 0, 1, "relu6"), ((144, 1, 3, 3), 1, 1, 144, "relu6")),
}


def make_case(spec: tuple, batch: int, plane: int | None = None, seed: int = 0) -> tuple[Stage, Stage, np.ndarray,
                                                                                            np.ndarray]:
    (C, H), first, second = spec
    H = plane or H
    rng = np.random.default_rng(seed)

    def stage(shape, stride, pad, groups, act):
        fan_in = shape[1] * shape[2] * shape[3]
        return Stage((rng.standard_normal(shape) * np.sqrt(2.0 / fan_in)).astype(np.float32), stride, pad, groups,
                     (1 + 0.1 * rng.standard_normal(shape[0])).astype(np.float32),
                     (0.1 * rng.standard_normal(shape[0])).astype(np.float32), act)

    s1, s2 = stage(*first), stage(*second)
    x = rng.standard_normal((batch, C, H, H)).astype(np.float32)
    dout = rng.standard_normal(s2.out_shape(s1.out_shape(x.shape))).astype(np.float32)
    return s1, s2, x, dout


def check(batch: int = 21, plane: int = 12, verbose: bool = True) -> list[str]:
    """The pair against the separate chains (bit for bit) and both against PyTorch float64, on every case at
    ``batch`` images (21: chunks of 8, 8 and 5, so that an order of three sums shows) of ``plane`` pixels. Returns
    the mismatches (empty: all agree)."""
    problems = []
    for name, spec in CASES.items():
        s1, s2, x, dout = make_case(spec, batch, plane)
        a, b = separate(s1, s2, x, dout), pair(s1, s2, x, dout)
        ref = torch_float64(s1, s2, x, dout)
        for key, value in a.items():
            if key == "peak":
                continue
            if not np.array_equal(value, b[key]):
                problems.append(f"{name}: {key} differs between the pair and the separate chains")
            if key in ref:
                scale = max(float(np.abs(ref[key]).max()), 1e-30)
                error = float(np.abs(value - ref[key]).max()) / scale
                if error > 1e-4:
                    problems.append(f"{name}: {key} is {error:.1e} off float64 (relative to its largest entry)")
        if verbose:
            verdict = "MISMATCH" if any(p.startswith(name) for p in problems) else "same bits"
            print(f"{name}: {verdict}; held at the worst moment {int(a['peak']) / 2**20:.2f} → "
                  f"{int(b['peak']) / 2**20:.2f} MiB")
    return problems


def timed(fn, *args, repeat: int) -> float:
    seconds = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn(*args)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of the two ways")
    parser.add_argument("--repeat", type=int, default=3, help="calls per round (median)")
    parser.add_argument("--check-only", action="store_true")
    args = parser.parse_args()
    problems = check()
    if problems:
        print("\n".join(problems))
        return 1
    if args.check_only:
        return 0
    print(f"\nbatch {args.batch_size}, forward + backward, ms (median of {args.repeat} calls, {args.rounds} rounds "
          "alternating); held at the worst moment, MiB")
    print("separate: the intermediate kept from the forward; rebuilt: made again before the second chain's backward")
    print(f"{'pair':<36} {'separate':>18} {'rebuilt':>18} {'pair':>18} {'held separate':>14} {'held pair':>10}")
    ways = {"separate": separate, "rebuilt": lambda *case: separate(*case, rebuild=True), "pair": pair}
    for name, spec in CASES.items():
        s1, s2, x, dout = make_case(spec, args.batch_size)
        for fn in ways.values():  # warm: kernels loaded, pages touched
            fn(s1, s2, x, dout)
        times: dict[str, list[float]] = {way: [] for way in ways}
        for _ in range(args.rounds):
            for way, fn in ways.items():
                times[way].append(timed(fn, s1, s2, x, dout, repeat=args.repeat))
        held = [int(fn(s1, s2, x, dout)["peak"]) / 2**20 for fn in (separate, pair)]
        cells = [" / ".join(f"{1e3 * t:.0f}" for t in times[w]) for w in ways]
        print(f"{name:<36} {cells[0]:>18} {cells[1]:>18} {cells[2]:>18} {held[0]:>14.1f} {held[1]:>10.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

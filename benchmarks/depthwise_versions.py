"""Two conv study versions alternating on MobileNetV2's depthwise shapes, in one process.

    PYTHONPATH=$PWD python benchmarks/depthwise_versions.py --versions 23,25 --threads 2 --rounds 5

Each round times every (shape, direction) once per version, best of ``--repeat`` calls, the versions
alternating call block by call block; the figure is the median of the rounds' bests, ms. The
versions run through ``conv_study.conv2d_version`` with their own scratch, as ``engine kernels``
times them; a version's first call (the compile) is made before any timing.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def best_ms(function, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        function()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def calls(version: int, x, w, dout):
    from kernels.cpu import conv_study

    c = x.shape[1]
    stride = x.shape[2] // dout.shape[2]
    out, dx, dw = np.empty_like(dout), np.empty_like(x), np.empty_like(w)
    made = {}
    for direction in ("forward", "data", "weight"):
        size = conv_study.conv2d_version_workspace_size(version, direction, x.shape, w.shape, stride, 1, c)
        scratch = np.empty(max(1, size), np.float32)
        kernel = conv_study.conv2d_version(version, direction)
        if direction == "forward":
            made[direction] = lambda k=kernel, s=scratch: k(x, w, None, out, stride, 1, c, s)
        elif direction == "data":
            made[direction] = lambda k=kernel, s=scratch: k(dout, w, dx, stride, 1, c, s)
        else:
            made[direction] = lambda k=kernel, s=scratch: k(x, dout, dw, None, stride, 1, c, s)
    return made


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", default="23,25")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--min-pixels", type=int, default=16, help="planes of at least this many pixels")
    parser.add_argument("--max-pixels", type=int, default=256, help="planes of at most this many pixels")
    args = parser.parse_args()

    from engine.threads import set_threads

    set_threads(args.threads)
    from engine.bench.kernels import mobilenetv2_convs

    versions = [int(v) for v in args.versions.split(",")]
    shapes = [s for s in mobilenetv2_convs(args.batch_size) if s.groups > 1
              and args.min_pixels <= s.x_shape[2] * s.x_shape[3] <= args.max_pixels]
    rng = np.random.default_rng(0)
    print(f"batch {args.batch_size}, {args.threads} threads, median of {args.rounds} rounds of best-of-"
          f"{args.repeat}, ms, " + " → ".join(f"v{v}" for v in versions))
    for shape in shapes:
        x = rng.standard_normal(shape.x_shape, dtype=np.float32)
        w = rng.standard_normal(shape.w_shape, dtype=np.float32)
        dout = rng.standard_normal(shape.out_shape, dtype=np.float32)
        runs = {v: calls(v, x, w, dout) for v in versions}
        for made in runs.values():
            for function in made.values():
                function()
        times = {(v, d): [] for v in versions for d in ("forward", "data", "weight")}
        for _ in range(args.rounds):
            for direction in ("forward", "data", "weight"):
                for v in versions:
                    times[v, direction].append(best_ms(runs[v][direction], args.repeat))
        cells = []
        for direction in ("forward", "data", "weight"):
            figures = " → ".join(f"{statistics.median(times[v, direction]):.3f}" for v in versions)
            cells.append(f"{direction} {figures}")
        label = f"dw {shape.x_shape[1]} s{shape.stride} @{shape.x_shape[2]}x{shape.x_shape[3]}"
        print(f"{label:20s} " + "   ".join(cells), flush=True)


if __name__ == "__main__":
    main()

"""A/B of two numbered conv versions on the layers whose path they route differently (issue 32, the 224 shapes).

    python benchmarks/conv_ab.py --image-size 224 --versions 39 40          # v40: 256->512 @14 off im2col
    python benchmarks/conv_ab.py --image-size 224 --versions 38 39          # v39: the ImageNet stems off im2col
    python benchmarks/conv_ab.py --image-size 224 --versions 37 38          # v38: F(2×2) forwards vs F(4×4) (fast)
    python benchmarks/conv_ab.py --image-size 32 --versions 37 38           # the same on the CIFAR layers
    python benchmarks/conv_ab.py --image-size 224 --versions 40 42          # v41: 56x56 on Winograd; v42: im2col back
    python benchmarks/conv_ab.py --image-size 224 --versions 42 42 --set winograd4=0   # a rule not exported

For every conv layer of ``--models`` at ``--image-size`` (the variant ``engine train`` picks for that size) and every
direction it runs in training (no backward-data for the stem), the path each version takes
(``kernels.cpu.conv_study._paths``, versions ≥ 23; ``--set FLAG=0|1`` changes B's ``conv.Paths`` flags: a rule not
exported yet); where they differ, both are timed at ``--batch-size`` in this process,
alternating A, B, A, B … for ``--rounds`` rounds of best-of-``--repeat`` calls, each side's best round kept, and
their ratio printed (B / A: below 1 means B is faster). The last line sums each side over the layers as often as the
model runs them per step. Timings mean something only on a quiet machine.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter

import numpy as np


def layer_calls(models, image_size: int, batch: int) -> Counter:
    """(model, x_shape, w_shape, stride, pad, groups, direction) → calls per training step."""
    from engine.graph import GRAPH_INPUT
    from models import GRAPHS, resolve_variant

    calls: Counter = Counter()
    for model in models:
        graph = GRAPHS[model](num_classes=10, image_size=image_size, variant=resolve_variant(model, None, image_size))
        shapes = graph.shapes(batch)
        for node in graph.nodes:
            layer = node.layer
            if type(layer).__name__ != "Conv2d":
                continue
            r = layer.kernel_size
            geometry = (model, tuple(shapes[node.inputs[0]]), (layer.out_channels, layer.in_channels // layer.groups,
                        r, r), layer.stride, layer.padding, layer.groups)
            for direction in ("forward", "data", "weight"):
                if direction == "data" and node.inputs[0] == GRAPH_INPUT:
                    continue
                calls[(*geometry, direction)] += 1
    return calls


def _call(paths, direction: str, arrays: dict, geometry: tuple):
    from kernels.cpu import conv

    _, x_shape, w_shape, stride, pad, groups = geometry
    size = conv.workspace_size(x_shape, w_shape, stride, pad, groups, direction, paths)
    scratch = np.empty(max(size, 1), np.float32)
    x, w, out = arrays["x"], arrays["w"], arrays["out"]
    if direction == "forward":
        return lambda: conv.forward(x, w, None, out, stride, pad, groups, scratch, paths)
    if direction == "data":
        return lambda: conv.backward_data(out, w, x, stride, pad, groups, scratch, paths)
    return lambda: conv.backward_weight(x, out, w, None, stride, pad, groups, scratch, paths)


def _best(call, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--versions", type=int, nargs=2, required=True, metavar=("A", "B"))
    parser.add_argument("--models", nargs="+", default=["resnet18", "mobilenetv2"])
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--set", nargs="*", default=[], metavar="FLAG=0|1", help="B's conv.Paths flags changed")
    args = parser.parse_args()
    if args.threads:
        import numba

        numba.set_num_threads(args.threads)
    import dataclasses

    from kernels.cpu import conv, conv_study

    a, b = args.versions
    if min(a, b) < 23:
        parser.error("--versions: 23 or later (earlier ones have kernels of their own; engine kernels times them)")
    flags = {name: value.strip() not in ("0", "false", "False") for name, value in (s.split("=", 1) for s in args.set)}
    sides = (conv_study._paths(a), dataclasses.replace(conv_study._paths(b), **flags))
    b_name = f"v{b}" + "".join(f" {k}={int(v)}" for k, v in flags.items())
    print(f"| layer | direction | calls/step | v{a} path | {b_name} path | v{a} ms | {b_name} ms | B / A |")
    print("|---|---|---|---|---|---|---|---|")
    total = [0.0, 0.0]
    rng = np.random.default_rng(0)
    for key, count in layer_calls(args.models, args.image_size, args.batch_size).items():
        *geometry, direction = key
        _, x_shape, w_shape, stride, pad, groups = geometry
        kinds = [conv.path(x_shape, w_shape, stride, pad, groups, direction, side) for side in sides]
        if kinds[0] == kinds[1]:
            continue
        out_shape = (x_shape[0], w_shape[0], *conv.check_conv2d_shapes(x_shape, w_shape, stride, pad, groups))
        arrays = {"x": rng.standard_normal(x_shape, dtype=np.float32),
                  "w": rng.standard_normal(w_shape, dtype=np.float32),
                  "out": rng.standard_normal(out_shape, dtype=np.float32)}
        calls = [_call(side, direction, arrays, tuple(geometry)) for side in sides]
        for call in calls:
            call()  # compile or load, and warm
        best = [float("inf"), float("inf")]
        for _ in range(args.rounds):
            for side in (0, 1):
                best[side] = min(best[side], _best(calls[side], args.repeat))
        total[0] += count * best[0]
        total[1] += count * best[1]
        label = f"{geometry[0]} {w_shape[1] * groups}->{w_shape[0]} {w_shape[2]}x{w_shape[3]} s{stride} @{x_shape[2]}"
        print(f"| {label} | {direction} | {count} | {kinds[0]} | {kinds[1]} | {best[0] * 1e3:.2f} | "
              f"{best[1] * 1e3:.2f} | {best[1] / best[0]:.3f} |", flush=True)
    if total[0]:
        print(f"| per step, the layers above | | | | | {total[0] * 1e3:.1f} | {total[1] * 1e3:.1f} | "
              f"{total[1] / total[0]:.3f} |")


if __name__ == "__main__":
    main()

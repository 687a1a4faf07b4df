"""Where a training step's time goes, by layer type and direction: a ``NetworkHook`` times each node's forward and
backward call (the layer's kernels and its own Python) over ``--steps`` steps after two unmeasured ones.

    python benchmarks/step_profile.py --model resnet18 --image-size 224     # the ImageNet variant above 64 px
    python benchmarks/step_profile.py --model mobilenetv2 --image-size 32 --batch-size 32
    python benchmarks/step_profile.py --model resnet18 --nodes 25                # and the 25 slowest node calls
    python benchmarks/step_profile.py --model mobilenetv2 --chunks recompute     # every chunked layer recomputing

Timings mean something on a quiet machine only. The per-type sums leave out the loss head, the iteration's own
bookkeeping and the optimizer (``engine train`` updates in backward; here no optimizer is attached).
"""

from __future__ import annotations

import argparse
import collections
import time

import numpy as np


class LayerTimes:
    """Seconds per (direction, layer type), summed while ``on``."""

    def __init__(self) -> None:
        self.seconds: dict[tuple[str, str], float] = collections.defaultdict(float)
        self.by_node: dict[tuple[str, str], float] = collections.defaultdict(float)
        self.on = False
        self._start = 0.0

    def before_forward(self, step, node) -> None:
        self._start = time.perf_counter()

    def after_forward(self, step, node) -> None:
        if self.on:
            seconds = time.perf_counter() - self._start
            self.seconds[("forward", type(node.layer).__name__)] += seconds
            self.by_node[("forward", node.name)] += seconds

    def before_backward(self, step, node) -> None:
        self._start = time.perf_counter()

    def after_backward(self, step, node) -> None:
        if self.on:
            seconds = time.perf_counter() - self._start
            self.seconds[("backward", type(node.layer).__name__)] += seconds
            self.by_node[("backward", node.name)] += seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--nodes", type=int, default=0, help="also print this many slowest (direction, node) calls")
    parser.add_argument("--chunks", choices=["keep", "recompute"], default="keep",
                        help="what the chunked layers (224 px) do: engine train's --chunks keep or recompute")
    args = parser.parse_args()

    from engine.backend import get_backend
    from models import build_model, resolve_variant

    variant = resolve_variant(args.model, None, args.image_size)
    net = build_model(args.model, num_classes=1000 if variant == "imagenet" else 10, backend=get_backend("cpu"),
                      seed=0, variant=variant, image_size=args.image_size)
    if args.chunks == "recompute":
        net.set_recomputed([node.name for node in net.chunked])
    times = LayerTimes()
    net.hooks.append(times)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.batch_size, 3, args.image_size, args.image_size)).astype(np.float32)
    labels = rng.integers(0, 10, args.batch_size)
    steps = []
    for i in range(args.steps + 2):
        times.on = i >= 2
        start = time.perf_counter()
        net.forward(x, training=True)
        net.loss(labels)
        net.backward()
        if times.on:
            steps.append(time.perf_counter() - start)
    print(f"{args.model} ({variant}, --chunks {args.chunks}) at {args.image_size}×{args.image_size}, batch "
          f"{args.batch_size}: step "
          f"{np.median(steps) * 1e3:.0f} ms (median of {args.steps})")
    for (direction, kind), seconds in sorted(times.seconds.items(), key=lambda item: -item[1]):
        print(f"  {direction:8s} {kind:16s} {seconds / args.steps * 1e3:8.1f} ms a step")
    print(f"  {'sum':25s} {sum(times.seconds.values()) / args.steps * 1e3:8.1f} ms a step")
    layers = {node.name: node.layer for node in net.graph.nodes}
    for (direction, name), seconds in sorted(times.by_node.items(), key=lambda item: -item[1])[:args.nodes]:
        print(f"  {direction:8s} {seconds / args.steps * 1e3:8.1f} ms  {name}  {layers[name]!r}"[:160])


if __name__ == "__main__":
    main()

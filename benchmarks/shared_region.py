"""The offload units and the step arena's tensors in one region (``engine.offload.plan.place_around``), against the
two arenas side by side: per model, batch size and window, what each layout needs. Nothing is run (plans only).

    python benchmarks/shared_region.py                                   # ImageNet variants at 224, batch 32 and 128
    python benchmarks/shared_region.py --models resnet18 --batch-sizes 32 --windows 1,4 --chunks keep

Columns, MiB: the step arena alone (activation gradients, working memory, per-layer gradients: its planned peak),
the units' own arena (the offload plan of that window), the two side by side, the units placed around the step
arena's own layout, both placed together (TFLite's order over all of them), the region ``place_around`` chooses
(the smaller, never more than side by side, plus the rebuilds' working memory on top), and the most both hold at
one moment (what no placement can beat).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MIB = 2**20


def rows(models: list[str], batch_sizes: list[int], windows: list[int], chunks: str, image_size: int) -> list[dict]:
    from engine.backend import get_backend
    from engine.memory.planner import lower_bound
    from engine.offload.plan import PAGE, align, build_plan, place_around, program_units, recompute_candidates
    from engine.offload.scheduler import step_arena_tensors
    from models import build_model

    found = []
    for model in models:
        net = build_model(model, 1000, get_backend("cpu"), variant="imagenet", image_size=image_size)
        net.set_gradient_storage("per_layer")  # engine train's default: each layer updated in its backward
        if chunks == "recompute":
            net.set_recomputed([node.name for node in net.chunked])
        for batch in batch_sizes:
            program = net.program(batch)
            units, _, steps = program_units(program)
            candidates = recompute_candidates(program, units)
            tensors, step_bytes = step_arena_tensors(net, batch)
            for window in windows:
                plan = build_plan(units, window, steps, candidates)
                layout = place_around(plan, tensors, step_bytes)
                unit_spans = [[(o.start, o.end) for o in u.occupations] for u in plan.units.values()]
                both = lower_bound([t.nbytes for t in tensors] + [u.nbytes for u in plan.units.values()],
                                   [[(t.first, t.last)] for t in tensors] + unit_spans)
                found.append({"model": model, "batch_size": batch, "window": window, "chunks": chunks,
                              "step_arena_bytes": step_bytes, "units_arena_bytes": plan.arena_bytes,
                              "apart_bytes": align(step_bytes, PAGE) + plan.arena_bytes,
                              "region_bytes": layout.region_bytes,
                              "placed": "together" if layout.step_offsets is not None else (
                                  "apart" if layout.region_bytes >= align(step_bytes, PAGE) + plan.arena_bytes
                                  else "around"),
                              "extra_bytes": layout.extra_bytes, "lower_bound_bytes": both})
        net.close()
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="resnet18,mobilenetv2")
    parser.add_argument("--batch-sizes", default="32,128")
    parser.add_argument("--windows", default="1")
    parser.add_argument("--chunks", choices=["keep", "recompute"], default="recompute")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--json", help="Also write the rows here.")
    args = parser.parse_args()
    found = rows(args.models.split(","), [int(b) for b in args.batch_sizes.split(",")],
                 [int(w) for w in args.windows.split(",")], args.chunks, args.image_size)
    print(f"{'model':12s} {'batch':>5s} {'N':>2s} {'step arena':>10s} {'units':>8s} {'apart':>8s} "
          f"{'one region':>10s} {'placed':>8s} {'lower bound':>11s}")
    for r in found:
        print(f"{r['model']:12s} {r['batch_size']:5d} {r['window']:2d} {r['step_arena_bytes'] / MIB:10.1f} "
              f"{r['units_arena_bytes'] / MIB:8.1f} {r['apart_bytes'] / MIB:8.1f} {r['region_bytes'] / MIB:10.1f} "
              f"{r['placed']:>8s} {r['lower_bound_bytes'] / MIB:11.1f}")
    print(f"MiB; ImageNet variants at {args.image_size}x{args.image_size}, --chunks {args.chunks}; "
          "'one region' includes the rebuilds' working memory on top")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(found, f, indent=2)


if __name__ == "__main__":
    main()

"""Where a CUDA training step's GPU time goes: every distinct launch timed without the host in it.

    python benchmarks/gpu_kernel_profile.py --output $OUT/kernel_profile.json
    python benchmarks/gpu_kernel_profile.py --dry      # the simulator, a tiny cnn (what the test runs)

``engine kernels --backend cuda`` times one launch between two CUDA events: a kernel shorter than the
host's launch cost (~80 µs on the first H100 run) reads as that cost, because the GPU waits for the
launch between the events. Here each distinct launch of one SGD step (``counted_step``: recorded
under ``count_only``, replayed on fresh arrays of the same shapes) is captured ``--copies`` times
into one CUDA graph on a non-blocking stream, and the graph's replay is timed with events: the
launches reach the GPU back to back, so ms / copies is the kernel's own time. The sum over a step
(each launch × how often the step runs it) is what a captured step's GPU time should be; the table
groups it by kernel, largest first, beside the roofline (engine/bench/roofline.py).

Steps profiled: ResNet-18 CIFAR batch 32 (the issue's goal step) and ResNet-18's ImageNet variant at
224×224, batch 8 (the size the GPU session trains at). ``--dry``: the simulator, wall time, a tiny
cnn, so the script is known to run before a GPU is lent (tests/engine/test_gpu_session_cudasim.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STEPS = [("resnet18", {}, 32, 32), ("resnet18", {"variant": "imagenet"}, 224, 8)]
DRY_STEPS = [("cnn", {}, 4, 2)]


def graph_timer(backend: Any, copies: int) -> Any:
    """A function timing ``call`` as ms per launch: ``copies`` launches captured into one CUDA graph, the
    replay timed with events (the best of ``repeat``). Under the simulator: wall time of one call."""
    if backend.name != "cuda":
        def wall(call: Any, repeat: int) -> float:
            start = time.perf_counter()
            call()
            return (time.perf_counter() - start) * 1e3

        return wall
    cupy = backend.xp
    stream = cupy.cuda.Stream(non_blocking=True)

    def timed(call: Any, repeat: int) -> float:
        with stream:
            call()  # compiles, and the arrays' earlier writes are done before the capture
            stream.synchronize()
            stream.begin_capture()
            try:
                for _ in range(copies):
                    call()
            finally:
                graph = stream.end_capture()
            graph.launch(stream)  # the first replay uploads the graph
            best = float("inf")
            for _ in range(max(1, repeat)):
                start, end = cupy.cuda.Event(), cupy.cuda.Event()
                start.record(stream)
                graph.launch(stream)
                end.record(stream)
                end.synchronize()
                best = min(best, cupy.cuda.get_elapsed_time(start, end) / copies)
        return best

    return timed


def profile_step(model: str, options: dict[str, Any], image: int, batch: int, backend: Any, copies: int,
                 repeat: int) -> dict[str, Any]:
    """``engine.bench.cuda_timing.time_step_kernels`` with the graph timer, summed by kernel."""
    from engine.bench.cuda_timing import time_step_kernels
    from engine.bench.roofline import DEVICES

    timed = graph_timer(backend, copies)
    roof = DEVICES[1].name  # H100 SXM5: the roofline table's GPU (the H200 has the same fp32 peak)
    rows = time_step_kernels(model, batch, backend, image_size=image, measure=lambda call: timed(call, repeat),
                             **options)
    by_kernel: dict[str, dict[str, float]] = defaultdict(lambda: {"launches": 0, "ms": 0.0, "roofline_ms": 0.0})
    for row in rows:
        total = by_kernel[row.kernel]
        total["launches"] += row.per_step
        total["ms"] += row.ms * row.per_step
        total["roofline_ms"] += row.roofline_ms[roof] * row.per_step
    kernels = sorted(({"kernel": k, **v} for k, v in by_kernel.items()), key=lambda r: -r["ms"])
    return {"model": model, "options": options, "image_size": image, "batch": batch,
            "launches": sum(r.per_step for r in rows), "distinct_launches": len(rows),
            "step_kernel_ms": sum(r["ms"] for r in kernels), "step_roofline_ms": sum(r["roofline_ms"] for r in kernels),
            "roofline_device": roof, "kernels": kernels}


def render(result: dict[str, Any], top: int, dry: bool = False) -> str:
    timing = "simulator wall time" if dry else "graph-timed"
    lines = [f"{result['model']} {result['options'] or ''} {result['image_size']}x{result['image_size']} "
             f"batch {result['batch']}: {result['launches']} launches ({result['distinct_launches']} distinct), "
             f"kernels {result['step_kernel_ms']:.2f} ms a step ({timing}), roofline "
             f"{result['step_roofline_ms']:.2f} ms ({result['roofline_device']})",
             "| kernel | launches | ms a step | share | roofline ms |", "|---|---|---|---|---|"]
    total = result["step_kernel_ms"] or 1.0
    for r in result["kernels"][:top]:
        lines.append(f"| {r['kernel']} | {r['launches']} | {r['ms']:.3f} | {100 * r['ms'] / total:.1f}% | "
                     f"{r['roofline_ms']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry", action="store_true", help="the CUDA simulator at tiny sizes (no GPU)")
    parser.add_argument("--copies", type=int, default=20, help="launches captured into one timed graph")
    parser.add_argument("--repeat", type=int, default=3, help="timed replays; the best counts")
    parser.add_argument("--top", type=int, default=15, help="kernels shown per step")
    parser.add_argument("--output", default=None, help="JSON report")
    options = parser.parse_args(argv)
    from engine.backend import get_backend

    backend = get_backend("cudasim" if options.dry else "cuda")
    steps = DRY_STEPS if options.dry else STEPS
    results = []
    for model, model_options, image, batch in steps:
        start = time.perf_counter()
        try:
            result = profile_step(model, model_options, image, batch, backend, 1 if options.dry else options.copies,
                                  1 if options.dry else options.repeat)
        except Exception as error:  # one step's failure must not hide the other's figures
            result = {"model": model, "options": model_options, "image_size": image, "batch": batch,
                      "error": f"{type(error).__name__}: {error}"}
            print(f"{model} {image}: failed: {result['error']}", flush=True)
        else:
            print(render(result, options.top, options.dry), flush=True)
        result["seconds"] = time.perf_counter() - start
        results.append(result)
    if options.output:
        Path(options.output).write_text(json.dumps({"dry": options.dry, "steps": results}, indent=1))
        print(f"written {options.output}")
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

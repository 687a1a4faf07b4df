"""The CUDA training step on a GPU: eager against one captured CUDA graph, offload on and off, 224×224.

Three parts, one JSON:

1. **Eager vs graph** (in this process, ``engine.cuda_graph.StepRunner``): ResNet-18 and MobileNetV2
   (CIFAR variants, batch 32), SGD with momentum, the same batches; images/s over the timed steps (the
   GPU drained before and after), host µs per step (time spent in ``step()``: with the graph, the
   batch, labels, scalars and dropout masks staged through pinned buffers and one graph launch; the
   host's waits for a staging buffer, i.e. for the GPU, apart as host_wait_us_per_step), and whether
   both runs end with the same weights, bit for bit.
2. **engine train** (ResNet-18 CIFAR, batch 32): the default (the step as one CUDA graph), ``--no-cuda-graph``
   (eager), ``--offload-n 4`` (its swapped bytes in pinned host memory: captured with the step, its copies in
   the graph), ``--offload-n 4 --offload-host-memory 0`` (through the swap file: eager, the IO threads) and
   ``--offload-n 4 --no-cuda-graph`` (the pinned tier's eager step, what the capture is measured against):
   steady images/s, whether the step ran as a CUDA graph (``cuda_graph``, with ``cuda_graph_eager_reason`` or
   ``cuda_graph_error`` when not), the final loss from ``--summary-json`` (the five losses must agree) and
   each offload run's summary (swap tier, stall per step, bytes moved). In this process (the click group),
   so no part compiles the kernels again.
3. **224×224** (ResNet-18 and MobileNetV2, torchvision's ImageNet variants, batch 8): ``engine train``
   with and without offload.

    python benchmarks/gpu_step_bench.py --output $OUT/step_bench.json

``--dry`` runs every part under the CUDA simulator at tiny sizes (a residual block at 2×2: the launches of
4×4 with fewer simulated threads; ``engine train --backend cudasim`` on a 4×4 cnn and, for the ImageNet
path, ResNet-18's ImageNet variant is left to the GPU: the simulator runs its kernels at any size in the
kernel tests), so a test shows the script works before a GPU is lent.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
# the offload part's third run: the swap file on disk although pinned host memory would hold the bytes (the
# second run's tier on a GPU), so the session measures both tiers (engine.offload.staging)
DISK_TIER = ("--offload-host-memory", "0")


def eager_vs_graph(model: str, batch: int, steps: int, dry: bool, log: Any = print) -> dict[str, Any]:
    """Part 1 for one model: the same steps eagerly and through a captured graph."""
    from engine.backend import get_backend
    from engine.cuda_graph import StepRunner, residual_graph
    from engine.network import Network
    from engine.optim import make_optimizer
    from models import build_model

    backend = get_backend("cudasim" if dry else "cuda")
    image = 2 if dry else 32
    rng = np.random.default_rng(0)
    batches = [(rng.standard_normal((batch, 3, image, image)).astype(np.float32),
                rng.integers(0, 3 if dry else 10, batch).astype(np.int64)) for _ in range(4)]
    dropout = 0.5 if model == "mobilenetv2" else 0.0  # the simulator's stand-in keeps the classifier's dropout
    name = f"residual block{' with dropout' if dropout else ''} (simulator, for {model})"
    result: dict[str, Any] = {"model": name if dry else model, "batch": batch, "steps": steps}
    weights = {}
    for mode in ("eager", "graph"):
        net = (Network(residual_graph(image=image, dropout=dropout), backend, seed=0) if dry
               else build_model(model, 10, backend, seed=0, image_size=image))
        runner = None
        try:
            optimizer = make_optimizer("sgd", net, backend, lambda step: 0.05 / (1 + 0.01 * step), momentum=0.9,
                                       manager=net.mgr)
            capture = False if mode == "eager" else ("record" if dry else "cupy")
            warmup = 1 if dry else 2
            runner = StepRunner(net, optimizer, capture=capture, warmup=warmup)
            if mode == "graph" and runner.eager_reason is not None:  # nothing to capture
                result["graph"], result["same_weights"] = None, None
                result["graph_error"] = f"not captured: {runner.eager_reason}"
                log(f"{model} graph: {result['graph_error']}")
                return result
            warm = warmup + 1
            for i in range(warm):  # compiles, learns the workspaces, captures (graph mode)
                runner.step(*batches[i % len(batches)])
            runner.synchronize()
            runner.host_seconds, waited = 0.0, runner.wait_seconds
            start = time.perf_counter()
            for i in range(steps):
                runner.step(*batches[(warm + i) % len(batches)])
            runner.synchronize()
            seconds = time.perf_counter() - start
            shape = next(iter(runner.shapes.values()))
            result[mode] = {
                "images_per_second": batch * steps / seconds,
                "step_ms": 1e3 * seconds / steps,
                "host_us_per_step": 1e6 * runner.host_seconds / steps,  # the host's own work
                # the host blocked on a staging buffer whose copy had not run: the GPU's time (the ring is 2 deep)
                "host_wait_us_per_step": 1e6 * (runner.wait_seconds - waited) / steps,
                "final_loss": runner.last_loss(),
                "eager_reason": runner.eager_reason,
                "graph_launches": shape.launches,
                "replays": shape.replays,
            }
            weights[mode] = np.array(backend.to_host(net.parameters.flat))
        except Exception:
            if mode == "eager":
                raise
            import traceback  # the eager figures stand; the capture's failure is the finding

            result["graph"], result["graph_error"] = None, traceback.format_exc()[-1500:]
            log(f"{model} graph: failed\n{result['graph_error']}")
            result["same_weights"] = False
            return result
        finally:
            if runner is not None:
                runner.close()
            net.close()
        log(f"{model} {mode}: {result[mode]['images_per_second']:.1f} images/s, "
            f"host {result[mode]['host_us_per_step']:.0f} µs/step")
    result["same_weights"] = bool(np.array_equal(weights["eager"], weights["graph"]))
    if result["eager"]["images_per_second"]:
        result["speedup"] = result["graph"]["images_per_second"] / result["eager"]["images_per_second"]
    return result


def train_run(args: list[str], offload: str | None, log: Any = print, timeout: float = 240,
              in_process: bool = True, offload_args: tuple[str, ...] = ()) -> dict[str, Any]:
    """``engine train`` with ``args``; its summary's figures. ``in_process``: through the click group in
    this process, so the kernels compiled by an earlier part (tens of seconds a process on a GPU host)
    are not compiled again; else a child process (``timeout`` applies there). ``offload_args``: more offload
    options (``--offload-host-memory 0``: the swap file even where pinned host memory would hold it)."""
    with tempfile.TemporaryDirectory(prefix="gpu-step-bench-") as tmp:
        summary = os.path.join(tmp, "summary.json")
        # engine train's own default prefetch, as a user runs it: with --prefetch 0 (until 2026-11-28) the
        # synthetic batch was made in the training thread between two steps, and the GPU waited for it (H200,
        # ResNet-18 CIFAR b32, 80 steps: 2,207 / 1,886 images/s with --prefetch 0, 2,965 / 2,945 without)
        argv = ["train", *args, "--no-progress", "--summary-json", summary, "--seed", "0"]
        if offload is not None:
            argv += ["--offload-n", offload, "--offload-dir", tmp, *offload_args]
        start = time.perf_counter()
        tail = ""
        if in_process:
            from cli import main as engine_main

            try:
                engine_main.main(args=argv, standalone_mode=False)
                returncode = 0
            except SystemExit as exc:
                returncode = exc.code if isinstance(exc.code, int) else 1
            except Exception as exc:  # a failed run is a figure of the report, not the end of the session
                returncode, tail = 1, f"{type(exc).__name__}: {exc}"
        else:
            try:
                done = subprocess.run([sys.executable, str(ROOT / "cli.py"), *argv], capture_output=True, text=True,
                                      cwd=ROOT, timeout=timeout)
                returncode, tail = done.returncode, (done.stdout + done.stderr)[-800:]
            except subprocess.TimeoutExpired as exc:
                returncode, tail = 124, f"timed out after {timeout} s: {str(exc.stdout or '')[-400:]}"
        figures: dict[str, Any] = {"command": "engine " + " ".join(argv), "returncode": returncode,
                                   "seconds": time.perf_counter() - start, "offload_n": offload,
                                   "offload_args": list(offload_args)}
        if returncode == 0 and os.path.exists(summary):
            with open(summary, encoding="utf-8") as handle:
                data = json.load(handle)
            for key in ("steady_images_per_second", "images_per_second", "final_loss", "peak_bytes", "offload",
                        "cuda_graph", "cuda_graph_error", "cuda_graph_eager_reason"):
                figures[key] = data.get(key)
        else:
            figures["output_tail"] = tail
    summary = figures.get("offload") or {}
    where = (f", offload to {summary.get('swap_tier')}: stall {summary.get('stall_ms_per_step', 0):.1f} ms/step"
             if summary else "")
    named = f" --offload-n {offload} {' '.join(offload_args)}".rstrip() if offload else ""
    graph = "graph" if figures.get("cuda_graph") else \
        f"eager ({figures.get('cuda_graph_error') or figures.get('cuda_graph_eager_reason') or 'asked or default'})"
    log(f"engine train {' '.join(args)}{named}: exit {returncode}, {graph}, "
        f"{figures.get('steady_images_per_second')} images/s, loss {figures.get('final_loss')}{where}")
    return figures


def _write(path: str, report: dict[str, Any]) -> None:
    """After every part: a session cut short by its time limit keeps what finished."""
    losses = [r.get("final_loss") for r in report["offload"]]
    # the captured step, the eager step (--no-cuda-graph) and offload: one loss, bit for bit
    report["offload_same_loss"] = len(losses) >= 2 and losses[0] is not None and len(set(losses)) == 1
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(report, handle, indent=1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="step_bench.json")
    parser.add_argument("--steps", type=int, default=30, help="timed steps of part 1")
    parser.add_argument("--parts", nargs="+", default=["graph", "offload", "imagenet"])
    parser.add_argument("--imagenet-models", nargs="+", default=["resnet18", "mobilenetv2"],
                        help="models trained at 224×224 (ImageNet variants), with and without offload")
    parser.add_argument("--dry", action="store_true", help="the CUDA simulator at tiny sizes")
    options = parser.parse_args(argv)
    if options.dry:
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    report: dict[str, Any] = {"dry": options.dry, "graph": [], "offload": [], "imagenet": []}
    if options.dry:
        from engine.backend import enable_cudasim

        enable_cudasim()
    backend = "cudasim" if options.dry else "cuda"
    if "graph" in options.parts:
        for model in ("resnet18", "mobilenetv2"):
            try:
                report["graph"].append(eager_vs_graph(model, 2 if options.dry else 32,
                                                      1 if options.dry else options.steps, options.dry))
            except Exception as exc:  # a failed capture is a finding of the session, not the end of it
                import traceback

                print(f"{model}: eager vs graph failed: {type(exc).__name__}: {exc}")
                report["graph"].append({"model": model, "error": traceback.format_exc()[-1500:]})
            _write(options.output, report)
    if "offload" in options.parts:
        if options.dry:
            with tempfile.TemporaryDirectory() as tmp:
                data = os.path.join(tmp, "tiny.npz")
                rng = np.random.default_rng(0)
                np.savez(data, x=rng.standard_normal((6, 3, 4, 4)).astype(np.float32), y=rng.integers(0, 3, 6),
                         x_test=rng.standard_normal((2, 3, 4, 4)).astype(np.float32), y_test=rng.integers(0, 3, 2))
                common = ["--model", "cnn", "--data", f"npz:{data}", "--batch-size", "2", "--steps", "1",
                          "--backend", backend]
                report["offload"] = [train_run(common + ["--cuda-graph"], None), train_run(common, None),
                                     train_run(common, "1"), train_run(common, "1", offload_args=DISK_TIER)]
        else:
            common = ["--model", "resnet18", "--data", "synthetic", "--batch-size", "32", "--steps", "30",
                      "--backend", backend]
            # engine train's default on a GPU is the step as one CUDA graph; --no-cuda-graph is the eager step
            # offload on the pinned tier is captured by default; the disk tier stays eager (its IO threads); last,
            # the pinned tier's eager step (--no-cuda-graph), what the captured offload step replaces
            report["offload"] = [train_run(common, None), train_run(common + ["--no-cuda-graph"], None),
                                 train_run(common, "4"), train_run(common, "4", offload_args=DISK_TIER),
                                 train_run(common + ["--no-cuda-graph"], "4")]
        _write(options.output, report)
    if "imagenet" in options.parts and not options.dry:
        for model in options.imagenet_models:
            common = ["--model", model, "--variant", "imagenet", "--data", "synthetic", "--image-size", "224",
                      "--batch-size", "8", "--steps", "8", "--backend", backend]
            report["imagenet"] += [train_run(common, None), train_run(common, "4")]
            _write(options.output, report)
    _write(options.output, report)
    print(f"written {options.output}")
    failed = [r for part in ("offload", "imagenet") for r in report[part] if r["returncode"] != 0]
    failed += [r for r in report["graph"] if "error" in r or r.get("same_weights") is False]
    return 1 if failed or (report["offload"] and not report["offload_same_loss"]) else 0


if __name__ == "__main__":
    sys.exit(main())

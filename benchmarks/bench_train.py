"""Training throughput and memory: the engine against a PyTorch CPU loop of the same model.

    python benchmarks/bench_train.py --models resnet18 mobilenetv2 --batch-size 32 --steps 50 --threads 2
    python benchmarks/bench_train.py --models resnet18 --steps 12 --threads 2 --runs 3   # the step-time goal
    python benchmarks/bench_train.py --models resnet18 --image-size 224 --steps 8 --threads 2 --runs 2

``--image-size`` above 64 trains the ImageNet variants (torchvision's exact models: the engine's
``variant="imagenet"``, ``torchvision.models`` on the PyTorch side); up to 64, the CIFAR variants and
their twins in tests/models/torch_models.py.

With ``--runs N`` the frameworks alternate (engine, torch, engine, torch, ...) and each model ends
with a line of median step times and their ratio (engine / torch): on a shared machine alternating
runs see the same load, so the ratio means more than either time.

Each (framework, model) pair runs in a fresh process, so one run's peak RSS does not hide the
other's. Both train the same architecture (the engine's models and their PyTorch twins in
tests/models/torch_models.py, or torchvision's at ImageNet sizes) with SGD (momentum 0.9) on the same
seeded synthetic 3×S×S images; each side normalizes a batch before its step's clock starts.
Reported per run: images/s from the third step on (the first steps compile kernels and learn
workspace sizes), the first step's seconds, the process's peak RSS, and RSS after step 3 and after
the last step (a loop that leaks grows between the two).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEADY_FROM = 3  # steps before this one are warm-up


CIFAR_MAX_SIZE = 64  # models.CIFAR_MAX_SIZE: larger images get the ImageNet variants


def engine_worker(model: str, batch_size: int, steps: int, threads: int, image_size: int = 32,
                  conv_paths: str | None = None) -> dict:
    from engine.backend import get_backend
    from engine.data.datasets import synthetic
    from engine.optim import make_optimizer
    from engine.threads import set_threads
    from engine.train import StepRecord, Trainer, TrainingListener
    from models import build_network

    set_threads(threads)
    if conv_paths:  # a mix of conv paths that is no ENGINE_CONV mode, before the network plans (issue 32)
        from conv_precision import mix_paths

        from kernels.cpu import conv

        conv.use_paths(mix_paths(conv_paths))
    backend = get_backend("cpu")
    data = synthetic(num_classes=10, seed=0, train=8 * batch_size, test=batch_size, shape=(3, image_size, image_size))
    net = build_network(model, data, backend, seed=0)  # the variant follows the image size
    opt = make_optimizer("sgd", net, backend, 0.01, momentum=0.9, manager=net.mgr)
    step_seconds: list[float] = []  # every step's seconds (the trainer keeps running sums only, issue 14)

    class StepSeconds(TrainingListener):
        def on_step_end(self, trainer: Trainer, record: StepRecord) -> None:
            step_seconds.append(record.seconds)

    trainer = Trainer(net, opt, data, batch_size=batch_size, steps=steps, evaluate_at_end=False,
                      listeners=[StepSeconds()])
    trainer.fit()
    rss = [r["rss_bytes"] for r in trainer.monitor.records]
    return {"step_seconds": step_seconds, "rss": rss}


def torchvision_model(model: str, num_classes: int):
    """torchvision's ImageNet model without running torchvision's ``__init__`` (its C++ operators need the
    torch build it was compiled against; tests/conftest.py: import_torchvision explains)."""
    import importlib.util
    import types

    if "torchvision" not in sys.modules:
        spec = importlib.util.find_spec("torchvision")
        if spec is None or not spec.submodule_search_locations:
            sys.exit("torchvision is not installed: pip install -e '.[test]'")
        package = types.ModuleType("torchvision")
        package.__path__ = list(spec.submodule_search_locations)
        package.__spec__ = spec
        sys.modules["torchvision"] = package
    import torchvision.models

    return {"resnet18": torchvision.models.resnet18, "mobilenetv2": torchvision.models.mobilenet_v2}[model](
        num_classes=num_classes)


def torch_worker(model: str, batch_size: int, steps: int, threads: int, image_size: int = 32) -> dict:
    import numpy as np
    import psutil
    import torch

    sys.path.insert(0, ROOT)
    from engine.data.datasets import synthetic
    from tests.models.torch_models import TORCH_MODELS

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    data = synthetic(num_classes=10, seed=0, train=8 * batch_size, test=batch_size, shape=(3, image_size, image_size))
    # the images are made batch by batch, as the engine's synthetic data is (engine.data.datasets.SyntheticImages):
    # neither side holds the whole split, so the peak RSS compares the training steps
    images, y_all = data.x_train, torch.from_numpy(data.y_train)
    mean, std = torch.from_numpy(data.mean)[:, None, None], torch.from_numpy(data.std)[:, None, None]
    net = TORCH_MODELS[model](num_classes=10) if image_size <= CIFAR_MAX_SIZE else torchvision_model(model, 10)
    net.train()
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    process = psutil.Process()
    step_seconds, rss = [], []
    batches = len(y_all) // batch_size
    order = np.random.default_rng(0).permutation(len(y_all))
    for step in range(steps):
        chosen = order[(step % batches) * batch_size : (step % batches + 1) * batch_size]
        # made and normalized off the clock, as the engine's prefetch thread does
        x, y = (torch.from_numpy(images[chosen]) - mean) / std, y_all[torch.from_numpy(chosen)]
        start = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        loss = torch.nn.functional.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        step_seconds.append(time.perf_counter() - start)
        rss.append(process.memory_info().rss)
    return {"step_seconds": step_seconds, "rss": rss}


def worker(framework: str, model: str, batch_size: int, steps: int, threads: int, image_size: int = 32,
           conv_paths: str | None = None) -> None:
    if framework == "engine":
        result = engine_worker(model, batch_size, steps, threads, image_size, conv_paths)
    else:
        result = torch_worker(model, batch_size, steps, threads, image_size)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    seconds = result["step_seconds"]
    steady = seconds[STEADY_FROM:]
    print(
        json.dumps(
            {
                "framework": framework,
                "model": model,
                "batch_size": batch_size,
                "image_size": image_size,
                "steps": steps,
                "threads": threads,
                "conv_paths": conv_paths if framework == "engine" else None,
                "images_per_second": batch_size * len(steady) / sum(steady),
                "first_step_seconds": seconds[0],
                "peak_rss_bytes": peak,
                "rss_after_step_3_bytes": result["rss"][STEADY_FROM - 1],
                "rss_after_last_step_bytes": result["rss"][-1],
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["resnet18", "mobilenetv2"])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=32,
                        help="Square images of this size; above 64 the ImageNet variants (torchvision's models).")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--frameworks", nargs="+", default=["engine", "torch"])
    parser.add_argument("--runs", type=int, default=1, help="Alternating runs per framework (median reported).")
    parser.add_argument("--json", help="Also write the results here.")
    parser.add_argument("--conv-paths", default=None, metavar="PATHS",
                        help="The engine's conv paths: an ENGINE_CONV mode, a mix of benchmarks/conv_precision.py "
                             "(MIXES: weight4, data4) or MODE:flag=0,... (default: ENGINE_CONV's).")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps <= STEADY_FROM:
        parser.error(f"--steps must be more than {STEADY_FROM} (the warm-up steps)")
    if args.worker:
        worker(args.worker, args.model, args.batch_size, args.steps, args.threads, args.image_size, args.conv_paths)
        return
    if args.conv_paths:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from conv_precision import mix_paths

        mix_paths(args.conv_paths)  # a wrong name fails here, before any run

    results = []
    for model in args.models:
        for _ in range(max(1, args.runs)):
            for framework in args.frameworks:
                command = [
                    sys.executable, __file__, "--worker", framework, "--model", model,
                    "--batch-size", str(args.batch_size), "--steps", str(args.steps), "--threads", str(args.threads),
                    "--image-size", str(args.image_size),
                ] + (["--conv-paths", args.conv_paths] if args.conv_paths else [])
                out = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
                if out.returncode != 0:
                    sys.exit(f"{framework} {model} failed:\n{out.stderr}")
                results.append(json.loads(out.stdout.strip().splitlines()[-1]))
                print(format_row(results[-1]), flush=True)
        if args.runs > 1 and {"engine", "torch"} <= set(args.frameworks):
            print(format_ratio(model, [r for r in results if r["model"] == model]), flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2)


def median_step_seconds(results: list[dict], framework: str) -> float:
    """The median over runs of each run's mean steady step time (batch / images per second)."""
    times = sorted(r["batch_size"] / r["images_per_second"] for r in results if r["framework"] == framework)
    middle = len(times) // 2
    return times[middle] if len(times) % 2 else (times[middle - 1] + times[middle]) / 2


def format_ratio(model: str, results: list[dict]) -> str:
    engine, torch = median_step_seconds(results, "engine"), median_step_seconds(results, "torch")
    runs = sum(r["framework"] == "engine" for r in results)
    return (
        f"{model:<12} median step over {runs} alternating runs: engine {engine:.3f} s, torch {torch:.3f} s, "
        f"engine / torch {engine / torch:.2f}"
    )


def format_row(r: dict) -> str:
    mib = 2.0**20
    return (
        f"{r['model']:<12} {r['framework']:<7} "
        + (f"conv paths {r['conv_paths']} " if r.get("conv_paths") else "")
        + f"batch {r['batch_size']:<3} threads {r['threads']:<2} "
        f"{r['images_per_second']:8.1f} img/s  first step {r['first_step_seconds']:6.1f} s  "
        f"peak RSS {r['peak_rss_bytes'] / mib:7.0f} MiB  "
        f"RSS after step 3 {r['rss_after_step_3_bytes'] / mib:6.0f} MiB, "
        f"after step {r['steps']} {r['rss_after_last_step_bytes'] / mib:6.0f} MiB"
    )


if __name__ == "__main__":
    main()

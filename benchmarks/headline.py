"""The README's headline table: the engine's training step and peak RSS against PyTorch's, at 32×32 and 224×224.

    python benchmarks/headline.py                 # prints the Markdown table (about 8 minutes on two cores)
    python benchmarks/regenerate_docs.py --match headline   # the same, written into README.md with the date

Each row is one ``benchmarks/bench_train.py`` command (printed in the row): ResNet-18 and MobileNetV2,
batch 32, SGD with momentum, synthetic images; at 32×32 the CIFAR variants against their PyTorch twins, at
224×224 torchvision's exact ImageNet models on both sides. The engine and PyTorch alternate, each run in
a fresh process; a cell is the median over the runs (step: of each run's mean step after the warm-up
steps; peak RSS: of each process's high-water mark; both sides make their synthetic batches one at a
time, so neither holds the whole data set). Run it on a quiet machine: the step times are the
machine's, the ratios mean something only when both sides saw the same load. Four runs per row, not two: on
2026-11-28, with the probe of a calm machine (a 2-thread 1024² sgemm in 11.2–11.5 ms), two runs gave ResNet-18 at
32×32 0.73× where four runs of the same row in the next minutes gave 0.69× (and 0.66× in a slower sitting).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks", "bench_train.py")
ROWS = [("resnet18", 32, 12), ("mobilenetv2", 32, 12), ("resnet18", 224, 8), ("mobilenetv2", 224, 8)]
NAMES = {"resnet18": "ResNet-18", "mobilenetv2": "MobileNetV2"}


def row_command(model: str, image_size: int, steps: int, runs: int, threads: int, batch_size: int) -> list[str]:
    return ["benchmarks/bench_train.py", "--models", model, "--image-size", str(image_size), "--batch-size",
            str(batch_size), "--steps", str(steps), "--threads", str(threads), "--runs", str(runs)]


def median_of(results: list[dict], framework: str, key: str) -> float:
    return statistics.median(r[key] for r in results if r["framework"] == framework)


def format_row(model: str, image_size: int, results: list[dict], command: list[str]) -> str:
    mib = 2.0**20
    step = {f: statistics.median(r["batch_size"] / r["images_per_second"] for r in results if r["framework"] == f)
            for f in ("engine", "torch")}
    rss = {f: median_of(results, f, "peak_rss_bytes") / mib for f in ("engine", "torch")}
    return (f"| {NAMES[model]} | {image_size}×{image_size} | {step['engine'] * 1000:,.0f} ms | "
            f"{step['torch'] * 1000:,.0f} ms | **{step['engine'] / step['torch']:.2f}×** | "
            f"{rss['engine']:,.0f} MiB | {rss['torch']:,.0f} MiB | **{rss['engine'] / rss['torch']:.2f}×** | "
            f"`python {' '.join(command)}` |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=4, help="alternating runs per framework and row")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rows", default="all", help="'all', or e.g. resnet18:32,mobilenetv2:224")
    parser.add_argument("--steps", type=int, default=0, help="steps per run (default: 12 at 32×32, 8 at 224×224)")
    args = parser.parse_args()
    rows = ROWS if args.rows == "all" else [
        (m, int(s), 12 if int(s) <= 64 else 8) for m, s in (item.split(":") for item in args.rows.split(","))]
    print("| model | images | engine step | PyTorch step | engine / PyTorch | engine peak RSS | PyTorch peak RSS "
          "| engine / PyTorch | command |")
    print("|---|---|---|---|---|---|---|---|---|")
    for model, image_size, steps in rows:
        command = row_command(model, image_size, args.steps or steps, args.runs, args.threads, args.batch_size)
        with tempfile.TemporaryDirectory() as directory:
            out = os.path.join(directory, "runs.json")
            done = subprocess.run([sys.executable, *command, "--json", out], cwd=ROOT, capture_output=True, text=True)
            if done.returncode != 0:
                sys.exit(f"{' '.join(command)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
            with open(out, encoding="utf-8") as f:
                results = json.load(f)
        print(format_row(model, image_size, results, command), flush=True)
    print()
    print(f"Batch {args.batch_size}, SGD with momentum 0.9, {args.threads} thread(s) on each side; "
          f"median of {args.runs} alternating run(s), each in a fresh process; the step is the mean after 3 warm-up "
          "steps (the first compiles kernels and sizes workspaces); peak RSS is the process's high-water mark "
          "(both sides make their synthetic batches one at a time: neither holds the whole data set).")


if __name__ == "__main__":
    main()

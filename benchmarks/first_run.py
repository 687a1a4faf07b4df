"""What a newcomer's first run pays to compile (issue 13): the README's main command on an empty Numba cache, then
on the warm one; cold − warm is the compile cost.

    python benchmarks/first_run.py --runs 2                  # this checkout, two cold/warm pairs
    python benchmarks/first_run.py --runs 2 --baseline DIR   # and another checkout (e.g. a git worktree), alternating
    python benchmarks/first_run.py --jobs                    # each warm-up job's seconds in a pool of two workers
    python benchmarks/first_run.py --runs 2 --imagenet       # engine train --model resnet18 --variant imagenet
    python benchmarks/first_run.py --jobs --imagenet         #   --data synthetic --image-size 224 (issue 32); its jobs

Each pair gets a fresh ``NUMBA_CACHE_DIR`` (removed after) and runs ``engine train --model resnet18 --offload-n 4
--steps 3`` from the checkout's root (``PYTHONPATH`` = that root), cold then warm; the figure is the median of the
pairs. ``--jobs`` runs ``engine.warmup.model_jobs`` of ResNet-18 in a two-worker pool on an empty cache, as a cold
``engine train`` does (workers started first, one task per ``warmup.families`` family), and prints each job's
seconds and the sums: what the first run's wall is made of.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMAND = ["-m", "cli", "train", "--model", "resnet18", "--offload-n", "4", "--steps", "3", "--no-progress"]
IMAGENET = ["-m", "cli", "train", "--model", "resnet18", "--variant", "imagenet", "--data", "synthetic", "--image-size",
            "224", "--steps", "3", "--no-progress"]
"""Issue 32's second first-run command: the ImageNet ResNet-18 at 224 on synthetic images (``--image-size`` sizes
synthetic and image-folder data only), batch as ``engine train``'s default."""


def _wall(root: Path, cache: str, command=COMMAND) -> float:
    env = dict(os.environ, NUMBA_CACHE_DIR=cache, PYTHONPATH=str(root))
    start = time.perf_counter()
    subprocess.run([sys.executable, *command], cwd=root, env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def cold_minus_warm(root: Path, command=COMMAND) -> tuple[float, float]:
    """(cold, warm) wall seconds of ``command`` (the main command) on a fresh cache."""
    cache = tempfile.mkdtemp(prefix="engine-first-run-")
    try:
        return _wall(root, cache, command), _wall(root, cache, command)
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def _timed(family):  # in a worker: one family's jobs in order, as ensure_compiled runs them
    from engine import warmup

    seconds = []
    for job in family:
        start = time.perf_counter()
        warmup.run_job(job)
        seconds.append(time.perf_counter() - start)
    return seconds


def job_seconds(imagenet: bool = False) -> None:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from engine import warmup
    from engine.backend import get_backend
    from engine.data import load_dataset
    from models import build_network

    data = load_dataset("synthetic", image_size=224) if imagenet else load_dataset("digits")
    options = {"variant": "imagenet"} if imagenet else {}
    jobs = warmup.model_jobs(build_network("resnet18", data, get_backend("cpu"), **options).graph, "sgd")
    families = warmup.families(jobs)
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn"),
                             initializer=warmup._prepare_worker) as pool:
        for ready in [pool.submit(warmup._ready) for _ in range(2)]:  # started, as engine train starts them early
            ready.result()
        start = time.perf_counter()
        timed = list(pool.map(_timed, families))
        wall = time.perf_counter() - start
    rows = [(s, job) for family, seconds in zip(families, timed, strict=True) for job, s in zip(family, seconds,
                                                                                                 strict=True)]
    for s, job in sorted(rows, key=lambda row: -row[0]):
        print(f"{s:6.2f} s  {warmup.family(job):14s}  {job.key}")
    print(f"{len(jobs)} jobs in {len(families)} families: {sum(s for s, _ in rows):.2f} s of compile in the workers, "
          f"{wall:.2f} s of wall with two workers (started before the first job)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=2, help="cold/warm pairs per checkout")
    parser.add_argument("--baseline", type=Path, help="another checkout, timed alternating with this one")
    parser.add_argument("--jobs", action="store_true", help="each warm-up job's seconds instead")
    parser.add_argument("--imagenet", action="store_true", help="the ImageNet ResNet-18 at 224 (issue 32) instead")
    args = parser.parse_args()
    command = IMAGENET if args.imagenet else COMMAND
    if args.jobs:
        cache = tempfile.mkdtemp(prefix="engine-first-run-")
        os.environ["NUMBA_CACHE_DIR"] = cache
        try:
            job_seconds(args.imagenet)
        finally:
            shutil.rmtree(cache, ignore_errors=True)
        return
    roots = {"this": ROOT} | ({"baseline": args.baseline.resolve()} if args.baseline else {})
    results: dict[str, list[float]] = {name: [] for name in roots}
    for i in range(args.runs):
        for name, root in roots.items():
            cold, warm = cold_minus_warm(root, command)
            results[name].append(cold - warm)
            print(f"pair {i + 1} {name:8s} cold {cold:6.2f} s  warm {warm:6.2f} s  cold - warm {cold - warm:6.2f} s",
                  flush=True)
    for name, diffs in results.items():
        print(f"{name}: cold - warm median {statistics.median(diffs):.2f} s over {len(diffs)} pairs "
              f"(issue 32's goal: <= 10 s)")


if __name__ == "__main__":
    main()

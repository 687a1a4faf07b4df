"""Data-parallel training, parallel inference and the communication model, measured and on paper.

    python -m engine.bench.parallel train --workers 1,2 --models mlp,cnn,resnet18
    python -m engine.bench.parallel inference --workers 1,2 --models cnn,resnet18
    python -m engine.bench.parallel model            # ring-allreduce cost for ResNet-18 and MobileNetV2

**train.** For each model and K, one job: K=1 is one process using every core (no MPI), K>1 is
``mpiexec -n K`` with cores/K threads per rank, ``--batch-size`` per worker (so K ranks process K
times the examples per step). Reported: images/s over the measured steps (after ``--warmup``),
the speedup over K=1 on the same cores (ideal 1.0 on one machine: the cores are the same, only the
split changes; more than one machine is where K pays), the time of one blocking ``Allreduce`` of the
whole gradient block (median of 10, after a barrier), the wait at the end of backward per step
(median; ``GradientAllreduce.exposed_seconds``) and the fraction hidden = 1 − wait / allreduce. The wait
also holds the time spent waiting for a slower rank to finish its backward (on a loaded machine most
of it), so the hidden fraction is a lower bound: "at least this much of the allreduce was hidden".

**inference.** ``ParallelInference`` with K worker threads; ``--clients`` threads each send
``--requests`` single-image requests back to back; images/s over the run and latency percentiles of
the requests (submit to answer).

**model.** Bytes per rank per step of a ring allreduce, 2·(K−1)/K·G for a gradient block of G bytes
(each rank sends and receives that much: a reduce-scatter, then an all-gather), plus 2·(K−1) message
latencies, and the step time it predicts with and without overlap; G is computed from the models.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np

# --- training --------------------------------------------------------------------------------------


def rank_job(model: str, batch_size: int, steps: int, warmup: int, image_size: int,
             threads_per_rank: int = 0) -> dict[str, Any] | None:
    """One rank's share of a training benchmark (also the K=1 run); rank 0 returns the figures."""
    from engine.backend import get_backend
    from engine.data.datasets import synthetic
    from engine.optim import make_optimizer
    from engine.parallel.comm import join_world, under_launcher
    from engine.threads import set_threads
    from engine.train import Trainer
    from models import build_network

    world = join_world() if under_launcher() else None
    K = world.size if world is not None else 1
    threads = threads_per_rank or (world.threads_per_rank() if world is not None else (os.cpu_count() or 1))
    set_threads(threads)
    backend = get_backend("cpu")
    data = synthetic(10, seed=0, train=batch_size * K * (steps + warmup), test=16, shape=(3, image_size, image_size))
    net = build_network(model, data, backend, seed=0)
    opt = make_optimizer("sgd", net, backend, 0.01, momentum=0.9, manager=net.mgr)
    parallel = None
    if world is not None:
        from engine.parallel.wrapper import DataParallel

        parallel = DataParallel(world)
    from engine.train import TrainingListener

    class StepSeconds(TrainingListener):  # every step's seconds, for the median (the trainer keeps only sums)
        def __init__(self) -> None:
            self.seconds: list[float] = []

        def on_step_end(self, trainer: Any, record: Any) -> None:
            self.seconds.append(record.seconds)

    steps_seen = StepSeconds()
    trainer = Trainer(net, opt, data, batch_size=batch_size, steps=steps + warmup, prefetch=2,
                      evaluate_at_end=False, parallel=parallel, listeners=[steps_seen])
    trainer.fit()
    measured = steps_seen.seconds[warmup:]
    result: dict[str, Any] = {
        "model": model, "workers": K, "threads_per_rank": threads, "batch_per_worker": batch_size,
        "gradient_bytes": int(net.gradients.flat.nbytes),
        "step_seconds": statistics.median(measured),
        "images_per_second": K * batch_size * len(measured) / sum(measured),
    }
    if world is not None:
        from mpi4py import MPI

        block = np.array(net.gradients.flat)
        times = []
        for _ in range(10):
            world.comm.Barrier()
            start = time.perf_counter()
            world.comm.Allreduce(MPI.IN_PLACE, block, op=MPI.SUM)
            times.append(time.perf_counter() - start)
        exposed = statistics.median(parallel.exposed_seconds[warmup:])
        allreduce = statistics.median(times)
        result.update(
            allreduce_seconds=allreduce, exposed_seconds=exposed, allreduce_ms=1e3 * allreduce, wait_ms=1e3 * exposed,
            hidden_fraction=max(0.0, 1.0 - exposed / allreduce) if allreduce > 0 else None,
        )
        if not world.is_root:
            return None
    return result


def run_training(models: list[str], workers: list[int], batch_size: int, steps: int, warmup: int,
                 image_size: int, threads_per_rank: int = 0, repeat: int = 1,
                 progress: Any = None) -> list[dict[str, Any]]:
    """Each (model, K) in a fresh job, K alternated within each of ``repeat`` rounds; the figures are
    medians over the rounds, and the speedup is against the K=1 median of the same model."""
    from engine.parallel.comm import mpiexec_command

    runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for model in models:
        for round_ in range(repeat):
            for K in workers:
                if progress:
                    progress(f"{model}, {K} worker(s), round {round_ + 1} of {repeat}")
                job = ["-m", "engine.bench.parallel", "rank", model, str(batch_size), str(steps), str(warmup),
                       str(image_size), str(threads_per_rank)]
                command = [sys.executable, *job] if K == 1 else [*mpiexec_command(K), sys.executable, *job]
                env = {k: v for k, v in os.environ.items() if k not in ("PMI_SIZE", "PMI_RANK")}
                out = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
                if out.returncode != 0:
                    raise RuntimeError(f"{model} with {K} worker(s) failed: {out.stderr.strip()[-500:]}")
                runs.setdefault((model, K), []).append(json.loads(out.stdout.strip().splitlines()[-1]))
    rows: list[dict[str, Any]] = []
    for model in models:
        baseline = None
        for K in workers:
            results = runs[(model, K)]
            row = dict(results[0])
            for key, value in results[0].items():
                if isinstance(value, float):
                    row[key] = statistics.median(r[key] for r in results)
            row["runs"] = len(results)
            if K == 1:
                baseline = row["images_per_second"]
            row["speedup_vs_one"] = row["images_per_second"] / baseline if baseline else None
            rows.append(row)
    return rows


# --- inference -------------------------------------------------------------------------------------


def run_inference(models: list[str], workers: list[int], clients: int, requests: int, max_batch: int,
                  max_wait_ms: float, image_size: int, threads_per_worker: int | None = None,
                  progress: Any = None) -> list[dict[str, Any]]:
    """ParallelInference throughput and latency for each model and worker count, alternated 3 rounds."""
    from engine.parallel.inference import ParallelInference
    from models import build_model

    rows: dict[tuple[str, int], list[dict[str, float]]] = {}
    rng = np.random.default_rng(0)
    for model in models:
        options = {"input_shape": (3, image_size, image_size)} if model == "mlp" else {"image_size": image_size}
        images = rng.standard_normal((clients * requests, 3, image_size, image_size), dtype=np.float32)
        for _round in range(3):
            for K in workers:
                if progress:
                    progress(f"{model}, {K} inference worker(s), round {_round + 1}")
                def factory(model: str = model, options: dict = options) -> Any:
                    return build_model(model, 10, "cpu", seed=0, **options)

                with ParallelInference(factory, workers=K, mode="batched", max_batch=max_batch,
                                       max_wait_ms=max_wait_ms, queue_limit=4 * clients,
                                       threads_per_worker=threads_per_worker) as pi:
                    for i in range(min(4, len(images))):  # compile and size the workspaces
                        pi.predict(images[i : i + 1])
                    latencies: list[float] = []
                    lock = threading.Lock()

                    def client(c: int, pi: Any = pi, latencies: list[float] = latencies, lock: Any = lock,
                               images: np.ndarray = images) -> None:
                        mine = []
                        for r in range(requests):
                            start = time.perf_counter()
                            pi.predict(images[c * requests + r])
                            mine.append(time.perf_counter() - start)
                        with lock:
                            latencies.extend(mine)

                    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
                    start = time.perf_counter()
                    for t in threads:
                        t.start()
                    for t in threads:
                        t.join()
                    seconds = time.perf_counter() - start
                    ms = np.array(latencies) * 1e3
                    rows.setdefault((model, K), []).append({
                        "images_per_second": len(latencies) / seconds, "p50_ms": float(np.percentile(ms, 50)),
                        "p90_ms": float(np.percentile(ms, 90)), "p99_ms": float(np.percentile(ms, 99)),
                        "mean_batch": pi.stats.mean_batch_rows, "threads_per_worker": pi.threads_per_worker,
                    })
    result = []
    for (model, K), runs in rows.items():
        row = {"model": model, "workers": K, "clients": clients, "max_batch": max_batch}
        for key in runs[0]:
            row[key] = statistics.median(r[key] for r in runs)
        result.append(row)
    return result


# --- the communication model -----------------------------------------------------------------------


def gradient_bytes(model: str, num_classes: int = 10) -> int:
    """Bytes of the model's GRADIENTS block (float32, one per parameter), computed from the graph."""
    from engine.network import Network  # noqa: F401  (build_model returns one)
    from models import build_model

    return int(build_model(model, num_classes, "cpu").gradients.flat.nbytes)


def ring_allreduce(gradient: int, ranks: int, gbits: float, latency_s: float) -> dict[str, float]:
    """Bytes each rank sends (and receives) per step in a ring allreduce, and the time on a link."""
    sent = 2 * (ranks - 1) / ranks * gradient
    seconds = sent * 8 / (gbits * 1e9) + 2 * (ranks - 1) * latency_s
    return {"bytes_per_rank": sent, "seconds": seconds}


def communication_model(models: dict[str, float], ranks: tuple[int, ...] = (8, 64),
                        links: tuple[float, ...] = (10.0, 100.0), latency_us: float = 20.0,
                        backward_share: float = 2 / 3) -> list[dict[str, Any]]:
    """Predicted step times: ``models`` maps a model to its measured one-rank step time (seconds).

    No overlap: compute + allreduce. Overlap (DDP/bucketed): the allreduce starts during backward and
    can hide under it, so the step is max(compute, forward + allreduce), with backward taking
    ``backward_share`` of the compute (2/3: a backward costs about two forwards in FLOPs).
    """
    rows = []
    for model, compute in models.items():
        gradient = gradient_bytes(model)
        for K in ranks:
            for gbits in links:
                ring = ring_allreduce(gradient, K, gbits, latency_us * 1e-6)
                forward = compute * (1 - backward_share)
                rows.append({
                    "model": model, "gradient_bytes": gradient, "ranks": K, "gbit_per_s": gbits,
                    "bytes_per_rank": ring["bytes_per_rank"], "allreduce_seconds": ring["seconds"],
                    "compute_seconds": compute, "step_no_overlap": compute + ring["seconds"],
                    "step_overlap": max(compute, forward + ring["seconds"]),
                    "efficiency_no_overlap": compute / (compute + ring["seconds"]) if compute > 0 else None,
                })
    return rows


# --- tables ----------------------------------------------------------------------------------------


def markdown(rows: list[dict[str, Any]], columns: list[tuple[str, str, str]]) -> str:
    """A markdown table: (key, heading, format) per column."""
    lines = ["| " + " | ".join(h for _, h, _ in columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = []
        for key, _, fmt in columns:
            value = row.get(key)
            cells.append("–" if value is None else format(value, fmt))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


TRAIN_COLUMNS = [("model", "model", ""), ("workers", "ranks", "d"), ("threads_per_rank", "threads/rank", "d"),
                 ("batch_per_worker", "batch/rank", "d"), ("images_per_second", "images/s", ".1f"),
                 ("speedup_vs_one", "vs 1 rank", ".2f"), ("gradient_bytes", "gradients (B)", ",d"),
                 ("allreduce_ms", "allreduce (ms)", ".2f"), ("wait_ms", "wait after backward (ms)", ".2f"),
                 ("hidden_fraction", "hidden (at least)", ".0%")]
INFERENCE_COLUMNS = [("model", "model", ""), ("workers", "workers", "d"), ("threads_per_worker", "threads/worker", "d"),
                     ("clients", "clients", "d"),
                     ("images_per_second", "images/s", ".1f"), ("mean_batch", "mean batch", ".1f"),
                     ("p50_ms", "p50 (ms)", ".1f"), ("p90_ms", "p90 (ms)", ".1f"), ("p99_ms", "p99 (ms)", ".1f")]
MODEL_COLUMNS = [("model", "model", ""), ("gradient_bytes", "G (bytes)", ",d"), ("ranks", "ranks", "d"),
                 ("gbit_per_s", "Gbit/s", ".0f"), ("bytes_per_rank", "sent per rank (B)", ",.0f"),
                 ("allreduce_seconds", "allreduce (s)", ".4f"), ("compute_seconds", "compute (s)", ".3f"),
                 ("step_no_overlap", "step, no overlap (s)", ".3f"), ("step_overlap", "step, overlap (s)", ".3f"),
                 ("efficiency_no_overlap", "efficiency, no overlap", ".0%")]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m engine.bench.parallel", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    train = sub.add_parser("train")
    train.add_argument("--models", default="mlp,cnn,resnet18")
    train.add_argument("--workers", default="1,2")
    train.add_argument("--batch-size", type=int, default=32)
    train.add_argument("--steps", type=int, default=6)
    train.add_argument("--warmup", type=int, default=2)
    train.add_argument("--image-size", type=int, default=32)
    train.add_argument("--threads-per-rank", type=int, default=0, help="default: cores / ranks")
    train.add_argument("--repeat", type=int, default=1, help="rounds, K alternated; medians reported")
    infer = sub.add_parser("inference")
    infer.add_argument("--models", default="cnn,resnet18")
    infer.add_argument("--workers", default="1,2")
    infer.add_argument("--clients", type=int, default=8)
    infer.add_argument("--requests", type=int, default=25)
    infer.add_argument("--max-batch", type=int, default=16)
    infer.add_argument("--max-wait-ms", type=float, default=2.0)
    infer.add_argument("--image-size", type=int, default=32)
    infer.add_argument("--threads-per-worker", type=int, default=None, help="default: cores / workers")
    model = sub.add_parser("model")
    model.add_argument("--compute", default="",
                       help="model=seconds of one measured step per rank, e.g. resnet18=1.2,mobilenetv2=0.9")
    model.add_argument("--latency-us", type=float, default=20.0)
    rank = sub.add_parser("rank")  # one rank's job, started by `train`
    for name in ("model", "batch_size", "steps", "warmup", "image_size", "threads_per_rank"):
        rank.add_argument(name)
    for p in (train, infer, model):
        p.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    note = lambda text: print(f"... {text}", file=sys.stderr, flush=True)  # noqa: E731
    if args.what == "rank":
        row = rank_job(args.model, int(args.batch_size), int(args.steps), int(args.warmup), int(args.image_size),
                       int(args.threads_per_rank))
        if row is not None:
            print(json.dumps(row), flush=True)
        return
    if args.what == "train":
        rows = run_training(args.models.split(","), [int(k) for k in args.workers.split(",")], args.batch_size,
                            args.steps, args.warmup, args.image_size, args.threads_per_rank, args.repeat, note)
        columns = TRAIN_COLUMNS
    elif args.what == "inference":
        rows = run_inference(args.models.split(","), [int(k) for k in args.workers.split(",")], args.clients,
                             args.requests, args.max_batch, args.max_wait_ms, args.image_size,
                             args.threads_per_worker, note)
        columns = INFERENCE_COLUMNS
    else:
        compute = {k: float(v) for k, v in (item.split("=") for item in args.compute.split(",") if item)}
        rows = communication_model(compute or {"resnet18": 0.0, "mobilenetv2": 0.0}, latency_us=args.latency_us)
        columns = MODEL_COLUMNS
    print(json.dumps(rows, indent=2) if args.json else markdown(rows, columns))


if __name__ == "__main__":
    main()

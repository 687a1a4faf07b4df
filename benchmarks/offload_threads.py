"""Per-thread CPU and run-queue wait per step, with and without offload, and the conv drivers' thread split.

    python benchmarks/offload_threads.py --model mobilenetv2 --batch-size 32 --steps 24 \\
        --configs none@k1,none@k4,n4@k1,n4@k4

One process trains the model once per configuration on the same seeded batch, the configurations'
steps alternating (as ``engine bench`` does). A configuration is ``none`` (no offload) or ``nN``
(offload window N), then ``@`` and the split of the conv drivers' work (``kernels/cpu/threads.py``):
``old`` (the fixed per-thread shares as they were: the caller runs share 0, then waits for the pool's
thread to run share 1), ``k1`` (the same shares, taken by whichever thread is free), ``kK`` (up to K
chunks per thread, ``threads.CHUNKS_PER_THREAD``; the default). Per configuration: the median step
and its ratio to the first configuration, the scheduler's waits, rebuild time and IO threads' busy
and CPU time, the scheduler's hooks on the executor (ms per step), and per thread the CPU time it
got and the time it waited, ready to run, for a core (``/proc/self/task/*/schedstat``).
Timings are worthless unless nothing else runs on the machine.
"""

from __future__ import annotations

import collections
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from offload_costs import step_arguments, time_scheduler_hooks  # noqa: E402

import kernels.cpu.conv as conv  # noqa: E402
import kernels.cpu.conv_shifted as conv_shifted  # noqa: E402
import kernels.cpu.conv_winograd as conv_winograd  # noqa: E402
import kernels.cpu.conv_winograd4 as conv_winograd4  # noqa: E402
import kernels.cpu.threads as threads  # noqa: E402
from engine.backend import get_backend  # noqa: E402
from engine.bench.kernels import thread_schedstat  # noqa: E402
from engine.offload.scheduler import OffloadScheduler  # noqa: E402
from engine.optim import SGD  # noqa: E402
from models import build_model  # noqa: E402

DYNAMIC_CHUNKS, DYNAMIC_SHARES = threads.run_chunks, threads.run_shares
DEFAULT_CHUNKS = threads.CHUNKS_PER_THREAD


def fixed_chunks(work: Callable[[int, int], object], chunks: int, count: int) -> None:
    """The split as it was: chunk t on thread t, the caller waiting for every pool thread's share."""
    if count <= 1:
        for chunk in range(chunks):
            work(chunk, 0)
        return
    assert chunks == count, (chunks, count)
    pool = threads._get_pool(count - 1)
    futures = [pool.submit(work, t, t) for t in range(1, count)]
    try:
        work(0, 0)
    finally:
        for future in futures:
            future.result()


def fixed_shares(work: Callable[[int], object], count: int) -> None:
    fixed_chunks(lambda chunk, slot: work(chunk), count, count)


def set_split(split: str) -> None:
    """``old``, ``k1`` ... ``kK``: see the module docstring."""
    old = split == "old"
    threads.CHUNKS_PER_THREAD = 1 if old else int(split[1:])
    conv.run_chunks = fixed_chunks if old else DYNAMIC_CHUNKS
    for module in (conv, conv_shifted, conv_winograd, conv_winograd4):
        module.run_shares = fixed_shares if old else DYNAMIC_SHARES


def main() -> None:
    parser = step_arguments(__doc__, steps=24)
    parser.add_argument("--configs", default="none@k1,none@k4,n4@k1,n4@k4")
    parser.add_argument("--verify", default="full")
    args = parser.parse_args()

    backend = get_backend("cpu")
    rng = np.random.default_rng(0)
    runs: list[dict[str, Any]] = []
    for config in args.configs.split(","):
        kind, _, split = config.partition("@")
        split = split or f"k{DEFAULT_CHUNKS}"
        net = build_model(args.model, num_classes=10, backend=backend, seed=0, image_size=args.image_size)
        optimizer = SGD(net.parameters, net.gradients, backend, lr=0.01, momentum=0.9)
        scheduler, hooks = None, None
        if kind != "none":
            scheduler = OffloadScheduler(backend, int(kind[1:]), verify=args.verify)
            scheduler.attach(net, batch_size=args.batch_size)
            hooks = time_scheduler_hooks(scheduler)
        runs.append({"name": f"{kind}@{split}", "split": split, "net": net, "optimizer": optimizer,
                     "scheduler": scheduler, "hooks": hooks, "times": [],
                     "threads": collections.defaultdict(lambda: [0, 0])})
    x = rng.standard_normal((args.batch_size, *runs[0]["net"].graph.input_shape)).astype(np.float32)
    y = rng.integers(0, 10, args.batch_size).astype(np.int64)

    for step in range(args.warmup + args.steps):
        for run in runs:
            set_split(run["split"])
            if step == args.warmup and run["hooks"] is not None:
                run["hooks"].clear()
            before = thread_schedstat() or {}
            started = time.perf_counter()
            run["net"].forward(x, training=True)
            run["net"].loss(y)
            run["net"].backward()
            run["optimizer"].step()
            elapsed = time.perf_counter() - started
            after = thread_schedstat() or {}
            if step < args.warmup:
                continue
            run["times"].append(elapsed)
            names = {t.native_id: t.name for t in threading.enumerate()}
            scheduler = run["scheduler"]
            own_io = scheduler.io_thread_ids if scheduler is not None else frozenset()
            for tid, (ran, waited) in after.items():
                name = names.get(tid, "numba openmp worker")
                if name.startswith("engine-offload") and tid not in own_io:
                    continue  # another configuration's IO thread
                ran0, waited0 = before.get(tid, (0, 0))
                run["threads"][name][0] += ran - ran0
                run["threads"][name][1] += waited - waited0
    set_split(f"k{DEFAULT_CHUNKS}")

    base = float(np.median(runs[0]["times"]))
    steps = args.steps
    for run in runs:
        median = float(np.median(run["times"]))
        line = f"{run['name']:<12} step {1e3 * median:7.1f} ms ({median / base:.3f}x)"
        scheduler = run["scheduler"]
        if scheduler is not None:
            stats = scheduler.stats[-steps:]

            def ms(key: str, stats: Any = stats) -> float:
                return 1e3 * float(np.mean([getattr(s, key) for s in stats]))

            line += (f" | load wait {ms('load_wait_s'):.1f} room wait {ms('room_wait_s'):.1f} rebuild "
                     f"{ms('recompute_s'):.1f}; saver busy {ms('offload_s'):.1f} cpu {ms('offload_cpu_s'):.1f}, "
                     f"loader busy {ms('onload_s'):.1f} cpu {ms('onload_cpu_s'):.1f}")
            line += ("\n    hooks " + ", ".join(f"{k} {1e3 * v / steps:.1f}" for k, v in run["hooks"].items())
                     + f"; total {1e3 * sum(run['hooks'].values()) / steps:.1f}")
        print(line)
        for name, (ran, waited) in sorted(run["threads"].items(), key=lambda kv: -kv[1][0]):
            print(f"    {name:<28} cpu {ran / 1e6 / steps:7.1f} ms  waited for a core {waited / 1e6 / steps:6.1f} ms")
    for run in runs:
        if run["scheduler"] is not None:
            run["scheduler"].close()
        run["net"].close()


if __name__ == "__main__":
    main()

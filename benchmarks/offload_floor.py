"""The swap disk's floor under offload: can the step with offload be within 5% of the step without?

    python benchmarks/offload_floor.py --model mobilenetv2 --batch-size 32 --steps 6 [--dir /tmp]

First the disk alone: one thread writes then reads ``--disk-mib`` MiB sequentially through an
``O_DIRECT`` descriptor in ``--dir`` (where the swap file goes), 1 MiB and 4 MiB per call, from a
page-aligned buffer, as ``SwapStorage`` does; median of three passes each.

Then the model, without offload and with ``--window`` N, their steps alternating in one process (as
``engine bench`` does): the forward (with the loss) and the backward per step, the bytes written and
read per step and how long the IO threads were inside the system calls (their bandwidth while the
step runs), the loader's busy time inside the backward, the executor's waits (for a load, for room),
the rebuilds, and the IO threads' CPU (``/proc/self/task/TID/schedstat``), split into user and
system time (``stat``, clock ticks), and their CPU inside the storage's calls.

The floor: the saves of a forward's units must end before the backward reads them (and with a fixed N
before the forward can reuse their room), and the reads happen while the backward runs, so a step
with offload takes at least ``max(forward, written / write bandwidth) + max(backward, read / read
bandwidth)``, the bandwidths being the disk-alone ones. ``floor`` is that against the step without
offload; the disk must be busy that share of the step without offload (``disk busy``) with perfect
overlap and no dependency between units, so anything near 1.0 leaves no room for the 5%.
Timings are worthless unless nothing else runs on the machine.
"""

from __future__ import annotations

import mmap
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from offload_costs import step_arguments  # noqa: E402

from engine.backend import get_backend  # noqa: E402
from engine.offload.scheduler import OffloadScheduler  # noqa: E402
from engine.optim import SGD  # noqa: E402
from models import build_model  # noqa: E402

MIB = 2**20


def disk_bandwidth(directory: str, total_mib: int, block_mib: int, passes: int = 3) -> tuple[float, float]:
    """Median sequential O_DIRECT write and read bandwidth (bytes/s) of one thread, ``block_mib`` per call."""
    buffer = mmap.mmap(-1, block_mib * MIB)  # page aligned, as the arena is
    buffer.write(np.random.default_rng(0).integers(0, 255, block_mib * MIB, dtype=np.uint8).tobytes())
    view = memoryview(buffer)
    fd, path = tempfile.mkstemp(dir=directory, prefix="offload-floor-")
    os.close(fd)
    fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    try:
        os.posix_fallocate(fd, 0, total_mib * MIB)
        rates: dict[str, list[float]] = {"write": [], "read": []}
        for _ in range(passes):
            for what, call in (("write", os.pwritev), ("read", os.preadv)):
                started = time.perf_counter()
                for offset in range(0, total_mib * MIB, block_mib * MIB):
                    if call(fd, [view], offset) != block_mib * MIB:
                        raise OSError(f"short {what}")
                rates[what].append(total_mib * MIB / (time.perf_counter() - started))
        return float(np.median(rates["write"])), float(np.median(rates["read"]))
    finally:
        os.close(fd)
        os.unlink(path)
        view.release()
        buffer.close()


def _thread_cpu(tid: int) -> tuple[float, float, float]:
    """User and system CPU seconds of one thread of this process (clock ticks), and its CPU time (ns
    precise, ``schedstat``)."""
    with open(f"/proc/self/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    with open(f"/proc/self/task/{tid}/schedstat") as f:
        ran = int(f.read().split()[0]) / 1e9
    ticks = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / ticks, int(fields[12]) / ticks, ran


def _record_io(storage: Any, events: list[tuple[str, float, float, int, float]]) -> None:
    """Log (what, start, end, bytes, CPU seconds of the calling thread) of every write and read the storage makes."""
    for name in ("write", "read"):
        call = getattr(storage, name)

        def timed(records: Any, *args: Any, _call: Any = call, _name: str = name, **kwargs: Any) -> Any:
            started, cpu = time.perf_counter(), time.thread_time()
            try:
                return _call(records, *args, **kwargs)
            finally:
                events.append((_name, started, time.perf_counter(), sum(r.nbytes for r in records),
                               time.thread_time() - cpu))

        setattr(storage, name, timed)


def main() -> None:
    parser = step_arguments(__doc__, steps=6)
    parser.add_argument("--window", type=int, default=4)
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the swap file goes (--offload-dir)")
    parser.add_argument("--disk-mib", type=int, default=512)
    args = parser.parse_args()

    print(f"disk alone ({args.dir}, {args.disk_mib} MiB, one thread, O_DIRECT, median of 3):")
    bandwidth = {}
    for block in (1, 4):
        bandwidth[block] = disk_bandwidth(args.dir, args.disk_mib, block)
        write, read = (rate / MIB for rate in bandwidth[block])
        print(f"  {block} MiB per call: write {write:.0f} MiB/s, read {read:.0f} MiB/s")
    write_bw = max(b[0] for b in bandwidth.values())
    read_bw = max(b[1] for b in bandwidth.values())

    backend = get_backend("cpu")
    batch = args.batch_size
    events: list[tuple[str, float, float, int, float]] = []
    runs: list[dict[str, Any]] = []
    for window in (None, args.window):
        net = build_model(args.model, num_classes=10, backend=backend, seed=0, image_size=args.image_size)
        optimizer = SGD(net.parameters, net.gradients, backend, lr=0.01, momentum=0.9)
        scheduler = None
        if window is not None:
            scheduler = OffloadScheduler(backend, window, directory=args.dir)
            scheduler.attach(net, batch_size=batch)
            _record_io(scheduler.storage, events)
        runs.append({"net": net, "optimizer": optimizer, "scheduler": scheduler, "times": []})
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, *runs[0]["net"].graph.input_shape)).astype(np.float32)
    y = rng.integers(0, 10, batch).astype(np.int64)

    cpu_before: dict[str, tuple[float, float]] = {}
    threads: dict[str, int] = {}
    for step in range(args.warmup + args.steps):
        for run in runs:
            scheduler = run["scheduler"]
            if step == args.warmup and scheduler is not None:
                events.clear()
                threads = {t.name.rsplit("-", 1)[1]: t.native_id for t in threading.enumerate()
                           if t.native_id in scheduler.io_thread_ids}
                cpu_before = {name: _thread_cpu(tid) for name, tid in threads.items()}
            t0 = time.perf_counter()
            run["net"].forward(x, training=True)
            run["net"].loss(y)
            t1 = time.perf_counter()
            run["net"].backward()
            t2 = time.perf_counter()
            run["optimizer"].step()
            if step >= args.warmup:
                run["times"].append((t0, t1, t2, time.perf_counter()))
    cpu_after = {name: _thread_cpu(tid) for name, tid in threads.items()}

    base, offload = (np.array(run["times"]) for run in runs)
    step_base = float(np.median(base[:, 3] - base[:, 0]))
    forward = float(np.median(base[:, 1] - base[:, 0]))
    backward = float(np.median(base[:, 2] - base[:, 1]))
    step_offload = float(np.median(offload[:, 3] - offload[:, 0]))
    print(f"\n{args.model} batch {batch}, {args.steps} steps after {args.warmup}, medians:")
    print(f"  no offload: step {1e3 * step_base:.1f} ms (forward {1e3 * forward:.1f}, backward {1e3 * backward:.1f})")
    print(f"  N={args.window}: step {1e3 * step_offload:.1f} ms (forward "
          f"{1e3 * float(np.median(offload[:, 1] - offload[:, 0])):.1f}, backward "
          f"{1e3 * float(np.median(offload[:, 2] - offload[:, 1])):.1f}): {step_offload / step_base:.3f}x")
    for what in ("write", "read"):
        moved = [e for e in events if e[0] == what]
        nbytes = sum(e[3] for e in moved) / args.steps
        busy = sum(e[2] - e[1] for e in moved) / args.steps
        cpu = sum(e[4] for e in moved) / args.steps
        print(f"  {what:<5} {nbytes / MIB:.1f} MiB per step in {len(moved) / args.steps:.0f} calls, inside the calls "
              f"{1e3 * busy:.1f} ms ({nbytes / busy / MIB:.0f} MiB/s), CPU {1e3 * cpu:.1f} ms")
    for name in threads:
        user, system, ran = ((cpu_after[name][i] - cpu_before[name][i]) / args.steps for i in range(3))
        print(f"  {name}: CPU {1e3 * ran:.1f} ms per step (user {1e3 * user:.1f}, system {1e3 * system:.1f}: ticks)")
    stats = runs[1]["scheduler"].stats[-args.steps:]
    for i, (t0, t1, t2, _) in enumerate(offload):
        reads = [e for e in events if e[0] == "read" and t0 <= e[1] < t2]
        in_backward = sum(min(e[2], t2) - max(e[1], t1) for e in reads if e[2] > t1)
        s = stats[i]
        print(f"  step {i}: loader busy {1e3 * in_backward:.0f} of the backward's {1e3 * (t2 - t1):.0f} ms; waits: "
              f"load {1e3 * s.load_wait_s:.1f}, room {1e3 * s.room_wait_s:.1f} ms; "
              f"rebuilds {1e3 * s.recompute_s:.1f} ms")

    written = float(np.mean([s.bytes_written for s in stats]))
    read = float(np.mean([s.bytes_read for s in stats]))
    update = step_base - forward - backward
    floor = max(forward, written / write_bw) + max(backward, read / read_bw) + update
    print(f"\nfloor at the disk-alone bandwidths: max({1e3 * forward:.0f}, {1e3 * written / write_bw:.0f}) + "
          f"max({1e3 * backward:.0f}, {1e3 * read / read_bw:.0f}) ms = {floor / step_base:.3f}x the step without "
          f"offload; disk busy {(written / write_bw + read / read_bw) / step_base:.0%} of it")
    for run in runs:
        if run["scheduler"] is not None:
            run["scheduler"].close()
        run["net"].close()


if __name__ == "__main__":
    main()

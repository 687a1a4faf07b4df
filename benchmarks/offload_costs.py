"""Where offload's time goes, and what a change would buy before it is built (issue 11's keep / swap / recompute).

    python benchmarks/offload_costs.py --model mobilenetv2 --batch-size 32 --steps 10 \\
        --configs n4,keep:expand-bn,recompute:expand-bn,verify-off,eager [--blocks '2|3|4'] [--layers]

One process trains the model once per configuration on the same seeded batch, the configurations'
steps alternating (as ``engine bench`` does with and without offload), and prints per configuration
the median step, its ratio to the run without offload, bytes written per step, the saver's and the
loader's CPU (ms and µs per MiB), the executor's stall, its rebuild time and the resident peak of
saved tensors. It first prints the bytes the N=4 plan writes per step by *role* (a batch norm after a
1×1 conv, after a depthwise conv, ...).

Configurations (all N=4 except ``none``, which always runs):

* ``n4``: the scheduler as it is.
* ``keep:ROLE``: the units of that role (in ``--blocks``, if given) never written (the plan keeps
  them resident, so the arena grows): the most that removing their IO could buy, an upper bound for
  any recompute of them.
* ``recompute:expand-bn``: ``keep:expand-bn`` plus the work a recompute would do, where it would do
  it: before the backward of the depthwise conv that reads the expand ReLU6's output, the expand 1×1
  conv's forward (on a tensor of the block input's shape) and a batch-norm pass over its output. Its
  step against ``n4`` is what recomputing those outputs instead of swapping them would gain, measured
  without building it (the bits are not checked: it times the work, it does not replace the data).
* ``verify-off``: ``--offload-verify off``: what the full XXH3 check costs.
* ``io-hash``: every record hashed by the IO threads (XXH3), none checked by the executor (the
  ReLU's forward and the rebuild summing the rebuilds' sources, ``scheduler._FusedCheck``).
* ``budget:F``: ``n4`` with a byte budget of F times what the step keeps for backward without offload
  (``engine.offload.session.offloadable_resident_bytes``): what the window leaves of it keeps units
  resident instead of writing them (``plan.keep_within``).
* ``eager``: loads start as soon as their planned bytes are free instead of N steps ahead.
* ``unpinned``: ``n4`` with the IO threads left wherever the OS puts them (``io_cpus=None``; ``n4``
  keeps them off the swap disk's interrupt CPUs, ``engine.offload.affinity``).
* ``pin:CPU[+CPU]``: ``n4`` with the IO threads on these CPUs.
* ``spin:US``: ``noio`` whose IO threads burn US µs of CPU per MiB moved (GIL released, no memory
  traffic): what the IO threads' share of the cores costs, apart from their system calls and bytes.
* ``sleep:MIBPS``: ``noio`` whose IO calls sleep as long as the transfer would take at MIBPS
  (``sleep:WRITE/READ``: a rate each way).
* ``memfile``: ``noio`` with an in-memory swap file: each write and read is a NumPy copy (the IO
  threads' memory traffic without system calls, DMA or interrupts).
* ``noio``: ``verify-off`` with no system call either (the swap file is neither written nor read: the
  loaded bytes are stale, the arithmetic goes on with them): what the scheduler, its arena and its
  threads' bookkeeping cost without the IO itself.

``--layers`` also times every layer (a pair of hooks around the scheduler's, so a layer's time leaves
out the scheduler's) and the scheduler's own hooks, with and without offload, summed by role.
Timings are worthless unless nothing else runs on the machine.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import engine.offload.plan as plan_module  # noqa: E402
from engine.backend import get_backend  # noqa: E402
from engine.offload.scheduler import OffloadScheduler  # noqa: E402
from engine.offload.session import offloadable_resident_bytes  # noqa: E402
from engine.optim import SGD  # noqa: E402
from kernels.cpu.batchnorm import batchnorm_forward_infer  # noqa: E402
from kernels.cpu.conv import conv2d_forward, conv2d_forward_workspace_size  # noqa: E402
from models import build_model  # noqa: E402


def _skip_io(storage: Any) -> None:
    """The storage keeps its byte counts but moves nothing (``noio``)."""

    def moved(records: Any, buffer: Any, file_offset: int, step: int = 0, *, what: str) -> None:
        nbytes = sum(r.nbytes for r in records)
        if what == "write":
            storage.bytes_written += nbytes
        else:
            storage.bytes_read += nbytes

    storage.write = lambda *a, **k: moved(*a, **k, what="write")
    storage.read = lambda *a, **k: moved(*a, **k, what="read")


_SPIN_NS_PER_ITERATION = [0.0]


def _spin_kernel() -> Any:
    import numba

    @numba.njit(nogil=True, cache=False)
    def spin(iterations: int) -> int:  # integer work in registers: CPU time without memory traffic
        x = 1
        for _i in range(iterations):
            x = (x * 6364136223846793005 + 1442695040888963407) & 0xFFFFFFFFFFFF
        return x

    spin(10)
    started = time.thread_time()
    spin(20_000_000)
    _SPIN_NS_PER_ITERATION[0] = (time.thread_time() - started) * 1e9 / 20_000_000
    return spin


def _spin_io(storage: Any, us_per_mib: float) -> None:
    """``noio`` whose IO threads burn ``us_per_mib`` of CPU per MiB moved, GIL released, touching no
    memory (``spin:US``): the IO threads' share of the cores without their memory traffic."""
    spin = _spin_kernel()
    _skip_io(storage)
    write, read = storage.write, storage.read

    def burn(records: Any) -> None:
        nbytes = sum(r.nbytes for r in records)
        spin(int(us_per_mib * 1e3 * nbytes / 2**20 / _SPIN_NS_PER_ITERATION[0]))

    storage.write = lambda records, *a, **k: (burn(records), write(records, *a, **k))[1]
    storage.read = lambda records, *a, **k: (burn(records), read(records, *a, **k))[1]


def _sleep_io(storage: Any, write_mib_per_s: float, read_mib_per_s: float) -> None:
    """``noio`` whose IO calls sleep as long as the transfer would take at these rates (``sleep:MIBPS``
    or ``sleep:WRITE/READ``): the IO threads' blocking and wake-ups (a timer instead of the disk's
    interrupt) without their CPU, system calls or memory traffic."""
    _skip_io(storage)
    write, read = storage.write, storage.read

    def wait(records: Any, mib_per_s: float) -> None:
        time.sleep(sum(r.nbytes for r in records) / 2**20 / mib_per_s)

    storage.write = lambda records, *a, **k: (wait(records, write_mib_per_s), write(records, *a, **k))[1]
    storage.read = lambda records, *a, **k: (wait(records, read_mib_per_s), read(records, *a, **k))[1]


def _memory_io(storage: Any) -> None:
    """``noio`` with the swap file in memory (``memfile``): a write copies the unit's arena bytes into
    a buffer, a read copies them back (NumPy copies release the GIL): the IO threads' memory traffic
    and the caches they disturb, without system calls or DMA."""
    _skip_io(storage)
    write, read = storage.write, storage.read
    file = np.empty(storage.capacity_bytes, dtype=np.uint8)

    def write_in_memory(records: Any, buffer: Any, file_offset: int, *a: Any, **k: Any) -> None:
        view = np.frombuffer(buffer, dtype=np.uint8) if not isinstance(buffer, np.ndarray) else buffer.view(np.uint8)
        np.copyto(file[file_offset:file_offset + view.nbytes], view.reshape(-1))
        write(records, buffer, file_offset, *a, **k)

    def read_in_memory(records: Any, buffer: Any, file_offset: int, *a: Any, **k: Any) -> None:
        view = np.frombuffer(buffer, dtype=np.uint8) if not isinstance(buffer, np.ndarray) else buffer.view(np.uint8)
        np.copyto(view.reshape(-1), file[file_offset:file_offset + view.nbytes])
        read(records, buffer, file_offset, *a, **k)

    storage.write = write_in_memory
    storage.read = read_in_memory


def role(graph: Any, index: int) -> str:
    """What a node is in its block, from the graph alone: 'expand-bn' (a batch norm after a 1×1 conv),
    'dw-bn' (after a depthwise conv), 'bn' (after any other conv), 'relu', 'add', 'conv1x1', 'dw', ..."""
    node = graph.nodes[index]
    kind = type(node.layer).__name__
    if kind == "Conv2d":
        layer = node.layer
        if layer.groups > 1 and layer.groups == layer.in_channels:
            return "dw"
        return "conv1x1" if layer.kernel_size == 1 else f"conv{layer.kernel_size}x{layer.kernel_size}"
    if kind == "BatchNorm2d" and node.inputs and node.inputs[0] >= 0:
        producer = role(graph, node.inputs[0])
        if producer == "dw":
            return "dw-bn"
        # a 1×1 conv that widens (MobileNetV2's expand) or narrows (its project)
        conv = graph.nodes[node.inputs[0]].layer
        if producer == "conv1x1":
            return "expand-bn" if conv.out_channels > conv.in_channels else "project-bn"
        return "bn"
    if kind in ("ReLU", "ReLU6") and node.inputs and node.inputs[0] >= 0:
        return f"relu after {role(graph, node.inputs[0])}"
    return kind.lower()


_KEEP: list[str | None] = [None]  # the role whose units the patched plan keeps (set while a plan is built)
_ROLES: dict[str, str] = {}  # unit name -> role
_BLOCKS: list[str | None] = [None]  # --blocks: keep (and recompute) only in these blocks
_plain_occupations = plan_module.occupations_for


def _occupations(unit: Any, window: int, needed_from: int | None = None) -> Any:
    if (_KEEP[0] and unit.backward_start is not None and _ROLES.get(unit.name) == _KEEP[0]
            and (_BLOCKS[0] is None or re.search(rf"\.({_BLOCKS[0]})\.", unit.name))):
        return (plan_module.Occupation(unit.key, 0, unit.created, unit.backward_end),), False
    return _plain_occupations(unit, window, needed_from)


plan_module.occupations_for = _occupations


class RecomputeWork:
    """The work a recompute of each expand batch norm's output would do, at the step it would run."""

    def __init__(self, net: Any, blocks: str | None) -> None:
        graph = net.graph
        self.work: dict[str, tuple[Any, Any]] = {}
        for node in graph.nodes:
            if role(graph, node.index) != "expand-bn" or (blocks and not re.search(rf"\.({blocks})\.", node.name)):
                continue
            conv = graph.nodes[node.inputs[0]]
            relu = [graph.nodes[i] for i in node.consumers if type(graph.nodes[i].layer).__name__.startswith("ReLU")]
            readers = [graph.nodes[i] for r in relu for i in r.consumers]
            for reader in readers:  # the first backward to need the rebuilt output: the last of its readers
                self.work[reader.name] = (conv.layer, node.layer)
        self.buffers: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self.seconds = 0.0

    def before_backward(self, step: int, node: Any) -> None:
        work = self.work.get(node.name)
        if work is None:
            return
        conv, bn = work
        x_shape = tuple(conv.saved["x"].shape)
        if node.name not in self.buffers:
            geometry = (x_shape, conv.weight_shape, conv.stride, conv.padding, conv.groups)
            size = max(int(conv2d_forward_workspace_size(*geometry)), 1)
            self.buffers[node.name] = (np.random.default_rng(1).standard_normal(x_shape).astype(np.float32),
                                       np.empty(conv.output_shape([x_shape]), np.float32), np.empty(size, np.float32))
        x, out, scratch = self.buffers[node.name]
        started = time.perf_counter()
        conv2d_forward(x, _host(conv.params["weight"]), None, out, conv.stride, conv.padding, conv.groups, scratch)
        batchnorm_forward_infer(out, _host(bn.params["weight"]), _host(bn.params["bias"]),
                                _host(bn.buffers["running_mean"]), _host(bn.buffers["running_var"]), out, bn.eps)
        self.seconds += time.perf_counter() - started


def _host(tensor: Any) -> np.ndarray:
    return np.asarray(getattr(tensor, "array", tensor))


class _Start:
    t0 = 0.0

    def before_forward(self, step: int, node: Any) -> None:
        self.t0 = time.perf_counter()

    before_backward = before_forward


class _Stop:
    def __init__(self, start: _Start) -> None:
        self.start = start
        self.seconds: dict[tuple[str, str], float] = collections.defaultdict(float)

    def after_forward(self, step: int, node: Any) -> None:
        self.seconds[node.name, "forward"] += time.perf_counter() - self.start.t0

    def after_backward(self, step: int, node: Any) -> None:
        self.seconds[node.name, "backward"] += time.perf_counter() - self.start.t0


HOOKS = ("on_iteration_start", "create", "before_forward", "after_forward", "before_backward", "after_backward",
         "on_iteration_end")


def step_arguments(doc: str | None, steps: int) -> argparse.ArgumentParser:
    """The options every offload benchmark here takes: the model, batch, image size, measured and
    warm-up steps (this script's and ``offload_threads.py``'s)."""
    parser = argparse.ArgumentParser(description=(doc or "").split("\n")[0])
    parser.add_argument("--model", default="mobilenetv2")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--warmup", type=int, default=2)
    return parser


def time_scheduler_hooks(scheduler: OffloadScheduler) -> dict[str, float]:
    seconds: dict[str, float] = collections.defaultdict(float)
    for name in HOOKS:
        method = getattr(scheduler, name)

        def timed(*args: Any, _method: Any = method, _name: str = name, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return _method(*args, **kwargs)
            finally:
                seconds[_name] += time.perf_counter() - started

        setattr(scheduler, name, timed)
    return seconds


def main() -> None:
    parser = step_arguments(__doc__, steps=10)
    parser.add_argument("--window", type=int, default=4)
    parser.add_argument("--configs", default="n4,keep:expand-bn,recompute:expand-bn,verify-off,eager")
    parser.add_argument("--blocks", default=None,
                        help="keep: and recompute: only in these blocks (a regex on the block index, e.g. '2|3|4')")
    parser.add_argument("--layers", action="store_true", help="also time each layer and the scheduler's hooks")
    args = parser.parse_args()

    backend = get_backend("cpu")
    batch = args.batch_size
    rng = np.random.default_rng(0)

    def build() -> tuple[Any, Any]:
        net = build_model(args.model, num_classes=10, backend=backend, seed=0, image_size=args.image_size)
        return net, SGD(net.parameters, net.gradients, backend, lr=0.01, momentum=0.9)

    probe, _ = build()
    graph = probe.graph
    x = rng.standard_normal((batch, *graph.input_shape)).astype(np.float32)
    y = rng.integers(0, 10, batch).astype(np.int64)
    roles = {node.name: role(graph, node.index) for node in graph.nodes}
    _ROLES.update(roles)
    _BLOCKS[0] = args.blocks

    runs: list[dict[str, Any]] = []
    for config in ["none", *args.configs.split(",")]:
        net, optimizer = build()
        run: dict[str, Any] = {"name": config, "net": net, "optimizer": optimizer, "times": [], "scheduler": None}
        if config != "none":
            kind, _, what = config.partition(":")
            no_verify = ("verify-off", "noio", "spin", "memfile", "sleep")
            options: dict[str, Any] = {"verify": "off"} if kind in no_verify else {}
            if kind == "io-hash":
                options["executor_checks"] = False
            if kind == "unpinned":
                options["io_cpus"] = None
            if kind == "pin":
                options["io_cpus"] = {int(cpu) for cpu in what.split("+")}
            if kind == "budget":  # of what the step keeps for backward without offload
                options["budget_bytes"] = int(float(what) * offloadable_resident_bytes(net, batch))
            _KEEP[0] = what if kind in ("keep", "recompute") else None
            scheduler = OffloadScheduler(backend, args.window, **options)
            scheduler.attach(net, batch_size=batch)
            _KEEP[0] = None
            if kind == "noio":
                _skip_io(scheduler.storage)
            if kind == "spin":
                _spin_io(scheduler.storage, float(what or 60))
            if kind == "sleep":
                rates = (what or "700").split("/")
                _sleep_io(scheduler.storage, float(rates[0]), float(rates[-1]))
            if kind == "memfile":
                _memory_io(scheduler.storage)
            if kind == "eager":
                scheduler._lead = {u.key: 10**6 for u in scheduler.plan_for(batch).load_order}
            if kind == "recompute":
                run["recompute"] = RecomputeWork(net, args.blocks)
                net.hooks.append(run["recompute"])
            run["scheduler"] = scheduler
            if args.layers:
                run["hooks"] = time_scheduler_hooks(scheduler)
        if args.layers:
            start = _Start()
            run["layers"] = _Stop(start)
            net.hooks.insert(0, run["layers"])
            net.hooks.append(start)
        runs.append(run)

    if runs[1:] and runs[1]["scheduler"] is not None:
        plan = runs[1]["scheduler"].plan_for(batch)
        written: dict[str, int] = collections.defaultdict(int)
        for unit in plan.offloaded:
            written[roles[unit.spec.name]] += unit.nbytes
        total = sum(written.values())
        print(f"{args.model} batch {batch}, written per step by the {runs[1]['name']} plan: {total / 2**20:.1f} MiB")
        for name, nbytes in sorted(written.items(), key=lambda kv: -kv[1]):
            print(f"  {name:<22} {nbytes / 2**20:7.1f} MiB  {nbytes / total:5.1%}")

    for step in range(args.warmup + args.steps):
        for run in runs:
            if step == args.warmup:
                for key in ("hooks",):
                    if key in run:
                        run[key].clear()
                if "layers" in run:
                    run["layers"].seconds.clear()
                if "recompute" in run:
                    run["recompute"].seconds = 0.0
            started = time.perf_counter()
            run["net"].forward(x, training=True)
            run["net"].loss(y)
            run["net"].backward()
            run["optimizer"].step()
            if step >= args.warmup:
                run["times"].append(time.perf_counter() - started)

    base = float(np.median(runs[0]["times"]))
    print(f"{'config':<22}{'step ms':>9}{'ratio':>7}{'written MiB':>12}{'saver ms':>9}{'µs/MiB':>7}{'loader ms':>10}"
          f"{'µs/MiB':>7}{'stall ms':>9}{'rebuild ms':>11}{'resident MiB':>13}{'extra work ms':>14}")
    for run in runs:
        median = float(np.median(run["times"]))
        row = f"{run['name']:<22}{1e3 * median:>9.1f}{median / base:>7.3f}"
        scheduler = run["scheduler"]
        if scheduler is not None:
            stats = scheduler.stats[-args.steps:]
            written_mib = float(np.mean([s.bytes_written for s in stats])) / 2**20
            saver = float(np.mean([s.offload_cpu_s for s in stats]))
            loader = float(np.mean([s.onload_cpu_s for s in stats]))
            per_mib = 1e6 / written_mib if written_mib > 0 else 0.0  # nothing written: a budget kept it all
            row += (f"{written_mib:>12.1f}{1e3 * saver:>9.1f}{saver * per_mib:>7.0f}{1e3 * loader:>10.1f}"
                    f"{loader * per_mib:>7.0f}{1e3 * np.mean([s.stall_s for s in stats]):>9.1f}"
                    f"{1e3 * np.mean([s.recompute_s for s in stats]):>11.1f}"
                    f"{max(s.peak_resident_bytes for s in stats) / 2**20:>13.1f}")
            if "recompute" in run:
                row += f"{1e3 * run['recompute'].seconds / args.steps:>14.1f}"
        print(row)

    if args.layers:
        print("\nlayer time per step by role (ms), forward / backward")
        names = [run["name"] for run in runs]
        by_role = []
        for run in runs:
            sums: dict[tuple[str, str], float] = collections.defaultdict(float)
            for (name, direction), seconds in run["layers"].seconds.items():
                sums[roles[name], direction] += 1e3 * seconds / args.steps
            by_role.append(sums)
        keys = sorted(set().union(*by_role), key=lambda k: -by_role[0].get(k, 0.0))
        print(f"{'role':<26}{'':<9}" + "".join(f"{n:>22}" for n in names))
        for key in keys:
            print(f"{key[0]:<26}{key[1]:<9}" + "".join(f"{sums.get(key, 0.0):>22.1f}" for sums in by_role))
        print(f"{'all layers':<35}" + "".join(f"{sum(s.values()):>22.1f}" for s in by_role))
        print("\nscheduler hooks on the executor per step (ms)")
        for run in runs[1:]:
            hooks = run["hooks"]
            print(f"  {run['name']:<22}" + ", ".join(f"{k} {1e3 * hooks[k] / args.steps:.1f}" for k in HOOKS)
                  + f"; total {1e3 * sum(hooks.values()) / args.steps:.1f}")

    for run in runs:
        if run["scheduler"] is not None:
            run["scheduler"].close()
        run["net"].close()


if __name__ == "__main__":
    main()

"""`engine kernels --backend cuda`: every kernel of a training step timed on the GPU, beside its roofline.

The launches of one SGD step are recorded with their real shapes (``counted_step``: nothing runs),
then each distinct launch (kernel, grid and argument shapes) is replayed on fresh arrays of those
shapes: one untimed launch (it compiles the kernel), then ``repeat`` timed ones, the best kept
(CUDA events on a GPU; wall time under the simulator). The roofline time of the same launch comes
from the same ``launch_cost`` the roofline table uses, so the ratio "roofline / measured" is the
fraction of the device's fp32 peak or DRAM bandwidth the kernel reached. The step's measured kernel
time is the sum over its launches (each distinct launch × how often the step runs it).

Replayed arrays are C-contiguous even where the step passed a strided view (dense's ``w.T``):
the timing is of the kernel built for C layout. Integer arrays are zeros (valid indices: labels,
max-pool winners), floats standard normal, masks ones.

Also measured: the host time of one launch (``host_launch_us``), the figure the roofline's
``LAUNCH_HOST_US`` assumes from the numba-cuda tracker.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from engine.bench.cuda_launches import ArrayArg, Launch, counted_step
from engine.bench.roofline import DEVICES, launch_cost


@dataclass
class KernelTiming:
    model: str
    batch: int
    kernel: str
    shape: str
    per_step: int  # launches of this kernel at this shape in one step
    ms: float  # best of repeat, one launch
    roofline_ms: dict[str, float]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def device_name(backend: Any) -> str:
    """The GPU's name (CuPy's device properties), or 'simulator'."""
    if backend.name != "cuda":
        return "simulator"
    props = backend.xp.cuda.runtime.getDeviceProperties(backend.xp.cuda.Device().id)
    name = props["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def _materialize(argument: Any, xp: Any, rng: np.random.Generator) -> Any:
    if not isinstance(argument, ArrayArg):
        return argument
    dtype = np.dtype(argument.dtype)
    if dtype.kind == "f":
        host = rng.standard_normal(argument.shape).astype(dtype)
    elif dtype == np.uint8:
        host = np.ones(argument.shape, dtype)
    else:
        host = np.zeros(argument.shape, dtype)
    return xp.asarray(host)


def _timer(backend: Any) -> Any:
    """A function running ``call`` once and returning its time in ms (CUDA events on a GPU)."""
    if backend.name == "cuda":
        xp = backend.xp

        def timed(call: Any) -> float:
            start, end = xp.cuda.Event(), xp.cuda.Event()
            start.record()
            call()
            end.record()
            end.synchronize()
            return float(xp.cuda.get_elapsed_time(start, end))

        return timed

    def wall(call: Any) -> float:
        start = time.perf_counter()
        call()
        return (time.perf_counter() - start) * 1e3

    return wall


def _launch_key(launch: Launch) -> tuple[Any, ...]:
    return (launch.kernel, launch.blocks, launch.threads, tuple(a.shape if isinstance(a, ArrayArg) else a
                                                                  for a in launch.args))


def time_step_kernels(
    model: str,
    batch: int,
    backend: Any,
    repeat: int = 5,
    image_size: int = 32,
    progress: Any = None,
    measure: Any = None,
    **model_options: Any,
) -> list[KernelTiming]:
    """Replay every distinct launch of one training step of ``model`` on ``backend`` and time it.

    ``measure(call)``, when given, returns the launch's ms itself (``benchmarks/gpu_kernel_profile.py``
    times launches inside a CUDA graph); by default one evented launch, the best of ``repeat``."""
    from engine.backend import counting_backend
    from kernels.cuda._launch import launch as run_launch

    _, launches = counted_step(model, batch, counting_backend(), image_size, **model_options)
    distinct: dict[tuple[Any, ...], tuple[Launch, int]] = {}
    for launch in launches:
        key = _launch_key(launch)
        first, count = distinct.get(key, (launch, 0))
        distinct[key] = (first, count + 1)
    timed = _timer(backend)
    rng = np.random.default_rng(0)
    rows = []
    for launch, count in distinct.values():
        args = [_materialize(a, backend.xp, rng) for a in launch.args]

        def call(launch: Launch = launch, args: list[Any] = args) -> None:
            run_launch(launch.function, launch.blocks, launch.threads, *args)

        if measure is not None:
            ms = measure(call)
        else:
            if backend.name == "cuda":
                timed(call)  # compiles on the first launch (the simulator compiles nothing)
            ms = min(timed(call) for _ in range(max(1, repeat)))
        cost = launch_cost(launch)
        rows.append(KernelTiming(model, batch, launch.kernel, cost.shape, count, ms,
                                 {d.name: cost.seconds(d) * 1e3 for d in DEVICES}))
        if progress:
            progress(rows[-1])
    return rows


def host_launch_us(backend: Any, launches: int = 200) -> float:
    """Host microseconds per launch of a one-element ReLU (queued back to back, then one sync)."""
    from kernels.cuda import TABLE

    x = backend.xp.zeros(1, np.float32)
    relu = TABLE["relu_forward"]
    relu(x, x)
    backend.synchronize()
    start = time.perf_counter()
    for _ in range(launches):
        relu(x, x)
    elapsed = time.perf_counter() - start
    backend.synchronize()
    return elapsed / launches * 1e6


def render_timings(rows: list[KernelTiming], device: str, console: Any = None) -> None:
    """The measured kernels against the roofline, through engine/report.py (no cell cut)."""
    from engine.report import Table, render_table

    roof = next((d.name for d in DEVICES if d.name.split()[0] in device), None)
    title = (f"kernel timings on {device} (best of repeats) against the roofline"
             + ("" if roof else " (device is neither A100 nor H100: H100 roofline shown)"))
    roof = roof or DEVICES[1].name
    columns = ["model", "batch", "kernel", "shape", "per step", "ms", f"roofline ms ({roof})", "% of roofline"]
    table = Table(title, columns,
                  right={i for i, name in enumerate(columns) if name not in ("model", "kernel", "shape")})
    for r in rows:
        table.add_row(r.model, str(r.batch), r.kernel, r.shape, str(r.per_step), f"{r.ms:.4f}",
                      f"{r.roofline_ms[roof]:.4f}", f"{100 * r.roofline_ms[roof] / r.ms:.1f}%" if r.ms else "")
    for model in dict.fromkeys(r.model for r in rows):
        mine = [r for r in rows if r.model == model]
        measured = sum(r.ms * r.per_step for r in mine)
        predicted = sum(r.roofline_ms[roof] * r.per_step for r in mine)
        table.notes.append(f"{model}: kernels of one step {measured:.2f} ms measured, {predicted:.2f} ms roofline "
                           f"({roof})")
    render_table(table, console)


def run_timings(models: str, batch: int, repeat: int, output_format: str, output: str | None) -> list[dict[str, Any]]:
    """The `engine kernels --backend cuda` command (a GPU is needed; the CLI checked it)."""
    from engine.backend import get_backend

    backend = get_backend("cuda")
    chosen = [m.strip() for m in models.split(",") if m.strip()]
    rows = [row for m in chosen for row in time_step_kernels(m, batch, backend, repeat)]
    records = [r.as_dict() for r in rows]
    if output:
        with open(output, "w") as handle:
            json.dump(records, handle, indent=2)
    if output_format == "json":
        print(json.dumps(records, indent=2))
    else:
        render_timings(rows, device_name(backend))
    return records

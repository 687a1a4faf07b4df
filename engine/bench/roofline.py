"""A roofline on paper: what each CUDA kernel of a training step may cost on an A100 and an H100.

Every launch of one SGD training step is recorded with its real shapes (``counted_step``: the
launchers run under ``count_only``, nothing executes, no GPU needed). For each launch:

- FLOPs: 2·M·N·K·groups for a GEMM (conv's implicit GEMMs and dense), 2·outputs·(C/g)·R·S for the
  direct depthwise kernels, and a per-element count for the rest (``ELEMENT_FLOPS``: a handful of
  operations per element, too few to matter).
- bytes: every array argument moved once between DRAM and the SM (compulsory traffic; an argument
  that is read and written, such as a bias added in place, counts twice). Re-reads are assumed to
  hit L2 (an A100 has 40 MB, an H100 50 MB; a batch-norm channel at batch 32 is 128 KB), so this is
  the lower bound every version of a kernel is measured against.
- time: max(FLOPs / fp32 peak, bytes / DRAM bandwidth), the roofline, on each device below. A kernel
  is bandwidth-bound when its intensity (FLOPs/byte) is below the device's ridge point
  (peak/bandwidth: 9.6 FLOP/B on an A100, 20 on an H100).

The step's predicted time is the sum over its launches (kernels run one after another on one
stream). Beside it: the host time of issuing the launches, at ``LAUNCH_HOST_US`` each, which on
these GPUs is larger than the kernels' roofline time at batch 32.

Which GEMM version should win follows from the tile each version stages per global load (operational
intensity against L2/DRAM): v1 reloads A and B per FMA (2 FLOPs per 8 bytes: 0.25 FLOP/B), v2's 16×16
tile reuses each staged value 16 times (4 FLOP/B), v3's 64×64 tile 64 times (16 FLOP/B, above the
A100's DRAM ridge and near the H100's). Only v3 can approach the compute roof; v1 and v2 are
bandwidth-bound on the GEMMs by construction.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Any

from engine.bench.cuda_launches import ArrayArg, Launch, counted_step


@dataclass(frozen=True)
class Device:
    """Published fp32 (non-tensor-core) peak and DRAM bandwidth of one GPU, with the source."""

    name: str
    fp32_flops: float
    bandwidth: float  # bytes/s
    source: str

    @property
    def ridge(self) -> float:
        return self.fp32_flops / self.bandwidth


DEVICES = (
    Device(
        "A100 SXM4 80GB",
        19.5e12,
        2.039e12,
        "NVIDIA A100 Tensor Core GPU datasheet: FP32 19.5 TFLOPS, HBM2e 2,039 GB/s (80 GB SXM)",
    ),
    Device(
        "H100 SXM5",
        67.0e12,
        3.35e12,
        "NVIDIA H100 Tensor Core GPU datasheet: FP32 67 TFLOPS, HBM3 3.35 TB/s (SXM)",
    ),
)

LAUNCH_HOST_US = 89.0
"""Host time of one numba-cuda launch with CuPy arguments: 87–90 µs per launch of a three-array
vector add, numba_cuda baseline in NVIDIA/numba-cuda-mlir PR #90 (RTX 6000 Ada, CUDA 13.2); see
also NVIDIA/numba-cuda #578. Not measured here (no GPU): the acceptance run measures it."""

ELEMENT_FLOPS = {
    "batchnorm_train_kernel": 8,  # sum, squared deviation, normalize (sub, mul, fma)
    "batchnorm_backward_from_output_kernel": 10,
    # a channel split over several blocks (kernels/cuda/batchnorm.py): statistics, then normalize
    "batchnorm_partial_stats_kernel": 4,  # sum, squared deviation (sub, fma)
    "batchnorm_normalize_kernel": 3,
    "batchnorm_backward_partials_kernel": 5,  # Σ dout, Σ dout·x̂ (sub, mul, add, fma)
    "batchnorm_backward_apply_kernel": 5,
    "batchnorm_infer_kernel": 3,
    "adam_kernel": 12,
    "sgd_kernel": 5,
    "softmax_xent_forward_kernel": 6,
}

GEMM_SUFFIXES = ("_v1_naive", "_v2_tiled", "_v3_register_blocked")
"""The numbered GEMM versions' kernel names end so; the tile family's hold ``_tiles_`` (``is_gemm``)."""


def is_gemm(kernel: str) -> bool:
    return kernel.endswith(GEMM_SUFFIXES) or "_tiles_" in kernel
READ_AND_WRITTEN = {"add_channel_bias": (0,), "sgd_kernel": (0, 2), "adam_kernel": (0, 2, 3)}
"""Arguments a kernel both reads and writes (their bytes count twice): x += bias, param and state updates."""


@dataclass(frozen=True)
class KernelCost:
    """One launch's work: FLOPs, bytes, and a label for its shape."""

    kernel: str
    shape: str
    flops: float
    bytes: float

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes if self.bytes else float("inf")

    def seconds(self, device: Device) -> float:
        return max(self.flops / device.fp32_flops, self.bytes / device.bandwidth)


def launch_cost(launch: Launch) -> KernelCost:
    """FLOPs and compulsory bytes of one recorded launch (see the module docstring for the model)."""
    arrays = [(i, a) for i, a in enumerate(launch.args) if isinstance(a, ArrayArg)]
    moved = float(sum(a.nbytes for _, a in arrays))
    moved += sum(launch.args[i].nbytes for i in READ_AND_WRITTEN.get(launch.kernel, ()))
    name = launch.kernel
    if is_gemm(name):
        A, B, C, M, N, K, _chunk, geom, accumulate = launch.args
        splits = geom[11] or 1  # geom[10]: phases per group (backward data's stride²), each its own GEMM
        groups = launch.blocks[2] // splits if isinstance(launch.blocks, tuple) and len(launch.blocks) == 3 else 1
        if accumulate:
            moved += C.nbytes
        flops = 2.0 * M * N * K * groups
        shape = f"{M}x{N}x{K}" + (f" g{groups}" if groups > 1 else "") + (f" split{splits}" if splits > 1 else "")
        return KernelCost(name, shape, flops, moved)
    if name.startswith("direct_conv_"):
        w = launch.args[1]  # (x|dout, w, out|dx|dw, ...) for forward and backward data; weight: (x, dout, dw)
        dout_or_out = launch.args[2] if name == "direct_conv_forward" else launch.args[0]
        if name == "direct_conv_backward_weight":
            w, dout_or_out = launch.args[2], launch.args[1]
        per_output = w.shape[1] * w.shape[2] * w.shape[3]
        flops = 2.0 * dout_or_out.size * per_output
        return KernelCost(name, "x".join(map(str, launch.args[0].shape)), flops, moved)
    largest = max((a for _, a in arrays), key=lambda a: a.size)
    flops = float(ELEMENT_FLOPS.get(name, 1) * largest.size)
    return KernelCost(name, "x".join(map(str, largest.shape)), flops, moved)


@dataclass
class RooflineRow:
    """Launches of one kernel at one shape within a step, with their summed cost and roofline times."""

    model: str
    batch: int
    kernel: str
    shape: str
    launches: int
    flops: float
    bytes: float
    intensity: float
    seconds: dict[str, float]
    bound: dict[str, str]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class StepRoofline:
    model: str
    batch: int
    launches: int
    rows: list[RooflineRow]
    seconds: dict[str, float]  # predicted kernel time per device
    launch_host_seconds: float

    def predicted_step_seconds(self, device: str) -> float:
        """max(kernel time, host launch time): launches are asynchronous on one stream, so the GPU
        works while the host issues; whichever is longer sets the step (the trainer syncs once a step)."""
        return max(self.seconds[device], self.launch_host_seconds)

    def as_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "batch": self.batch,
            "launches": self.launches,
            "predicted_kernel_seconds": self.seconds,
            "predicted_step_seconds": {d.name: self.predicted_step_seconds(d.name) for d in DEVICES},
            "launch_host_seconds": self.launch_host_seconds,
            "flops": sum(r.flops for r in self.rows),
            "bytes": sum(r.bytes for r in self.rows),
            "rows": [r.as_dict() for r in self.rows],
        }


def step_roofline(model: str, batch: int, backend: Any, image_size: int = 32) -> StepRoofline:
    """The roofline of one training step of ``model`` at ``batch`` (launches recorded, not run)."""
    _, launches = counted_step(model, batch, backend, image_size)
    groups: dict[tuple[str, str], list[KernelCost]] = defaultdict(list)
    for launch in launches:
        cost = launch_cost(launch)
        groups[(cost.kernel, cost.shape)].append(cost)
    rows = []
    for (kernel, shape), costs in groups.items():
        flops = sum(c.flops for c in costs)
        moved = sum(c.bytes for c in costs)
        seconds = {d.name: sum(c.seconds(d) for c in costs) for d in DEVICES}
        bound = {d.name: ("compute" if flops / moved >= d.ridge else "bandwidth") for d in DEVICES}
        rows.append(RooflineRow(model, batch, kernel, shape, len(costs), flops, moved, flops / moved, seconds, bound))
    rows.sort(key=lambda r: -r.seconds[DEVICES[1].name])
    totals = {d.name: sum(r.seconds[d.name] for r in rows) for d in DEVICES}
    return StepRoofline(model, batch, len(launches), rows, totals, len(launches) * LAUNCH_HOST_US * 1e-6)


def by_kernel(step: StepRoofline) -> list[dict[str, Any]]:
    """The step's rows summed per kernel: the short table (launches, GFLOP, MB, time per device)."""
    merged: dict[str, dict[str, Any]] = {}
    for r in step.rows:
        m = merged.setdefault(r.kernel, {"kernel": r.kernel, "launches": 0, "flops": 0.0, "bytes": 0.0,
                                         "seconds": {d.name: 0.0 for d in DEVICES}})
        m["launches"] += r.launches
        m["flops"] += r.flops
        m["bytes"] += r.bytes
        for d in DEVICES:
            m["seconds"][d.name] += r.seconds[d.name]
    out = list(merged.values())
    for m in out:
        m["intensity"] = m["flops"] / m["bytes"] if m["bytes"] else float("inf")
        m["bound"] = {d.name: ("compute" if m["intensity"] >= d.ridge else "bandwidth") for d in DEVICES}
    out.sort(key=lambda m: -m["seconds"][DEVICES[1].name])
    return out


def roofline_tables(steps: list[StepRoofline], detail: bool = False) -> list[Any]:
    """The --roofline tables (engine/report.py ``Table``s): the step summary, then per kernel for each step."""
    from engine.report import Table

    a100, h100 = DEVICES
    columns = ["model", "batch", "launches", "GFLOP", "GB moved", f"{a100.name} ms", f"{h100.name} ms",
               f"launch host ms (@{LAUNCH_HOST_US:.0f} µs)", "step ms A100 / H100"]
    summary = Table("Predicted training step (SGD), fp32 roofline: kernel time summed over every launch; "
                    "step = max(kernels, host launches)", columns, right=set(range(1, len(columns))))
    for s in steps:
        summary.add_row(s.model, str(s.batch), str(s.launches), f"{sum(r.flops for r in s.rows) / 1e9:.1f}",
                        f"{sum(r.bytes for r in s.rows) / 1e9:.2f}", f"{s.seconds[a100.name] * 1e3:.2f}",
                        f"{s.seconds[h100.name] * 1e3:.2f}", f"{s.launch_host_seconds * 1e3:.1f}",
                        f"{s.predicted_step_seconds(a100.name) * 1e3:.1f} / "
                        f"{s.predicted_step_seconds(h100.name) * 1e3:.1f}")
    tables = [summary]
    for s in steps:
        columns = ["kernel", "launches", "GFLOP", "MB", "FLOP/B", f"{a100.name} ms", f"{h100.name} ms",
                   "bound (A100/H100)"]
        table = Table(f"{s.model}, batch {s.batch}: per kernel (sorted by H100 time)", columns,
                      right=set(range(1, len(columns) - 1)))
        for m in by_kernel(s):
            table.add_row(m["kernel"], str(m["launches"]), f"{m['flops'] / 1e9:.2f}", f"{m['bytes'] / 1e6:.1f}",
                          f"{m['intensity']:.1f}", f"{m['seconds'][a100.name] * 1e3:.3f}",
                          f"{m['seconds'][h100.name] * 1e3:.3f}", f"{m['bound'][a100.name]}/{m['bound'][h100.name]}")
        tables.append(table)
        if detail:
            rows = Table(f"{s.model}, batch {s.batch}: per kernel and shape",
                         ["kernel", "shape", "n", "GFLOP", "MB", "FLOP/B", f"{h100.name} ms", "bound H100"])
            for r in s.rows:
                rows.add_row(r.kernel, r.shape, str(r.launches), f"{r.flops / 1e9:.3f}", f"{r.bytes / 1e6:.2f}",
                             f"{r.intensity:.1f}", f"{r.seconds[h100.name] * 1e3:.4f}", r.bound[h100.name])
            tables.append(rows)
    tables[-1].notes += [f"{d.name}: {d.source}; ridge {d.ridge:.1f} FLOP/B" for d in DEVICES]
    return tables


def render_roofline(steps: list[StepRoofline], console: Any = None, detail: bool = False) -> None:
    """Print ``roofline_tables`` through engine/report.py (no kernel name or shape cut on a narrow terminal)."""
    from engine.report import make_console, render_table

    console = console or make_console()
    for table in roofline_tables(steps, detail):
        render_table(table, console)

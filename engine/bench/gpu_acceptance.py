"""The acceptance run for the day a GPU is lent: `bash benchmarks/gpu_acceptance.sh` (run it first).

Four parts, one report (table and JSON), a non-zero exit when anything fails:

1. **Every CUDA kernel against its NumPy reference, at real shapes, on real data.** One SGD training
   step and one inference pass of ResNet-18 and MobileNetV2 (batch 32, 32×32), and one Adam step of
   a small graph holding the layers those two lack (grouped conv with bias, max and average pools,
   dropout, ReLU, a dense layer with bias), run on the GPU with every kernel call intercepted
   (``KernelTable.intercept``): each distinct (op, shapes) call gets its inputs copied to the host
   first, runs on the GPU, and the reference (kernels/reference) runs on the copies; every array
   argument must then agree within ``TOLERANCE`` × max(1, |reference|). Ops of the kernel table that
   no call reached are failures too, so "every kernel" is checked, not assumed.
2. **Kernel timings against the roofline** (engine/bench/cuda_timing.py): every distinct launch of
   a training step replayed and timed with CUDA events, beside its roofline time on this device, and
   the host time of one launch (the roofline's assumed 89 µs).
3. **Training**: `engine train --backend cuda` for a few steps with and without `--offload-n`
   (pinned staging); both must finish, and with the same final loss (offload never changes the
   numbers).
4. **The verdict**: PASS or FAIL, with what failed.

`--backend cudasim --tiny` runs the same code in the CUDA simulator at tiny shapes (a 4×4 cnn of
width 2, batch 2): that is how CI keeps this command working on machines without a GPU
(tests/engine/test_gpu_acceptance_cudasim.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

TOLERANCE = 1e-3
"""Largest |CUDA − reference| allowed, relative to max(1, |reference|). fp32 sums of up to 32,768
products (a weight gradient at batch 32) in another order differ from the float64-minded reference
by ~1e-5 relative; a wrong index or a race is O(1)."""

SKIP_COMPARE = {"conv2d_forward": {7}, "conv2d_backward_data": {6}, "conv2d_backward_weight": {7},
                "batchnorm_forward_train": {6}, "batchnorm_backward_from_output": {8}}
"""Arguments not compared: conv's scratch (the reference uses none, the CUDA kernels their own way), and batch
norm's (the CUDA kernels' partial statistics after save_mean's C batch means, whose errors show in out and the
running mean; backward's partial sums)."""


@dataclass
class Check:
    op: str
    shapes: str
    max_abs_err: float
    scale: float
    ok: bool


@dataclass
class TrainRun:
    offload: str | None
    returncode: int
    seconds: float
    final_loss: float | None
    output_tail: str


@dataclass
class Report:
    backend: str
    device: str
    checks: list[Check] = field(default_factory=list)
    uncovered: list[str] = field(default_factory=list)
    timings: list[dict[str, Any]] = field(default_factory=list)
    host_launch_us: float | None = None
    train: list[TrainRun] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _is_array(value: Any) -> bool:
    return getattr(value, "ndim", 0) >= 1


def _identity(array: Any) -> tuple[Any, ...]:
    interface = getattr(array, "__cuda_array_interface__", None) or array.__array_interface__
    return (interface["data"][0], tuple(array.shape), tuple(array.strides))


class ReferenceChecker:
    """A ``KernelTable.intercept`` hook: runs each distinct call on the backend and on the reference."""

    def __init__(self, backend: Any, tolerance: float = TOLERANCE):
        from kernels.reference import TABLE

        self.backend = backend
        self.reference = dict(TABLE)
        self.tolerance = tolerance
        self.checks: list[Check] = []
        self.seen: set[tuple[Any, ...]] = set()

    def __call__(self, op: str, function: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if kwargs or op not in self.reference or op.endswith("_workspace_size"):
            return function(*args, **kwargs)
        key = (op, tuple(tuple(a.shape) if _is_array(a) else repr(a) for a in args))
        if key in self.seen:
            return function(*args)
        self.seen.add(key)
        copies: dict[tuple[Any, ...], np.ndarray] = {}
        reference_args = []
        for a in args:  # arguments that alias (relu in place) share one host copy, as they share memory
            if _is_array(a):
                identity = _identity(a)
                if identity not in copies:
                    copies[identity] = np.array(self.backend.to_host(a), copy=True)
                reference_args.append(copies[identity])
            else:
                reference_args.append(a)
        result = function(*args)
        self.backend.synchronize()
        self.reference[op](*reference_args)
        worst, scale = 0.0, 1.0
        for i, a in enumerate(args):
            if not _is_array(a) or i in SKIP_COMPARE.get(op, ()):
                continue
            got = np.asarray(self.backend.to_host(a), dtype=np.float64)
            want = np.asarray(reference_args[i], dtype=np.float64)
            if got.size:
                worst = max(worst, float(np.max(np.abs(got - want))))
                scale = max(scale, float(np.max(np.abs(want))))
        shapes = " ".join("x".join(map(str, a.shape)) for a in args if _is_array(a))
        self.checks.append(Check(op, shapes, worst, scale, bool(worst <= self.tolerance * scale)))
        return result


def coverage_graph(channels: int, image: int) -> Any:
    """Every layer kind in one small graph: the grouped conv with bias, pools, dropout, LeakyReLU and dense with
    bias that ResNet-18 and MobileNetV2 lack, and the ReLU6, residual add and global pool they have (so the
    tiny CI run, whose cnn has neither, still reaches every kernel)."""
    from engine.graph import Graph
    from engine.layers import (
        Add,
        AvgPool2d,
        BatchNorm2d,
        Conv2d,
        Dense,
        Dropout,
        GlobalAvgPool,
        LeakyReLU,
        MaxPool2d,
        ReLU,
        ReLU6,
    )

    return Graph(
        [
            ("conv", Conv2d(3, channels, 3, 1, 1, bias=True), ["input"]),
            ("bn", BatchNorm2d(channels), ["conv"]),
            ("relu", ReLU(), ["bn"]),
            ("grouped", Conv2d(channels, channels, 3, 1, 1, groups=2, bias=True), ["relu"]),
            ("relu6", ReLU6(), ["grouped"]),
            ("add", Add(), ["relu6", "relu"]),
            ("leaky", LeakyReLU(0.1), ["add"]),
            ("max", MaxPool2d(2), ["leaky"]),
            ("avg", AvgPool2d(2), ["max"]),
            ("gap", GlobalAvgPool(), ["avg"]),
            ("drop", Dropout(0.5), ["gap"]),
            ("fc", Dense(channels, 10), ["drop"]),
        ],
        input_shape=(3, image, image),
    )


def check_kernels(backend: Any, tiny: bool, log: Any = print) -> tuple[list[Check], list[str]]:
    """Part 1: every kernel call of real steps against the reference; returns checks and uncovered ops."""
    from engine.network import Network
    from engine.optim import make_optimizer
    from kernels.cuda import TABLE
    from models import build_model

    checker = ReferenceChecker(backend)
    rng = np.random.default_rng(0)
    batch, image = (2, 4) if tiny else (32, 32)
    nets = []
    if tiny:
        nets.append(("cnn", lambda: build_model("cnn", 10, backend, seed=0, image_size=image, width=2), "sgd"))
    else:
        for name in ("resnet18", "mobilenetv2"):
            nets.append((name, lambda name=name: build_model(name, 10, backend, seed=0, image_size=image), "sgd"))
    channels = 4 if tiny else 64
    nets.append(("coverage", lambda: Network(coverage_graph(channels, image), backend, seed=0), "adam"))
    for name, build, optimizer_name in nets:
        start = time.perf_counter()
        net = build()
        try:
            optimizer = make_optimizer(optimizer_name, net, backend, 0.01, momentum=0.9, manager=net.mgr)
            x = backend.to_device(rng.standard_normal((batch, 3, image, image)).astype(np.float32))
            y = backend.to_device(rng.integers(0, 10, batch).astype(np.int64))
            with net.backend.kernels.intercept(checker):
                net.forward(x, training=True)
                net.loss(y)
                net.backward()
                optimizer.step()
                net.forward(x, training=False)
        finally:
            net.close()
        log(f"checked {name} ({optimizer_name} step + inference) in {time.perf_counter() - start:.1f} s")
    covered = {c.op for c in checker.checks}
    uncovered = sorted(op for op in TABLE if not op.endswith("_workspace_size") and op not in covered)
    return checker.checks, uncovered


def train_runs(backend_name: str, tiny: bool, log: Any = print) -> list[TrainRun]:
    """Part 3: `engine train` with and without offload, in child processes (as a user runs it)."""
    root = Path(__file__).resolve().parents[2]
    runs = []
    with tempfile.TemporaryDirectory(prefix="gpu-acceptance-") as tmp:
        if tiny:
            rng = np.random.default_rng(0)
            data = os.path.join(tmp, "tiny.npz")
            np.savez(data, x=rng.standard_normal((6, 3, 4, 4)).astype(np.float32), y=rng.integers(0, 3, 6),
                     x_test=rng.standard_normal((2, 3, 4, 4)).astype(np.float32), y_test=rng.integers(0, 3, 2))
            common = ["--model", "cnn", "--data", f"npz:{data}", "--batch-size", "2", "--steps", "1"]
            offload = "1"
        else:
            common = ["--model", "resnet18", "--data", "synthetic", "--batch-size", "32", "--steps", "10"]
            offload = "4"
        for window in (None, offload):
            summary = os.path.join(tmp, f"summary-{window}.json")
            command = [sys.executable, str(root / "cli.py"), "train", *common, "--backend", backend_name,
                       "--no-progress", "--prefetch", "0", "--summary-json", summary, "--seed", "0"]
            if window is not None:
                command += ["--offload-n", window, "--offload-dir", tmp]
            start = time.perf_counter()
            done = subprocess.run(command, capture_output=True, text=True, cwd=root)
            seconds = time.perf_counter() - start
            loss = None
            if done.returncode == 0 and os.path.exists(summary):
                with open(summary, encoding="utf-8") as handle:
                    loss = json.load(handle).get("final_loss")
            tail = (done.stdout + done.stderr)[-600:]
            runs.append(TrainRun(window, done.returncode, seconds, loss, tail))
            log(f"engine train{' --offload-n ' + window if window else ''}: exit {done.returncode}, "
                f"{seconds:.1f} s, final loss {loss}")
    return runs


def run_acceptance(backend_name: str = "cuda", tiny: bool = False, repeat: int = 5, log: Any = print,
                   timings: bool = True, train: bool = True) -> Report:
    """All four parts; ``backend_name`` is cuda on a GPU, cudasim (with ``tiny``) in CI."""
    from engine.backend import get_backend
    from engine.bench.cuda_timing import device_name, host_launch_us, time_step_kernels

    backend = get_backend(backend_name)
    report = Report(backend_name, device_name(backend))
    log(f"acceptance on {report.device} ({backend_name}{', tiny shapes' if tiny else ''})")

    report.checks, report.uncovered = check_kernels(backend, tiny, log)
    bad = [c for c in report.checks if not c.ok]
    report.failures += [f"{c.op} [{c.shapes}]: max |err| {c.max_abs_err:.3g} > {TOLERANCE} × {c.scale:.3g}"
                        for c in bad]
    report.failures += [f"{op}: no call reached it (not checked)" for op in report.uncovered]

    if timings:  # the session script leaves parts 2 and 3 to benchmarks/gpu_step_bench.py (one 8-minute run)
        if tiny:
            timed = time_step_kernels("cnn", 2, backend, repeat=1, image_size=4, width=2)
        else:
            timed = [r for m in ("resnet18", "mobilenetv2") for r in time_step_kernels(m, 32, backend, repeat)]
        report.timings = [t.as_dict() for t in timed]
        report.host_launch_us = host_launch_us(backend, 20 if tiny else 500)
        log(f"timed {len(timed)} distinct launches; host time per launch {report.host_launch_us:.1f} µs")

    report.train = train_runs(backend_name, tiny, log) if train else []
    for run in report.train:
        if run.returncode != 0:
            report.failures.append(f"engine train (offload {run.offload}) exited {run.returncode}: {run.output_tail}")
    losses = {run.final_loss for run in report.train}
    if len(report.train) == 2 and all(r.returncode == 0 for r in report.train) and len(losses) != 1:
        report.failures.append(f"offload changed the final loss: {[r.final_loss for r in report.train]}")
    return report


def render_report(report: Report, console: Any = None) -> None:
    """The acceptance report: its tables through engine/report.py (no cell cut), then PASS or FAIL."""
    from engine.bench.cuda_timing import KernelTiming, render_timings
    from engine.report import Table, make_console, render_table

    console = console or make_console()
    checks = Table(f"1. kernels against the NumPy reference ({report.device})",
                   ["op", "shapes", "max |err|", "scale", "ok"])
    for c in report.checks:
        checks.add_row(c.op, c.shapes, f"{c.max_abs_err:.2e}", f"{c.scale:.3g}", "ok" if c.ok else "FAIL")
    checks.notes.append(f"ops not reached: {', '.join(report.uncovered) or 'none'}")
    render_table(checks, console)
    render_timings([KernelTiming(**t) for t in report.timings], report.device, console)
    if report.host_launch_us is not None:
        console.print(f"2. host time per launch: {report.host_launch_us:.1f} µs (roofline assumes 89 µs)")
    train = Table("3. engine train with and without offload", ["offload-n", "exit", "seconds", "final loss"])
    for r in report.train:
        train.add_row(r.offload or "off", str(r.returncode), f"{r.seconds:.1f}", str(r.final_loss))
    render_table(train, console)
    if report.failures:
        console.print("[bold red]4. FAIL[/bold red]")
        for failure in report.failures:
            console.print(f"  - {failure}", markup=False, soft_wrap=True)
    else:
        console.print(f"[bold green]4. PASS[/bold green]: {len(report.checks)} kernel checks, "
                      f"{len(report.timings)} timed launches, training with and without offload agree")

def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("cuda", "cudasim"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (what the simulator can run)")
    parser.add_argument("--repeat", type=int, default=5, help="timed launches per kernel; the best counts")
    parser.add_argument("--output", default="gpu_acceptance.json", help="where the JSON report goes")
    parser.add_argument("--no-timings", action="store_true", help="skip part 2 (per-launch timings)")
    parser.add_argument("--no-train", action="store_true", help="skip part 3 (engine train with and without offload)")
    options = parser.parse_args(argv)
    from engine.backend import BackendUnavailable, get_backend

    try:
        get_backend(options.backend)  # cudasim: switches the simulator on before numba is imported
    except BackendUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    report = run_acceptance(options.backend, options.tiny, options.repeat, timings=not options.no_timings,
                            train=not options.no_train)
    with open(options.output, "w", encoding="utf-8") as handle:
        json.dump(report.as_dict(), handle, indent=2)
    render_report(report)
    print(f"report written to {options.output}")
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())

"""``engine bench``: what offload costs in time and saves in memory, per batch size.

For each batch size one process trains the same model twice on the same seeded batch, without
offload and with ``--offload-n N``, alternating their steps so both see the same machine load; it
reports per-step timings (microseconds, as in nntrainer issue #789's table: forward+backward,
offload = the saver's busy time, onload = the loader's, stall = the executor waiting), step wall and
CPU time, the peak bytes of offloadable tensors (ACTIVATIONS + FF_CACHE) resident at once and the
page-cache bytes of the swap file (mincore, sampled when the most data is on disk: at the first
backward step). Two more processes, one per configuration, measure the peak RSS the OS sees (one
run's memory must not hide in the other's).

    python -m engine.bench.offload --worker '{"model": "resnet18", "windows": [null, 4], ...}'
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

import numpy as np

TIMING_KEYS = ("forward_backward", "offload", "onload", "stall")
TABLE_LABELS = {"forward_backward": "forward + backward", "offload": "offload", "onload": "onload", "stall": "stall"}


def summarize(values_s: list[float]) -> dict[str, float]:
    """avg/min/max/sum in microseconds (the seed table's columns)."""
    us = np.asarray(values_s, dtype=np.float64) * 1e6
    if us.size == 0:
        us = np.zeros(1)
    return {"avg": float(us.mean()), "min": float(us.min()), "max": float(us.max()), "sum": float(us.sum())}


class _RssSampler:
    """A network hook sampling RSS a few times per step (at the end of forward: the no-offload peak)."""

    def __init__(self) -> None:
        import psutil

        self._process = psutil.Process()
        self.peak = 0
        self._calls = 0

    def sample(self) -> None:
        self.peak = max(self.peak, self._process.memory_info().rss)

    def before_backward(self, step: int, node: Any) -> None:
        self._calls += 1
        if self._calls % 8 == 1:
            self.sample()

    def on_iteration_end(self, net: Any) -> None:
        self.sample()


class _Run:
    """One network (with or without an offload scheduler) training on a fixed seeded batch."""

    def __init__(self, config: dict[str, Any], window: int | str | None):
        from engine.backend import get_backend
        from engine.offload.scheduler import OffloadScheduler
        from engine.optim import SGD
        from models import build_model

        self.backend = backend = get_backend(config["backend"])
        options = {"image_size": config["image_size"]} if config["model"] in ("resnet18", "mobilenetv2", "cnn") else {}
        if config.get("variant"):
            options["variant"] = config["variant"]
        self.net = build_model(config["model"], num_classes=10, backend=backend, seed=0, **options)
        self.optimizer = SGD(self.net.parameters, self.net.gradients, backend, lr=0.01, momentum=0.9)
        batch = config["batch_size"]
        rng = np.random.default_rng(0)
        self.x = backend.to_device(rng.standard_normal((batch, *self.net.graph.input_shape)).astype(np.float32))
        self.y = backend.to_device(rng.integers(0, 10, batch).astype(np.int64))
        self.scheduler = None
        self.budget_bytes = None
        if window is not None:
            from engine.offload.budget import parse_budget

            budget = parse_budget(config.get("budget"))
            self.budget_bytes = budget.bytes_for(self.net, batch) if budget is not None else None
            self.scheduler = OffloadScheduler(backend, window, directory=config.get("directory"),
                                              sample_page_cache=True, budget_bytes=self.budget_bytes)
            self.scheduler.attach(self.net, batch_size=batch)
        self.step_s: list[float] = []
        self.step_cpu_s: list[float] = []
        self.forward_backward_s: list[float] = []
        self.offloadable_peak = 0
        # the measured steps' scheduler stats, kept here: the scheduler's own history keeps only its
        # latest 1,024 steps, and a bench as long as the user asks must not index past it
        self.measured_stats: list[Any] = []

    def step(self, measured: bool) -> None:
        from engine.memory import ArrayType

        started = time.perf_counter()
        cpu_started = time.process_time()  # all threads of the process: kernels and both IO threads
        self.net.forward(self.x, training=True)
        self.net.loss(self.y)
        self.net.backward()
        backward_done = time.perf_counter()
        self.optimizer.step()
        self.backend.synchronize()
        if not measured:
            return
        if self.scheduler is not None:
            self.measured_stats.append(self.scheduler.stats[-1])
        self.step_s.append(time.perf_counter() - started)
        self.step_cpu_s.append(time.process_time() - cpu_started)
        self.forward_backward_s.append(backward_done - started)
        if self.scheduler is None:
            in_use = self.net.mgr.in_use_bytes_by_type()
            offloadable = in_use.get(ArrayType.ACTIVATIONS.name, 0) + in_use.get(ArrayType.FF_CACHE.name, 0)
            self.offloadable_peak = max(self.offloadable_peak, offloadable)

    def result(self) -> dict[str, Any]:
        from engine.offload.scheduler import cpu_per_mib

        result: dict[str, Any] = {
            "step_ms": 1e3 * float(np.mean(self.step_s)),
            "step_cpu_ms": 1e3 * float(np.mean(self.step_cpu_s)),
            "forward_backward": summarize(self.forward_backward_s),
        }
        if self.scheduler is not None:
            stats = self.measured_stats
            result.update(
                budget_bytes=self.budget_bytes,
                offload=summarize([s.offload_s for s in stats]),
                onload=summarize([s.onload_s for s in stats]),
                stall=summarize([s.stall_s for s in stats]),
                peak_resident_bytes=max(s.peak_resident_bytes for s in stats),
                page_cache_bytes=max(max(s.page_cache_bytes for s in stats), 0),
                bound_bytes=max(s.bound_bytes for s in stats),
                windows=[s.window for s in stats],
                lead_steps=[s.lead_steps for s in stats],
                recompute_ms_per_step=1e3 * float(np.mean([s.recompute_s for s in stats])),
                recomputed_bytes_per_step=int(np.mean([s.recomputed_bytes for s in stats])),
                executor_checked_bytes_per_step=int(np.mean([s.executor_checked_bytes for s in stats])),
                io_cpu_ms_per_step=1e3 * float(np.mean([s.offload_cpu_s + s.onload_cpu_s for s in stats])),
                offload_cpu_us_per_mib=cpu_per_mib(sum(s.offload_cpu_s for s in stats),
                                                   sum(s.bytes_written for s in stats)),
                onload_cpu_us_per_mib=cpu_per_mib(sum(s.onload_cpu_s for s in stats), sum(s.bytes_read for s in stats)),
                written_bytes_per_step=int(np.mean([s.bytes_written for s in stats])),
                read_bytes_per_step=int(np.mean([s.bytes_read for s in stats])),
            )
        else:
            zero = summarize([0.0] * len(self.step_s))
            result.update(offload=zero, onload=zero, stall=zero, peak_resident_bytes=self.offloadable_peak,
                          page_cache_bytes=0)
        return result

    def close(self) -> None:
        if self.scheduler is not None:
            self.scheduler.close()
        self.net.close()


def run_worker(config: dict[str, Any]) -> dict[str, Any]:
    """Runs for ``config["windows"]`` (None: no offload) in this process, their steps interleaved.

    Interleaving puts both runs under the same machine load (the fair way to compare step times on a
    shared machine); the process's peak RSS means something only when there is one run.
    """
    sampler = _RssSampler()
    runs = []
    try:
        for window in config["windows"]:
            runs.append(_Run(config, window))
            runs[-1].net.hooks.append(sampler)
        for step in range(config["warmup"] + config["steps"]):
            if step == config["warmup"]:
                sampler.peak = 0
            for run in runs:
                run.step(measured=step >= config["warmup"])
        return {"runs": [run.result() for run in runs], "peak_rss_bytes": sampler.peak}
    finally:
        for run in runs:
            run.close()


def _spawn(config: dict[str, Any]) -> dict[str, Any]:
    env = dict(os.environ)
    if config["backend"] == "cudasim":
        env["NUMBA_ENABLE_CUDASIM"] = "1"
    process = subprocess.run([sys.executable, "-m", "engine.bench.offload", "--worker", json.dumps(config)],
                             capture_output=True, text=True, env=env)
    if process.returncode == REFUSED:  # the configuration cannot run (a budget below N's needs): its one line
        raise ValueError(f"{config['model']} batch size {config['batch_size']}: {process.stderr.strip()}")
    if process.returncode != 0:
        raise RuntimeError(f"benchmark run {config} failed:\n{process.stderr.strip()[-2000:]}")
    return json.loads(process.stdout.strip().splitlines()[-1])


def run_bench(
    model: str,
    batch_sizes: list[int],
    window: int | str,
    *,
    steps: int = 10,
    warmup: int = 2,
    image_size: int = 32,
    backend: str = "cpu",
    directory: str | None = None,
    rss_steps: int = 2,
    progress: Any = None,
    variant: str | None = None,
    budget: str | None = None,
) -> list[dict[str, Any]]:
    """Per batch size: the no-offload and offload runs merged into one record (see ``format_*``);
    ``variant`` (cifar | imagenet) for the models that have one, None: by image size; ``budget``:
    ``--offload-budget`` (bytes, or a share of what the step keeps without offload: "0.3x")."""
    from models import resolve_variant

    variant = resolve_variant(model, variant, image_size)
    results = []
    for batch in batch_sizes:
        base = {"model": model, "batch_size": batch, "image_size": image_size, "backend": backend,
                "directory": directory, "variant": variant, "budget": budget}
        if progress:
            progress(f"{model} batch size {batch}: both runs, steps interleaved")
        plain, offload = _spawn({**base, "windows": [None, window], "steps": steps, "warmup": warmup})["runs"]
        rss = {}
        for name, run_window in (("no_offload", None), ("offload", window)):
            if progress:
                progress(f"{model} batch size {batch}: peak RSS {name.replace('_', ' ')} (own process)")
            rss[name] = _spawn({**base, "windows": [run_window], "steps": rss_steps, "warmup": 1})["peak_rss_bytes"]
        results.append({
            "batch_size": batch,
            "model": model,
            "variant": variant,
            "image_size": image_size,
            "window": window,
            "budget": budget,
            "budget_bytes": offload.get("budget_bytes"),
            "steps": steps,
            "step_ms_no_offload": plain["step_ms"],
            "step_ms_offload": offload["step_ms"],
            "step_time_ratio": offload["step_ms"] / plain["step_ms"],
            "step_cpu_ms_no_offload": plain["step_cpu_ms"],
            "step_cpu_ms_offload": offload["step_cpu_ms"],
            "peak_resident_bytes_no_offload": plain["peak_resident_bytes"],
            "peak_resident_bytes_offload": offload["peak_resident_bytes"],
            "page_cache_bytes_offload": offload["page_cache_bytes"],
            "resident_reduction": 1 - (offload["peak_resident_bytes"] + offload["page_cache_bytes"])
            / max(plain["peak_resident_bytes"], 1),
            "peak_rss_bytes_no_offload": rss["no_offload"],
            "peak_rss_bytes_offload": rss["offload"],
            "windows": offload.get("windows", []),
            "lead_steps": offload.get("lead_steps", []),
            "recompute_ms_per_step": offload.get("recompute_ms_per_step", 0.0),
            "recomputed_bytes_per_step": offload.get("recomputed_bytes_per_step", 0),
            # written bytes whose check the executor does (the ReLU rebuilds' sources), not the IO threads
            "executor_checked_bytes_per_step": offload.get("executor_checked_bytes_per_step", 0),
            "io_cpu_ms_per_step": offload.get("io_cpu_ms_per_step", 0.0),
            "written_bytes_per_step": offload.get("written_bytes_per_step", 0),
            "read_bytes_per_step": offload.get("read_bytes_per_step", 0),
            "offload_cpu_us_per_mib": offload.get("offload_cpu_us_per_mib", 0.0),
            "onload_cpu_us_per_mib": offload.get("onload_cpu_us_per_mib", 0.0),
            "forward_backward_no_offload": plain["forward_backward"],
            "forward_backward": offload["forward_backward"],
            "offload": offload["offload"],
            "onload": offload["onload"],
            "stall": offload["stall"],
        })
    return results


def _model_label(r: dict[str, Any]) -> str:
    return f"{r['model']} ({r['variant']})" if r.get("variant") else r["model"]


def _offload_label(r: dict[str, Any]) -> str:
    """"offload N=4", and the budget when there was one: "offload N=4, budget 0.3x (118.0 MiB)"."""
    from engine.offload.budget import parse_budget

    label = f"offload N={r['window']}"
    if r.get("budget_bytes"):
        given = f"{r['budget']} (" if parse_budget(r["budget"]).kind == "share" else ""
        label += f", budget {given}{_mib(r['budget_bytes'])}" + (")" if given else "")
    return label


def _mib(nbytes: float) -> str:
    from engine.report import format_bytes  # one formatter for every byte count the engine prints

    return format_bytes(nbytes)


def _rows(r: dict[str, Any]) -> list[tuple[str, dict[str, float]]]:
    rows = [(TABLE_LABELS[k], r[k]) for k in TIMING_KEYS]
    rows.append(("forward + backward (no offload)", r["forward_backward_no_offload"]))
    return rows


def ratio_text(ratio: float) -> str:
    """The step-time ratio with offload over without, and a word when it is below 1: offload only adds work
    (IO threads, checks, rebuilds), so a step measured faster with it is the noise between the two runs
    (issue 33: a 0.873x read as offload speeding training up)."""
    if ratio >= 1:
        return f"{ratio:.3f}x"
    return (f"{ratio:.3f}x: below 1 is noise between the two runs (offload adds work, it cannot make a step "
            "faster); more --steps or a quieter machine narrow it")


def _summary_lines(r: dict[str, Any]) -> list[str]:
    return [
        f"step time: {r['step_ms_no_offload']:.1f} ms without offload, {r['step_ms_offload']:.1f} ms with "
        f"({ratio_text(r['step_time_ratio'])}); CPU time per step {r['step_cpu_ms_no_offload']:.1f} ms without, "
        f"{r['step_cpu_ms_offload']:.1f} ms with, of which the IO threads {r.get('io_cpu_ms_per_step', 0):.1f} ms",
        f"swap IO per step: {_mib(r.get('written_bytes_per_step', 0))} written, "
        f"{_mib(r.get('read_bytes_per_step', 0))} read; "
        f"IO-thread CPU {r.get('offload_cpu_us_per_mib', 0):.0f} µs per MiB written, "
        f"{r.get('onload_cpu_us_per_mib', 0):.0f} µs per MiB read; "
        f"{_mib(r.get('recomputed_bytes_per_step', 0))} recomputed by the executor in "
        f"{r.get('recompute_ms_per_step', 0):.1f} ms",
        f"peak resident offloadable tensors: {_mib(r['peak_resident_bytes_no_offload'])} without offload, "
        f"{_mib(r['peak_resident_bytes_offload'])} with, + {_mib(r['page_cache_bytes_offload'])} swap page cache "
        f"({100 * r['resident_reduction']:.1f}% lower)",
        f"window N per measured step: {r.get('windows', [])} (settled at {(r.get('windows') or ['-'])[-1]}); "
        f"loader lead (steps ahead): {r.get('lead_steps', [])}",
        f"peak RSS: {_mib(r['peak_rss_bytes_no_offload'])} without offload, {_mib(r['peak_rss_bytes_offload'])} with "
        f"({_mib(r['peak_rss_bytes_offload'] - r['peak_rss_bytes_no_offload'])})",
    ]


def format_table(results: list[dict[str, Any]]) -> str:
    """The seed's layout: per batch size, key / avg / min / max / sum in microseconds, then the summary."""
    out = []
    for r in results:
        out.append(f"{_model_label(r)} {r['image_size']}x{r['image_size']}, {_offload_label(r)}, "
                   f"{r['steps']} steps")
        out.append("unit: microseconds")
        out.append(f"batch size: {r['batch_size']}")
        out.append(f"{'key':<34}{'avg':>14}{'min':>14}{'max':>14}{'sum':>16}")
        out.append("=" * 92)
        for label, s in _rows(r):
            out.append(f"{label:<34}{s['avg']:>14.0f}{s['min']:>14.0f}{s['max']:>14.0f}{s['sum']:>16.0f}")
        out.extend(_summary_lines(r))
        out.append("")
    return "\n".join(out)


def format_markdown(results: list[dict[str, Any]]) -> str:
    out = []
    for r in results:
        out.append(f"**{_model_label(r)} {r['image_size']}×{r['image_size']}, batch size {r['batch_size']}, "
                   f"{_offload_label(r)}, {r['steps']} steps** (µs)")
        out.append("")
        out.append("| key | avg | min | max | sum |")
        out.append("|---|---:|---:|---:|---:|")
        for label, s in _rows(r):
            out.append(f"| {label} | {s['avg']:.0f} | {s['min']:.0f} | {s['max']:.0f} | {s['sum']:.0f} |")
        out.append("")
        out.extend(f"- {line}" for line in _summary_lines(r))
        out.append("")
    return "\n".join(out)


REFUSED = 3  # the worker's exit status when the scheduler refuses the configuration (one line on stderr)


def main(argv: list[str] | None = None) -> int:
    from engine.offload.scheduler import OffloadError

    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] != "--worker":
        print("usage: python -m engine.bench.offload --worker JSON (engine bench runs this)", file=sys.stderr)
        return 2
    try:
        result = run_worker(json.loads(argv[1]))
    except OffloadError as exc:
        print(exc, file=sys.stderr)
        return REFUSED
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

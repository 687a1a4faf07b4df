"""MemoryMonitor: what memory one step cost, per step, as the OS and as the workspaces see it.

``sample(step)`` records one line: the process RSS (psutil), bytes in use and reserved per
ArrayType (from the managers' workspaces and tracked ContiguousBlocks), cumulative spilled bytes and
block allocations (flat after the learning step: the training loop asserts it), the CuPy pool on
cuda, and ``swap`` (filled by the offload scheduler). Lines go to a JSON-lines file when a path is
given; ``plot()`` draws the timeline. ``records`` is bounded (``engine.history.Thinned``: every
step while the run is shorter than ``max_records``, then every 2nd, 4th, ... step, spanning the whole
run), and the peaks are running maxima, exact whatever was thinned: a 20,000-step run used to keep
20,000 record dicts (~2 KiB each) in memory.

**Phases and peaks.** A run has phases: ``setup`` (imports, data, network), ``training`` (the
steps) and ``evaluation``. ``begin_phase(name)`` closes the previous one. A step's RSS read at its
end misses its peak (the tensors saved for backward are gone by then), and the process-wide
``ru_maxrss`` cannot say which phase set it, so ``RssPeaks`` combines the two: the OS's high-water
mark (``ru_maxrss``, exact, never reset) read at every boundary says *whether* the phase or step
raised the process peak, and when it did, by how much, exactly; when it did not, the peak of that
interval is the largest RSS sampled in it — at each step's end and, through ``sample_rss()`` called
from the network's hooks, after every layer's forward and backward. Measured on the README's main
command (resnet18, offload N=4, digits, warm cache) before evaluation had its own arena: RSS at step
ends ~492 MiB, evaluation ~718 MiB; only the per-phase marks showed that the run's peak came from
evaluation (now: training steps 434 MiB, evaluation 420 MiB). Resetting the kernel's mark
(``/proc/self/clear_refs``) per phase was tried and dropped: it also resets what ``/usr/bin/time`` and
a parent's ``wait4`` report, so an outside measurement of the engine would read low. Giving the C
allocator's free memory back to the OS (glibc ``malloc_trim``) at each phase boundary and after the
first step was tried and dropped: it returned 29 MiB of setup temporaries, but the training steps
reuse that free heap anyway, so their peak did not move (433.0 MiB with it, 434.0 without).

``GcPolicy`` is DL4J's periodic-GC switch in Python: workspaces make the hot loop allocate almost
nothing, so the cyclic collector only costs time there; keep it off during a step and collect every
K steps instead.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil

from engine.history import Thinned
from engine.memory.tree import ManagerNode
from engine.report import format_bytes

PHASES = ("setup", "training", "evaluation")
"""The phases of a run, in order; the summary names the one the process peak came from."""


def max_rss_bytes() -> int:
    """The largest resident set size this process has had: the OS's high-water mark (never reset)."""
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB on Linux


class RssPeaks:
    """The RSS peak of consecutive intervals (phases, steps): exact where an interval raised the process's
    high-water mark, else the largest RSS sampled in it (class docstring of the module)."""

    def __init__(self) -> None:
        self._process = psutil.Process()
        self._mark = max_rss_bytes()
        self._sampled = 0

    def current(self) -> int:
        """The resident set size now, in bytes (and counted as a sample of the current interval)."""
        return self.note(int(self._process.memory_info().rss))

    def note(self, rss: int) -> int:
        """Count ``rss`` (bytes, read elsewhere) as a sample of the current interval."""
        if rss > self._sampled:
            self._sampled = rss
        return rss

    def take(self) -> tuple[int, bool]:
        """(the peak of the interval since the previous ``take()``, whether it is exact); starts the next one."""
        self.current()
        mark = max_rss_bytes()
        exact = mark > self._mark
        peak = mark if exact else self._sampled
        self._mark, self._sampled = mark, 0
        return peak, exact


class MemoryMonitor:
    """Samples memory once per step into ``records`` (and a JSON-lines file), phase by phase."""

    def __init__(self, managers: ManagerNode | Iterable[ManagerNode], path: str | os.PathLike | None = None,
                 max_records: int = 1024):
        self.managers = [managers] if isinstance(managers, ManagerNode) else list(managers)
        self.records: Thinned = Thinned(max_records)
        self._peaks: dict[str, int] = {}
        self._phase_peaks: dict[str, dict[str, int]] = {}  # phase -> ArrayType -> running maximum
        self.phase_samples: dict[str, int] = {}  # phase -> lines sampled (records may be thinned)
        self._peak_rss = 0
        self.path = Path(path) if path is not None else None
        self._file = open(self.path, "w", encoding="utf-8") if self.path is not None else None
        self._process = psutil.Process()
        self._start = time.perf_counter()
        self.phase = "setup"
        self.phase_rss_peaks: dict[str, int] = {}  # phase -> its RSS peak
        self.phase_rss_exact: dict[str, bool] = {}  # phase -> whether it raised the process's high-water mark
        self.phase_spans: dict[str, tuple[float, float]] = {}  # phase -> (start, end) seconds, for the plot
        self._phase_rss = RssPeaks()  # intervals: phases
        self._step_rss = RssPeaks()  # intervals: samples (steps, evaluation batches)

    def begin_phase(self, name: str) -> None:
        """End the current phase (its RSS peak is kept) and start ``name`` (one of ``PHASES``)."""
        self._close_phase()
        self._step_rss.take()  # a step's interval starts with its phase: setup's peak is not step 0's
        self.phase = name
        self.phase_spans[name] = (self._now(), self._now())

    def end_phase(self) -> None:
        """End the current phase without starting another (the run's last phase)."""
        self._close_phase()
        self.phase = "done"

    def sample_rss(self) -> None:
        """Count the RSS now toward the current step's and phase's peaks (the network's hooks call this
        after every layer's forward and backward: 6-20 µs each here (timeit, loaded machine), 134 per
        ResNet-18 step: under 3 ms of a step of several hundred)."""
        self._phase_rss.note(self._step_rss.current())

    def after_forward(self, step: int, node: Any = None) -> None:
        self.sample_rss()

    def after_backward(self, step: int, node: Any = None) -> None:
        self.sample_rss()

    def _close_phase(self) -> None:
        if self.phase == "done":
            return
        peak, exact = self._phase_rss.take()
        if self.phase == "setup":  # everything before the first phase was setup: its peak is the OS's mark
            peak, exact = max_rss_bytes(), True
        if peak >= self.phase_rss_peaks.get(self.phase, 0):
            self.phase_rss_peaks[self.phase] = peak
            self.phase_rss_exact[self.phase] = exact
        start = self.phase_spans.get(self.phase, (0.0, 0.0))[0]
        self.phase_spans[self.phase] = (start, self._now())

    def _now(self) -> float:
        return round(time.perf_counter() - self._start, 6)

    def process_peak(self) -> tuple[int, str]:
        """(the process's peak RSS, the phase it came from: the last one that raised the high-water mark).
        Call after the last phase has ended."""
        raised = [p for p, exact in self.phase_rss_exact.items() if exact]
        phase = raised[-1] if raised else "setup"  # nothing raised it since the monitor began: before it
        peak = max_rss_bytes()
        # the kernel updates its mark lazily (per-thread RSS counters, folded in when pages go): a sample
        # can read a few pages above it
        sampled = max(self.phase_rss_peaks.items(), key=lambda item: item[1], default=(phase, 0))
        if sampled[1] > peak:
            return sampled[1], sampled[0]
        return peak, phase

    def _nodes(self) -> list[Any]:
        """Every manager given, and their sub-managers, once each."""
        seen: dict[int, Any] = {}
        for manager in self.managers:
            for node in manager.walk():
                if hasattr(node, "in_use_bytes_by_type"):
                    seen.setdefault(id(node), node)
        return list(seen.values())

    def sample(self, step: int, **extra: Any) -> dict[str, Any]:
        """Record one step. ``extra`` keys go into the line as they are; ``swap`` defaults to ``{}``."""
        in_use: dict[str, int] = {}
        reserved: dict[str, int] = {}
        spilled = 0
        block_allocations = 0
        backend = None
        for node in self._nodes():
            backend = backend or node.backend
            if node.closed:
                continue
            if self.phase == "evaluation" and getattr(node, "mode", None) == "training":
                # evaluation runs in the inference manager: of the training manager only its long-lived
                # blocks are in use (its workspaces still report the last training step's peak)
                used = {}
                for block in node.blocks:
                    used[block.array_type.name] = used.get(block.array_type.name, 0) + block.nbytes
            else:
                used = node.in_use_bytes_by_type()
            for key, nbytes in used.items():
                in_use[key] = in_use.get(key, 0) + nbytes
            for key, nbytes in node.reserved_bytes_by_type(split_arenas=False).items():
                reserved[key] = reserved.get(key, 0) + nbytes
            spilled += node.spilled_bytes()
            block_allocations += node.block_allocations()
        pool_used, pool_total = _device_pool(backend)
        self.sample_rss()
        rss_peak, _ = self._step_rss.take()  # the peak since the previous sample: inside this step
        record: dict[str, Any] = {
            "step": int(step),
            "phase": self.phase,
            "time_s": self._now(),
            "rss_bytes": int(self._process.memory_info().rss),
            "rss_peak_bytes": rss_peak,
            "in_use_bytes": in_use,
            "reserved_bytes": reserved,
            "spilled_bytes": spilled,
            "block_allocations": block_allocations,
            "device_pool_used_bytes": pool_used,
            "device_pool_total_bytes": pool_total,
            "swap": {},
        }
        record.update(extra)
        self.records.append(record)
        phase_peaks = self._phase_peaks.setdefault(self.phase, {})
        for key, nbytes in in_use.items():
            self._peaks[key] = max(self._peaks.get(key, 0), nbytes)
            phase_peaks[key] = max(phase_peaks.get(key, 0), nbytes)
        self.phase_samples[self.phase] = self.phase_samples.get(self.phase, 0) + 1
        self._peak_rss = max(self._peak_rss, record["rss_bytes"])
        if self._file is not None:
            try:
                self._file.write(json.dumps(record, sort_keys=True) + "\n")
                self._file.flush()
            except OSError as exc:  # the log's disk filled: the log ends here, named (not a swap disk fault)
                from engine.errors import OutputWriteError

                file, self._file = self._file, None
                with contextlib.suppress(OSError):
                    file.close()  # the descriptor closes even when the buffered line cannot be written
                raise OutputWriteError(f"memory log {self.path}: cannot write ({exc.strerror or exc}); free some "
                                       "space or choose another --memory-log path") from None
        return record

    def peak_by_type(self, phase: str | None = None) -> dict[str, int]:
        """ArrayType name -> the most bytes in use at any sampled step (of ``phase``, default all):
        running maxima, exact however ``records`` was thinned."""
        if phase is None:
            return dict(self._peaks)
        return dict(self._phase_peaks.get(phase, {}))

    def peak_rss_bytes(self, phase: str | None = None) -> int:
        """The RSS peak of ``phase`` (default: the process's, the OS's high-water mark)."""
        if phase is None:
            return self.process_peak()[0]
        return self.phase_rss_peaks.get(phase, 0)

    def plot(self, png_path: str | os.PathLike, peak_rss: tuple[int, str] | None = None) -> Path:
        """A timeline PNG over time: RSS (each sample's high-water mark, the figure the summary reports)
        and reserved bytes on top, in-use bytes per ArrayType stacked below, phases shaded, legends
        outside the axes. ``peak_rss``: (bytes, phase) of the summary's process peak, drawn as a line."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        if not self.records:
            raise ValueError("MemoryMonitor.plot: no samples yet; call sample(step) once per step first")
        times = [r["time_s"] for r in self.records]
        mib = 1024.0 * 1024.0
        fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6.5), sharex=True)
        colors = {"setup": "#dddddd", "training": "#dbe9f6", "evaluation": "#fde2c8"}
        for axis in (top, bottom):
            for phase, (start, end) in self.phase_spans.items():
                if end > start:
                    axis.axvspan(start, end, color=colors.get(phase, "#eeeeee"), alpha=0.6, lw=0,
                                 label=f"{phase} (phase)" if axis is top else None)
        rss_peak = [r.get("rss_peak_bytes", r["rss_bytes"]) / mib for r in self.records]
        top.plot(times, rss_peak, label="RSS (peak within each sample)", color="C0")
        top.plot(times, [r["rss_bytes"] / mib for r in self.records], label="RSS at the sample", color="C0",
                 ls=":", lw=1)
        top.plot(times, [sum(r["reserved_bytes"].values()) / mib for r in self.records],
                 label="reserved (workspaces, blocks)", color="C1")
        if any(r["spilled_bytes"] for r in self.records):
            top.plot(times, [r["spilled_bytes"] / mib for r in self.records], label="spilled (cumulative)", color="C3")
        if any(r["device_pool_used_bytes"] is not None for r in self.records):
            top.plot(times, [(r["device_pool_used_bytes"] or 0) / mib for r in self.records], label="device pool")
        if peak_rss is not None:
            top.axhline(peak_rss[0] / mib, color="C0", ls="--", lw=1,
                        label=f"process peak RSS {format_bytes(peak_rss[0])} ({peak_rss[1]})")
        top.set_ylabel("MiB")
        top.set_ylim(bottom=0)
        top.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", borderaxespad=0)
        top.set_title("memory over the run")
        types = sorted({k for r in self.records for k in r["in_use_bytes"]})
        if types:
            series = [[r["in_use_bytes"].get(k, 0) / mib for r in self.records] for k in types]
            labels = list(types)
            if any(r.get("swap", {}).get("resident_bytes") for r in self.records):  # the offload arena's own bytes
                series.append([r.get("swap", {}).get("resident_bytes", 0) / mib for r in self.records])
                labels.append("saved for backward, resident (offload arena)")
            bottom.stackplot(times, series, labels=labels)
            bottom.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="x-small", borderaxespad=0)
        bottom.set_ylabel("MiB in use per ArrayType")
        bottom.set_xlabel("seconds since the monitor started (one sample per step or evaluation batch)")
        fig.tight_layout()
        path = Path(png_path)
        # drawn into a temporary file beside it and renamed: a full disk leaves no empty or half plot
        temporary = path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")
        try:
            fig.savefig(temporary, dpi=100, bbox_inches="tight")
            os.replace(temporary, path)
        except OSError as exc:
            from engine.errors import OutputPathError

            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise OutputPathError(f"memory plot {path}: cannot write ({exc.strerror or exc}); free some space or "
                                  "choose another --memory-plot path") from None
        finally:
            plt.close(fig)
        return path

    def close(self) -> None:
        if self._file is not None:
            file, self._file = self._file, None
            try:
                file.close()
            except OSError as exc:  # the last buffered line on a full disk
                from engine.errors import OutputPathError

                raise OutputPathError(f"memory log {self.path}: cannot write ({exc.strerror or exc}); "
                                      "free some space or choose another --memory-log path") from None

    def __enter__(self) -> MemoryMonitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _device_pool(backend: Any) -> tuple[int | None, int | None]:
    if backend is None or getattr(backend, "name", None) != "cuda":
        return None, None
    pool = backend.xp.get_default_memory_pool()
    return int(pool.used_bytes()), int(pool.total_bytes())


class GcPolicy:
    """Python's cyclic GC off during steps, one full collection every ``collect_every`` steps.

    ``collect_every=0`` never collects explicitly (the collector still runs between steps if it was
    on). The collector's previous state is restored after every step.
    """

    def __init__(self, collect_every: int = 100):
        if collect_every < 0:
            raise ValueError("GcPolicy: collect_every must be >= 0 (0 means never collect explicitly)")
        self.collect_every = collect_every
        self.steps = 0
        self.collections = 0
        self.collect_seconds = 0.0

    @contextmanager
    def step(self) -> Iterator[None]:
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            yield
        finally:
            self.steps += 1
            if self.collect_every and self.steps % self.collect_every == 0:
                start = time.perf_counter()
                gc.collect()
                self.collect_seconds += time.perf_counter() - start
                self.collections += 1
            if was_enabled:
                gc.enable()

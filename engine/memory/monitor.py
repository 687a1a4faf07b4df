"""MemoryMonitor: what memory one step cost, per step, as the OS and as the workspaces see it.

``sample(step)`` records one line: the process RSS (psutil), bytes in use and reserved per
ArrayType (from the managers' workspaces and tracked ContiguousBlocks), cumulative spilled bytes and
block allocations (flat after the learning step: the training loop asserts it), the CuPy pool on
cuda, and ``swap`` (filled by the offload scheduler). Lines go to a JSON-lines file when a path is
given; ``plot()`` draws the timeline. ``records`` is bounded (``engine.history.Thinned``: every
step while the run is shorter than ``max_records``, then every 2nd, 4th, ... step, spanning the whole
run), and the peaks are running maxima, exact whatever was thinned: a 20,000-step run used to keep
20,000 record dicts (~2 KiB each) in memory.

``GcPolicy`` is DL4J's periodic-GC switch in Python: workspaces make the hot loop allocate almost
nothing, so the cyclic collector only costs time there; keep it off during a step and collect every
K steps instead.
"""

from __future__ import annotations

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


class MemoryMonitor:
    """Samples memory once per step into ``records`` (and a JSON-lines file)."""

    def __init__(self, managers: ManagerNode | Iterable[ManagerNode], path: str | os.PathLike | None = None,
                 max_records: int = 1024):
        self.managers = [managers] if isinstance(managers, ManagerNode) else list(managers)
        self.records: Thinned = Thinned(max_records)
        self._peaks: dict[str, int] = {}
        self._peak_rss = 0
        self.path = Path(path) if path is not None else None
        self._file = open(self.path, "w", encoding="utf-8") if self.path is not None else None
        self._process = psutil.Process()
        self._start = time.perf_counter()

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
            for key, nbytes in node.in_use_bytes_by_type().items():
                in_use[key] = in_use.get(key, 0) + nbytes
            for key, nbytes in node.reserved_bytes_by_type().items():
                reserved[key] = reserved.get(key, 0) + nbytes
            spilled += node.spilled_bytes()
            block_allocations += node.block_allocations()
        pool_used, pool_total = _device_pool(backend)
        record: dict[str, Any] = {
            "step": int(step),
            "time_s": round(time.perf_counter() - self._start, 6),
            "rss_bytes": int(self._process.memory_info().rss),
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
        for key, nbytes in in_use.items():
            self._peaks[key] = max(self._peaks.get(key, 0), nbytes)
        self._peak_rss = max(self._peak_rss, record["rss_bytes"])
        if self._file is not None:
            self._file.write(json.dumps(record, sort_keys=True) + "\n")
            self._file.flush()
        return record

    def peak_by_type(self) -> dict[str, int]:
        """ArrayType name -> the most bytes in use at any sampled step (for the training summary)."""
        return dict(self._peaks)

    def peak_rss_bytes(self) -> int:
        return self._peak_rss

    def plot(self, png_path: str | os.PathLike) -> Path:
        """A timeline PNG: RSS and reserved bytes on top, in-use bytes per ArrayType stacked below."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        if not self.records:
            raise ValueError("MemoryMonitor.plot: no samples yet; call sample(step) once per step first")
        steps = [r["step"] for r in self.records]
        mib = 1024.0 * 1024.0
        fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
        top.plot(steps, [r["rss_bytes"] / mib for r in self.records], label="RSS")
        top.plot(steps, [sum(r["reserved_bytes"].values()) / mib for r in self.records], label="reserved (workspaces)")
        top.plot(steps, [r["spilled_bytes"] / mib for r in self.records], label="spilled (cumulative)")
        if any(r["device_pool_used_bytes"] is not None for r in self.records):
            top.plot(steps, [(r["device_pool_used_bytes"] or 0) / mib for r in self.records], label="device pool")
        top.set_ylabel("MiB")
        top.legend(loc="upper left", fontsize="small")
        top.set_title("memory per step")
        types = sorted({k for r in self.records for k in r["in_use_bytes"]})
        if types:
            series = [[r["in_use_bytes"].get(k, 0) / mib for r in self.records] for k in types]
            bottom.stackplot(steps, series, labels=types)
            bottom.legend(loc="upper left", fontsize="x-small", ncol=2)
        bottom.set_ylabel("MiB in use per ArrayType")
        bottom.set_xlabel("step")
        fig.tight_layout()
        path = Path(png_path)
        fig.savefig(path, dpi=100)
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

"""`engine info`: what this machine offers the engine, and why a backend is missing."""

from __future__ import annotations

import importlib.metadata
import os
import platform
from typing import Any

from engine.backend import auto_choice, backend_report


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cupy_version() -> str | None:
    for name in ("cupy-cuda12x", "cupy-cuda13x", "cupy-cuda11x", "cupy"):
        version = _version(name)
        if version:
            return version
    return None


def _blas() -> dict[str, Any]:
    """The BLAS NumPy and SciPy use (what @njit's np.dot calls through SciPy)."""
    try:
        import numpy  # noqa: F401  (loads NumPy's BLAS so threadpoolctl can see it)
        import scipy.linalg  # noqa: F401
        from threadpoolctl import threadpool_info

        from kernels.cpu.blas import select_sgemm, selection_reason
        from kernels.cpu.conv import MODE, MODE_SUMMARY

        pools = [p for p in threadpool_info() if p.get("user_api") == "blas"]
        return {
            "kernels": select_sgemm(),  # the sgemm the conv kernels call (kernels/cpu/blas.py)
            "kernels_reason": selection_reason(),
            "conv_mode": f"{MODE} ({MODE_SUMMARY[MODE]}; ENGINE_CONV=auto|exact|fast)",  # kernels/README.md
            "libraries": sorted({f"{p.get('internal_api')} {p.get('version') or ''} ({p.get('architecture') or '?'})"
                             for p in pools}),
            "threads": max((p.get("num_threads", 0) for p in pools), default=None),
        }
    except Exception as exc:  # threadpoolctl comes with scikit-learn; report rather than fail
        return {"libraries": [], "threads": None, "error": str(exc)}


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def blas_pin_advice() -> str | None:
    """A hint when OPENBLAS_CORETYPE pins OpenBLAS below what this CPU can do.

    The conv kernels spend most of their time in BLAS sgemm; a Haswell (AVX2) pin on an AVX-512 CPU
    halves sgemm here (measured: ResNet-18 training 28.5 -> 58.6 img/s without the pin). The engine
    does not override a variable the user or the machine set on purpose: it says so and how to lift it.
    """
    pinned = os.environ.get("OPENBLAS_CORETYPE")
    if not pinned or "avx512f" not in _cpu_flags() or "skylakex" in pinned.lower() or "cooperlake" in pinned.lower():
        return None
    return (f"OPENBLAS_CORETYPE={pinned} pins OpenBLAS to older kernels on this AVX-512 CPU; "
            "sgemm (and so conv) runs about 2x faster without it: run with 'env -u OPENBLAS_CORETYPE engine ...'")


def _numba_threads() -> dict[str, Any]:
    import numba

    layer = None
    try:
        from numba.np.ufunc import parallel

        from kernels.cpu.threads import start_numba_pool

        start_numba_pool()  # as the kernels start it (OpenMP first): the layer they run on, not Numba's default

        parallel._launch_threads()
        layer = numba.threading_layer()
    except Exception as exc:
        layer = f"unavailable ({exc})"
    from kernels.cpu.cache import where

    location = where()  # where Numba really writes, and why not NUMBA_CACHE_DIR when it cannot
    cache_dir = location.problem or location.directory
    return {
        "threads": numba.get_num_threads(),
        "threading_layer": layer,
        "cache_dir": cache_dir,
    }


def collect_info() -> dict[str, Any]:
    """Everything `engine info` shows, as plain data (also what `--json` prints)."""
    backends = {name: {"available": reason is None, "reason": reason} for name, reason in backend_report().items()}
    backends["auto"] = {"available": True, "reason": None, "resolves_to": auto_choice()}
    return {
        "versions": {
            "engine": _version("numba-offload-engine"),
            "python": platform.python_version(),
            "numpy": _version("numpy"),
            "scipy": _version("scipy"),
            "numba": _version("numba"),
            "numba-cuda": _version("numba-cuda"),
            "llvmlite": _version("llvmlite"),
            "cupy": _cupy_version(),
        },
        "backends": backends,
        "cpu": {"logical_cpus": os.cpu_count(), "machine": platform.machine(), **_numba_threads()},
        "blas": {**_blas(), "advice": blas_pin_advice()},
        "kernel_cache": _kernel_cache(),
    }


def _kernel_cache() -> dict[str, Any]:
    """Whether the CPU kernels are compiled already (engine/warmup.py's markers, valid for the
    kernel sources and Numba version installed now), and for which models."""
    from engine.warmup import cache_dir, warm_labels

    labels = warm_labels()
    return {"dir": cache_dir(), "warm": bool(labels), "warm_for": sorted(set(labels))}


def render_info(report: dict[str, Any]) -> None:
    """The report as three tables (engine.report: never cut, plain text when piped) and the BLAS note."""
    from engine.report import Table, make_console, render_table

    console = make_console()
    versions = Table("Versions", ["package", "version"], show_header=False)
    for name, version in report["versions"].items():
        versions.add_row(name, version or "not installed")
    render_table(versions, console)

    backends = Table("Backends", ["backend", "available", "why not / note"])
    for name, entry in report["backends"].items():
        note = entry["reason"] or (f"resolves to {entry['resolves_to']}" if "resolves_to" in entry else "")
        backends.add_row(name, "yes" if entry["available"] else "no", note)
    render_table(backends, console)

    cpu = report["cpu"]
    blas = report["blas"]
    machine = Table("CPU", ["what", "value"], show_header=False)
    machine.add_row("logical CPUs", str(cpu["logical_cpus"]))
    machine.add_row("Numba threads", str(cpu["threads"]))
    machine.add_row("Numba threading layer", str(cpu["threading_layer"]))
    machine.add_row("Numba cache directory", str(cpu["cache_dir"]))
    if blas.get("kernels"):
        machine.add_row("sgemm of the kernels", f"{blas['kernels']} ({blas['kernels_reason']})")
        machine.add_row("conv algorithms", blas["conv_mode"])
    machine.add_row("BLAS libraries loaded", ", ".join(blas["libraries"]) or blas.get("error", "unknown"))
    machine.add_row("BLAS threads", str(blas["threads"]))
    cache = report.get("kernel_cache")
    if cache:
        state = (
            f"warm for {', '.join(cache['warm_for'])}"
            if cache["warm"]
            else "cold: the first training run compiles its kernels once, in worker processes "
            "(or run engine kernels --warmup)"
        )
        machine.add_row("kernel cache", state)
    render_table(machine, console)
    if blas.get("advice"):
        console.print(f"note: {blas['advice']}", markup=False, highlight=False)

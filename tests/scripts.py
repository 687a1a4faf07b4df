"""``benchmarks/<name>.py`` as a module: the benchmarks are scripts, not a package, and several tests call their
functions (the figures the docs quote come from them). One loader for those tests."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def load_script(name: str) -> ModuleType:
    """A fresh module of ``benchmarks/<name>.py`` (its ``main`` is not run)."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

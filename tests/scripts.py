"""``benchmarks/<name>.py`` as a module: the benchmarks are scripts, not a package, and several tests call their
functions (the figures the docs quote come from them). One loader for those tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def load_script(name: str) -> ModuleType:
    """A fresh module of ``benchmarks/<name>.py`` (its ``main`` is not run), registered under ``name`` while it runs
    (``dataclasses`` looks a class's module up in ``sys.modules``)."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module

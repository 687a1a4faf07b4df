"""Dependencies point one way: cli -> engine.bench -> engine.train -> network/graph -> layers -> memory ->
backend -> kernels, with engine.offload beside the layers. Checked on the imports of the source files."""

from __future__ import annotations

import ast
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[2] / "engine"


def imports(path: Path) -> set[str]:
    """Every module a file imports, at the top or inside a function."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def files(under: str = "") -> list[Path]:
    return sorted((ENGINE / under).rglob("*.py"))


def imports_any(path: Path, prefixes: tuple[str, ...]) -> list[str]:
    return sorted(n for n in imports(path) if any(n == p or n.startswith(p + ".") for p in prefixes))


def violations(paths: list[Path], prefixes: tuple[str, ...]) -> dict[str, list[str]]:
    found = {str(p.relative_to(ENGINE)): imports_any(p, prefixes) for p in paths}
    return {name: names for name, names in found.items() if names}


def test_offload_imports_neither_the_trainer_nor_the_network_nor_models():
    assert violations(files("offload"), ("engine.train", "engine.network", "models", "cli")) == {}


def test_only_the_benchmark_tools_import_models_or_the_cli():
    runtime = [p for p in files() if "bench" not in p.relative_to(ENGINE).parts]
    assert len(runtime) > 30 and violations(runtime, ("models", "cli", "engine.bench")) == {}


def test_lower_layers_do_not_import_upward():
    upward = ("engine.train", "engine.network", "engine.graph", "engine.program", "engine.offload", "models")
    assert violations(files("layers"), upward) == {}
    assert violations(files("memory") + [ENGINE / "backend.py"], (*upward, "engine.layers")) == {}

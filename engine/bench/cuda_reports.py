"""The CUDA reports of `engine kernels --backend cuda|cudasim` that need no GPU: one entry point.

``--static`` (engine/bench/cuda_static.py): ptxas resources and occupancy per kernel and GEMM
version. ``--roofline`` (engine/bench/roofline.py): per-kernel FLOPs, bytes and roofline time of a
training step on an A100 and an H100, summed. ``--launches`` (engine/bench/cuda_launches.py): kernel
launches per training step. The last two record a real step of each model with the CUDA launchers
under ``count_only`` (nothing runs), at the asked batch size (the roofline also at 4× it).
"""

from __future__ import annotations

import json
from typing import Any

MODELS = ("resnet18", "mobilenetv2")


def _backend(name: str) -> Any:
    """The CUDA kernel table on NumPy arrays: counting needs no GPU, whatever --backend says."""
    from engine.backend import counting_backend

    return counting_backend()


def run(
    static: bool, roofline: bool, launches: bool, models: tuple[str, ...], batch: int, backend: str, output_format: str
) -> list[dict[str, Any]]:
    """Print the asked reports (tables, or JSON with ``output_format == "json"``); return their records."""
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        raise ValueError(f"--models: unknown {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    records: list[dict[str, Any]] = []
    as_json = output_format == "json"
    if static:
        from engine.bench.cuda_static import render_static, static_report

        rows = static_report()
        records += [dict(r.as_dict(), report="static") for r in rows]
        if not as_json:
            render_static(rows)
    if launches:
        from engine.bench.cuda_launches import count_step_launches

        counted = [count_step_launches(m, batch, _backend(backend)) for m in models]
        records += [dict(c.as_dict(), report="launches") for c in counted]
        if not as_json:
            render_launches(counted)
    if roofline:
        from engine.bench.roofline import render_roofline, step_roofline

        steps = [step_roofline(m, b, _backend(backend)) for m in models for b in (batch, 4 * batch)]
        records += [dict(s.as_dict(), report="roofline") for s in steps]
        if not as_json:
            render_roofline(steps)
    if as_json:
        print(json.dumps(records, indent=2))
    return records


def render_launches(counted: list[Any], console: Any = None) -> None:
    """Launches per step by kernel, through engine/report.py (the long "by kernel" cell is never cut)."""
    from engine.report import Table, render_table

    table = Table("GPU kernel launches per training step (SGD; counted, not run)",
                  ["model", "batch", "launches", "by kernel"], right={1, 2})
    for c in counted:
        table.add_row(c.model, str(c.batch), str(c.total), ", ".join(f"{k} {v}" for k, v in c.by_kernel.items()))
    render_table(table, console)

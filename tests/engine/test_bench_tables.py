"""`engine kernels` and the CUDA reports print through engine/report.py: no kernel name or shape is cut.

They used to print rich tables with ``no_wrap`` columns, which rich shortens to "conv2d_bac…" when
the terminal is narrower than the table; a 60-column terminal cut every long kernel name and shape.
"""

from __future__ import annotations

import io
from dataclasses import asdict

import pytest
from rich.console import Console

LONG = "conv_backward_weight_v3_register_blocked_with_a_name_longer_than_the_terminal"
SHAPE = "N32 C256->K512 28x28 k3 s1 p1 g1 (a shape wider than 60 columns, too)"


def narrow_terminal() -> tuple[Console, io.StringIO]:
    """What COLUMNS=60 on a terminal gives every renderer."""
    out = io.StringIO()
    return Console(file=out, width=60, force_terminal=True), out


def kernels_table(console):
    from engine.bench.kernels import Record, render

    render([Record(LONG, "cpu", "v3", SHAPE, 1.25, 45.6, None, 50.0, 1e-6, torch_ms=2.5)], 91.0, True, console)


def static_table(console):
    from engine.bench.cuda_static import Resources, render_static

    render_static([Resources(LONG, "conv", "sm_90", 80, 0, 0, 0, 20480, 256, 3, 0.375, "registers")], console)


def timing_table(console):
    from engine.bench.cuda_timing import KernelTiming, render_timings
    from engine.bench.roofline import DEVICES

    render_timings([KernelTiming("mobilenetv2", 32, LONG, SHAPE, 3, 0.5, {d.name: 0.25 for d in DEVICES})],
                   "NVIDIA H100 80GB HBM3", console)


def roofline_tables(console):
    from engine.bench.roofline import DEVICES, RooflineRow, StepRoofline, render_roofline

    seconds = {d.name: 1e-4 for d in DEVICES}
    row = RooflineRow("mobilenetv2", 32, LONG, SHAPE, 3, 1e9, 1e8, 10.0, seconds,
                      {d.name: "compute" for d in DEVICES})
    render_roofline([StepRoofline("mobilenetv2", 32, 3, [row], seconds, 3e-4)], console, detail=True)


def launches_table(console):
    from engine.bench.cuda_launches import StepLaunches
    from engine.bench.cuda_reports import render_launches

    render_launches([StepLaunches("mobilenetv2", 32, 32, 3, {LONG: 3})], console)


def acceptance_report(console):
    from engine.bench.cuda_timing import KernelTiming
    from engine.bench.gpu_acceptance import Check, Report, TrainRun, render_report
    from engine.bench.roofline import DEVICES

    timing = KernelTiming("mobilenetv2", 32, LONG, SHAPE, 3, 0.5, {d.name: 0.25 for d in DEVICES})
    report = Report("cuda", "NVIDIA H100 80GB HBM3", checks=[Check(LONG, SHAPE, 1e-7, 1.0, True)],
                    timings=[asdict(timing)], host_launch_us=20.0, train=[TrainRun(None, 0, 1.5, 2.3, "")])
    render_report(report, console)


@pytest.mark.parametrize("render, cells", [
    (kernels_table, (LONG, SHAPE)), (static_table, (LONG,)), (timing_table, (LONG, SHAPE)),
    (roofline_tables, (LONG, SHAPE)), (launches_table, (f"{LONG} 3",)), (acceptance_report, (LONG, SHAPE)),
], ids=lambda v: v.__name__ if callable(v) else "")
def test_a_long_kernel_name_and_shape_are_printed_whole_on_a_60_column_terminal(render, cells):
    console, out = narrow_terminal()
    render(console)
    text = out.getvalue()
    for cell in cells:
        assert cell in text, text
    assert "…" not in text


def test_engine_kernels_piped_is_plain_columns_whatever_columns_says(monkeypatch):
    """Piped (a file, grep, a README), the table is plain text as wide as its cells, even with COLUMNS=60."""
    from click.testing import CliRunner

    from cli import main

    monkeypatch.setenv("COLUMNS", "60")
    result = CliRunner().invoke(main, ["kernels", "--ops", "relu_forward", "--batch-size", "1", "--repeat", "1"])
    assert result.exit_code == 0, result.output
    header = next(line for line in result.output.splitlines() if line.startswith("op "))
    assert "% sgemm" in header and "max abs err" in header and len(header) > 60
    assert not set("│┃─━…") & set(result.output)

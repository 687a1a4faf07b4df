"""Tables for people: the training summary, an evaluation, and a network's memory report (rich)."""

from __future__ import annotations

from typing import Any

from engine.memory.tree import format_bytes


def _console(console: Any) -> Any:
    if console is not None:
        return console
    from rich.console import Console

    console = Console()
    if not console.is_terminal:  # piped into a file or a pager: do not squeeze tables into 80 columns
        console = Console(width=max(console.width, 140))
    return console


def render_training_summary(result: Any, console: Any = None) -> None:
    """Time, throughput, losses, accuracies, peak RSS and peak bytes per ArrayType of a TrainResult."""
    from rich.table import Table

    console = _console(console)
    table = Table(title="training summary", show_header=False, title_justify="left")
    table.add_column("what", style="bold")
    table.add_column("value", justify="right")
    table.add_row("steps", f"{result.steps} (now at step {result.final_step}, epoch {result.epochs:.2f})")
    table.add_row("time", f"{result.seconds:.1f} s")
    table.add_row("images/s", f"{result.images_per_second:,.1f} (after the first two steps: "
                  f"{result.steady_images_per_second:,.1f})")
    table.add_row("final loss", f"{result.final_loss:.4f} (mean of the last 10 steps)")
    table.add_row("train accuracy", f"{100 * result.train_accuracy:.2f}% (running, last epoch)")
    if result.test_accuracy is not None:
        top5 = f"(top-5 {100 * result.test_top5_accuracy:.2f}%)"
        table.add_row("test accuracy", f"{100 * result.test_accuracy:.2f}%  {top5}")
        table.add_row("test loss", f"{result.test_loss:.4f}")
    table.add_row("peak RSS", format_bytes(result.peak_rss_bytes))
    for name, nbytes in result.peak_bytes.items():
        table.add_row(f"peak {name}", format_bytes(nbytes))
    console.print(table)


def render_evaluation(evaluation: Any, console: Any = None, class_names: list[str] | None = None) -> None:
    """Accuracy, top-5, loss, and per-class accuracy with the confusion matrix (up to 20 classes)."""
    from rich.table import Table

    console = _console(console)
    console.print(
        f"[bold]accuracy[/bold] {100 * evaluation.accuracy:.2f}%   [bold]top-5[/bold] "
        f"{100 * evaluation.top5_accuracy:.2f}%   [bold]loss[/bold] {evaluation.loss:.4f}   "
        f"({evaluation.examples} examples)"
    )
    k = evaluation.confusion.shape[0]
    if k > 20:
        return
    table = Table(title="confusion matrix (rows: true class, columns: predicted)", title_justify="left")
    table.add_column("class", style="bold")
    for j in range(k):
        table.add_column(str(j), justify="right")
    table.add_column("accuracy", justify="right")
    per_class = evaluation.per_class_accuracy()
    for i in range(k):
        name = class_names[i] if class_names else str(i)
        cells = [str(int(c)) if c else "." for c in evaluation.confusion[i]]
        table.add_row(name, *cells, f"{100 * per_class[i]:.1f}%")
    console.print(table)


def render_memory_report(report: Any, console: Any = None) -> None:
    """The per-layer table of ``net.memory_report(batch_size)`` and the planned peak."""
    from rich.table import Table

    console = _console(console)
    table = Table(title=f"memory per layer, batch size {report.batch_size}", title_justify="left")
    for column, justify in (
        ("layer", "left"),
        ("kind", "left"),
        ("output", "left"),
        ("parameters", "right"),
        ("output bytes", "right"),
        ("kept for backward", "right"),
        ("working memory", "right"),
    ):
        table.add_column(column, justify=justify)
    for row in report.rows:
        table.add_row(
            row.name,
            row.kind,
            "×".join(map(str, row.output_shape)),
            format_bytes(row.parameter_bytes) if row.parameter_bytes else "",
            format_bytes(row.output_bytes),
            format_bytes(row.saved_bytes) if row.saved_bytes else "",
            format_bytes(row.working_bytes) if row.working_bytes else "",
        )
    table.add_section()
    table.add_row(
        "total",
        "",
        "",
        format_bytes(report.parameter_bytes),
        format_bytes(sum(r.output_bytes for r in report.rows)),
        format_bytes(sum(r.saved_bytes for r in report.rows)),
        format_bytes(max((r.working_bytes for r in report.rows), default=0)) + " (largest)",
    )
    console.print(table)
    console.print(
        f"parameters {format_bytes(report.parameter_bytes)}, gradients {format_bytes(report.gradient_bytes)}, "
        f"buffers {format_bytes(report.buffer_bytes)}"
    )
    by_type = ", ".join(f"{k} {format_bytes(v)}" for k, v in sorted(report.by_type_at_peak.items()) if v)
    console.print(
        f"[bold]planned peak[/bold] {format_bytes(report.planned_peak_bytes)}: the blocks above plus "
        f"{format_bytes(report.iteration_peak_bytes)} of iteration tensors at step {report.peak_step} ({by_type})"
    )

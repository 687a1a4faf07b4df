"""Tables for people: the training summary, an evaluation, and a network's memory report.

Every byte count goes through ``engine.report.format_bytes`` and every table through
``engine.report.render_table`` (never cut; plain text when piped; ``*_table`` functions give the
same tables as data for ``--json``/``--summary-json``). A figure that needs more steps than a run
had reads "n/a" and says why, never 0.
"""

from __future__ import annotations

from typing import Any

from engine.report import Table, format_bytes, format_seconds, make_console, render_table, table_dict

PHASE_LABELS = {"setup": "setup", "training": "training steps", "evaluation": "evaluation"}
OFFLOAD_ARENA_TYPES = ("ACTIVATIONS", "FF_CACHE")  # what the offload scheduler places, in its own arena


def _console(console: Any) -> Any:
    return console if console is not None else make_console()


def _percent(value: float | None) -> str:
    return "n/a" if value is None or value != value else f"{100 * value:.2f}%"


def summary_table(result: Any) -> Table:
    """Time, throughput, losses, accuracies and the process's peak RSS with the phase it came from."""
    table = Table("training summary", ["what", "value"], show_header=False)
    table.add_row("steps", f"{result.steps} (now at step {result.final_step}, epoch {result.epochs:.2f})")
    table.add_row("time", time_split(result))
    if result.steady_images_per_second is None:
        rate = (f"{result.images_per_second:,.1f} over {_all(result.steps)} (the first included); "
                "after the first two steps: n/a (needs more than 2 steps)")
    else:
        rate = (f"{result.steady_images_per_second:,.1f} after the first two steps "
                f"({result.images_per_second:,.1f} over all {result.steps}, the first two included)")
    table.add_row("images/s", rate)
    table.add_row("final loss", f"{result.final_loss:.4f} (mean of the last {plural(result.loss_window, 'step')})")
    table.add_row("train accuracy",
                  f"{_percent(result.train_accuracy)} (running, over the last epoch's "
                  f"{plural(result.accuracy_steps, 'step')})")
    if result.test_accuracy is not None:  # top-5 only above 5 classes: with 5 or fewer it is always 100%
        top5 = "" if result.test_top5_accuracy is None else f" (top-5 {_percent(result.test_top5_accuracy)})"
        table.add_row("test accuracy", f"{_percent(result.test_accuracy)}{top5}")
        table.add_row("test loss", f"{result.test_loss:.4f}")
    where = PHASE_LABELS.get(result.peak_rss_phase, result.peak_rss_phase)
    table.add_row("peak RSS", f"{format_bytes(result.peak_rss_bytes)}, during {where} (each phase below)")
    return table


def time_split(result: Any) -> str:
    """Where the wall time went: kernels compiled up front (a cold cache's first run), the training steps
    (the first one apart: it loads the kernels and learns the workspaces) and the evaluation."""
    compile_s = getattr(result, "compile_seconds", None)
    evaluation_s = getattr(result, "evaluation_seconds", None)
    first_s = getattr(result, "first_step_seconds", None)
    total = result.seconds + (compile_s or 0.0) + (evaluation_s or 0.0)
    steps = plural(result.steps, "step")
    parts = [f"compiling kernels {compile_s:.1f} s (first run only)"] if compile_s else []
    parts.append(f"training {steps} {result.seconds:.1f} s"
                 + (f" (the first {first_s:.1f} s)" if first_s is not None and result.steps > 1 else ""))
    if evaluation_s is not None:
        parts.append(f"evaluation {evaluation_s:.1f} s")
    return f"{total:.1f} s: " + ", ".join(parts)


def _all(steps: int) -> str:
    return "its 1 step" if steps == 1 else f"all {steps:,} steps"


def plural(count: int, noun: str) -> str:
    """"1 step", "2 steps"."""
    return f"{count:,} {noun}" + ("" if count == 1 else "s")


def phase_table(result: Any) -> Table:
    """Peak RSS and peak bytes per ArrayType, one column per phase; the process peak marked."""
    phases = [p for p in ("setup", "training", "evaluation") if p in result.phases]
    table = Table("memory by phase (peaks)", ["", *(PHASE_LABELS[p] for p in phases)],
                  right=set(range(1, len(phases) + 1)))
    offloaded = result.offload is not None
    rss = []
    for p in phases:
        cell = format_bytes(result.phases[p].peak_rss_bytes)
        rss.append(cell + " (process peak)" if p == result.peak_rss_phase else cell)
    table.add_row("RSS", *rss)
    types = sorted({k for p in phases for k in result.phases[p].peak_bytes})
    for name in types:
        cells = []
        for p in phases:
            nbytes = result.phases[p].peak_bytes.get(name)
            if offloaded and p == "training" and name in OFFLOAD_ARENA_TYPES:
                cells.append("(in the offload arena)")
            else:
                cells.append(format_bytes(nbytes) if nbytes else "-")
        table.add_row(name, *cells)
    if "setup" in phases:
        table.notes.append("setup: imports, data and network before the first step. RSS: the OS's high-water mark "
                           "where a phase raised it, else the most sampled after every layer and step")
    if "training" in phases and len(ARENA_SHARED_TYPES & set(result.phases["training"].peak_bytes)) > 1:
        table.notes.append("training steps: activation gradients, working memory and (updated in backward) parameter "
                           "gradients share the planned arena: each row is its type's own peak, not bytes of its own")
    return table


ARENA_SHARED_TYPES = frozenset({"ACTIVATION_GRAD", "FF_WORKING_MEM", "BP_WORKING_MEM", "GRADIENTS"})
"""Types the training arena places side by side by lifespan (engine.network.PLANNED_TYPES less the saved ones)."""


def offload_table(offload: dict[str, Any]) -> Table:
    """What offload measurably did: window, stall, bytes moved, resident peak against the no-offload plan."""
    averaged = offload["steps_averaged"]
    over = (f"means over the {averaged} steps after the first" if averaged < offload["steps"]
            else f"means over {averaged} step{'s' if averaged != 1 else ''}: the first step only, n/a for a steady "
                 "state (needs 2 or more steps)")
    table = Table(f"offload ({over})", ["what", "value"], show_header=False)
    window = f"{offload['window']}"
    if offload["requested"] == "auto":
        kept = offload["window_history"]
        history = ", ".join(f"{h['window']} from step {h['step']}" for h in kept)
        if offload.get("window_changes", len(kept)) > len(kept):  # only the first changes and the last are kept
            history = ", ".join(f"{h['window']} from step {h['step']}" for h in kept[:-1])
            last = kept[-1]
            history += f", … ({offload['window_changes']} in all), {last['window']} from step {last['step']}"
        window += f" (auto: {history}; per step in --memory-log)"
    elif offload["requested"] == "budget":  # a budget alone takes N=4, or the largest below it that fits
        largest = offload.get("max_window")
        if largest is None or offload["window"] >= largest:
            window += " (the largest that fits --offload-budget)"
        else:
            window += f" (--offload-budget alone takes N={offload['window']}; up to N={largest} fits)"
    table.add_row("window N", window)
    table.add_row("stall per step", format_seconds(offload["stall_ms_per_step"] / 1e3))
    table.add_row("IO threads' CPU per step", format_seconds(offload["io_cpu_ms_per_step"] / 1e3))
    tier = offload.get("swap_tier")
    if tier and tier != "swap file":  # a GPU run whose swapped bytes fit the host budget: no disk at all
        table.add_row("swapped to", tier)
    table.add_row("written per step", format_bytes(offload["written_bytes_per_step"]))
    table.add_row("read per step", format_bytes(offload["read_bytes_per_step"]))
    resident = format_bytes(offload["resident_peak_bytes"])
    notes = []
    if offload.get("bound_bytes"):  # the arena reserves each unit's span ahead of its load: a ceiling, not a floor
        notes.append(f"within the {format_bytes(offload['bound_bytes'])} planned "
                     + ("region it shares with the step's own tensors" if offload.get("shared_region") else "arena"))
    base = offload.get("no_offload_bytes")
    if base:
        notes.append(f"without offload, planned: {format_bytes(base)}; "
                     f"{100 * (offload['resident_peak_bytes'] / base - 1):+.0f}%")
    if notes:
        resident += f" ({'; '.join(notes)})"
    table.add_row("saved for backward, resident peak", resident)
    cache = offload.get("page_cache_bytes")
    if tier and tier != "swap file":
        table.add_row("swap file in the page cache", "n/a (no swap file)")
    else:
        table.add_row("swap file in the page cache", format_bytes(cache) if cache is not None else "n/a (not sampled)")
    return table


def chance_hint(result: Any) -> str | None:
    """A hint when test accuracy is no better than guessing (``TrainResult.at_chance``)."""
    if not result.at_chance:
        return None
    return (f"test accuracy {_percent(result.test_accuracy)} is at chance for {result.num_classes} classes "
            f"({100 / result.num_classes:.1f}%) after {plural(result.final_step, 'step')}: train for more steps "
            "(--epochs/--steps) or with a higher --lr")


def summary_tables(result: Any) -> list[Table]:
    """Every table of the training summary, in print order."""
    tables = [summary_table(result)]
    if result.phases:
        tables.append(phase_table(result))
    if result.offload is not None:
        tables.append(offload_table(result.offload))
    return tables


def summary_tables_dict(result: Any) -> list[dict[str, Any]]:
    return [table_dict(t) for t in summary_tables(result)]


def render_training_summary(result: Any, console: Any = None) -> None:
    """The summary tables of a TrainResult, then the hint when the model is at chance."""
    console = _console(console)
    for table in summary_tables(result):
        render_table(table, console)
    hint = chance_hint(result)
    if hint:
        console.print(f"hint: {hint}", markup=False, highlight=False, soft_wrap=True)


def evaluation_tables(evaluation: Any, class_names: list[str] | None = None) -> list[Table]:
    """The scores, and per-class accuracy with the confusion matrix (up to 20 classes)."""
    scores = Table("evaluation", ["what", "value"], show_header=False)
    scores.add_row("accuracy", f"{_percent(evaluation.accuracy)} ({plural(evaluation.examples, 'example')})")
    if evaluation.top5_accuracy is not None:  # None with 5 classes or fewer, where it is always 100%
        scores.add_row("top-5 accuracy", _percent(evaluation.top5_accuracy))
    scores.add_row("loss", f"{evaluation.loss:.4f}")
    k = evaluation.confusion.shape[0]
    if k > 20:
        scores.notes.append(f"confusion matrix: {k} classes, in --json only")
        return [scores]
    matrix = Table("confusion matrix (rows: true class, columns: predicted)",
                   ["class", *(str(j) for j in range(k)), "accuracy"], right=set(range(1, k + 2)))
    per_class = evaluation.per_class_accuracy()
    for i in range(k):
        name = f"{i} {class_names[i]}" if class_names and i < len(class_names) else str(i)  # columns: the numbers
        cells = [str(int(c)) if c else "." for c in evaluation.confusion[i]]
        matrix.add_row(name, *cells, f"{100 * per_class[i]:.1f}%")
    return [scores, matrix]


def render_evaluation(evaluation: Any, console: Any = None, class_names: list[str] | None = None) -> None:
    """Accuracy, top-5, loss, and per-class accuracy with the confusion matrix (up to 20 classes)."""
    console = _console(console)
    for table in evaluation_tables(evaluation, class_names):
        render_table(table, console)


def layer_table(report: Any, model: str | None = None) -> Table:
    """The per-layer rows of ``net.memory_report(batch_size)`` and their totals; ``model`` names it in the title."""
    table = Table(f"memory per layer{f' of {model}' if model else ''}, batch size {report.batch_size}",
                  ["layer", "kind", "output", "parameters", "output bytes", "kept for backward", "working memory"],
                  right={3, 4, 5, 6})
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
        "total", "", "",
        format_bytes(report.parameter_bytes),
        format_bytes(sum(r.output_bytes for r in report.rows)),
        format_bytes(sum(r.saved_bytes for r in report.rows)),
        format_bytes(max((r.working_bytes for r in report.rows), default=0)) + " (largest)",
    )
    gradients = gradient_note(report) or f"gradients {format_bytes(report.gradient_bytes)}"
    table.notes.append(f"parameters {format_bytes(report.parameter_bytes)}, {gradients}, buffers "
                       f"{format_bytes(report.buffer_bytes)}")
    return table


def gradient_note(report: Any) -> str:
    """Where the gradients are when they are no long-lived block (the update in backward); "" when they are."""
    if getattr(report, "gradient_storage", "whole") != "per_layer":
        return ""
    return ("gradients: each layer's only during its own backward, planned with the activation gradients (the "
            "optimizer updates the layer there); --update-after-backward keeps all: "
            f"+{format_bytes(report.parameter_bytes)}")


SAVED_TYPES = ("ACTIVATIONS", "FF_CACHE")


def planned_peak_table(report: Any, offload: dict[str, Any] | None = None) -> Table:
    """One planned peak per plan (no offload; offload N), split into what it includes, with a legend."""
    plans = ["no offload"] + ([f"offload N={offload['window']}"] if offload else [])
    table = Table(f"planned peak of one training step, batch size {report.batch_size}", ["", *plans],
                  right=set(range(1, len(plans) + 1)))
    long_lived = report.parameter_bytes + report.gradient_bytes + report.buffer_bytes
    saved = sum(v for k, v in report.by_type_at_peak.items() if k in SAVED_TYPES)
    rest = report.iteration_peak_bytes - saved
    other_types = ", ".join(f"{k} {format_bytes(v)}" for k, v in sorted(report.by_type_at_peak.items())
                            if v and k not in SAVED_TYPES)
    rows = [("parameters, buffers, gradients", [long_lived]),
            ("activations and saved for backward", [saved]),
            ("the rest of the worst step", [rest])]
    units = offload.get("offload_units_arena_bytes", offload["offload_arena_bytes"]) if offload else 0
    shared = units - offload["offload_arena_bytes"] if offload else 0  # one region with the step's own tensors
    if offload:
        rows[0][1].append(offload["long_lived_bytes"])
        rows[1][1].append(units)
        rows[2][1].append(offload["not_offloaded_peak_bytes"])
    for label, values in rows:
        table.add_row(label, *(format_bytes(v) for v in values))
    if shared:
        table.add_row("less the bytes the two share (one region)", "", f"-{format_bytes(shared)}")
    table.add_section()
    peaks = [report.planned_peak_bytes] + ([offload["planned_peak_bytes_offload"]] if offload else [])
    table.add_row("planned peak", *(format_bytes(v) for v in peaks))
    table.notes += [
        "legend: planned peak = the long-lived blocks + the most bytes alive at one step of the iteration "
        "(placed by lifespan, no fragmentation);",
        f"  no offload: the worst step is step {report.peak_step}; its rest is {other_types or 'nothing'};",
    ]
    if offload:
        rest = "activation gradients, input, working memory" + (", parameter gradients" if gradient_note(report)
                                                                else "")
        table.notes.append(f"  offload N={offload['window']}: saved tensors in the offload arena, the rest "
                           f"({rest}) at its own worst step; "
                           f"{format_bytes(offload['written_per_step_bytes'])} written to the swap file per step")
    if offload:
        table.notes.append(f"  activations and saved for backward at their own peak (not at the worst step): "
                           f"{format_bytes(offload['offloadable_bytes_no_offload'])} without offload, "
                           f"{format_bytes(units)} with: what engine train's summary and engine bench compare")
        if shared:
            table.notes.append("  one region: the offload units sit in the bytes the rest leaves free while they are "
                               "alive (engine.offload.plan.place_around; without a byte budget)")
    if gradient_note(report):
        table.notes.append(f"  {gradient_note(report)}")
    table.notes.append("  not included: the optimizer's state (momentum: as large as the parameters), the INPUT "
                       "prefetch ring, the interpreter and its libraries: RSS is larger (engine train's summary)")
    return table


def arena_table(report: Any) -> Table:
    """The planned arena (activations, saved, activation gradients): the plan's size, its bound, measured."""
    table = Table("planned arena: activations, saved for backward, activation gradients, working memory", ["", "bytes"],
                  right={1})
    table.add_row("arena (offsets planned from lifespans)", format_bytes(report.arena_planned_bytes))
    table.add_row("lower bound (most alive at one step)", format_bytes(report.arena_lower_bound_bytes))
    table.add_row("all kept at once (a bump workspace)", format_bytes(report.arena_total_bytes))
    measured = report.measured
    if measured:
        table.add_section()
        table.add_row("measured, one step: arena reserved", format_bytes(measured["arena_reserved_bytes"]))
        table.add_row("measured: arena live at once", format_bytes(measured["arena_live_peak_bytes"]))
        table.add_row("measured: all workspaces and blocks", format_bytes(measured["reserved_bytes"]))
        table.add_row("measured: peak RSS of this process", format_bytes(measured["peak_rss_bytes"]))
    return table


def memory_tables(report: Any, offload: dict[str, Any] | None = None, model: str | None = None) -> list[Table]:
    """Every table ``engine memory`` prints (and ``--json`` gives under ``tables``)."""
    return [layer_table(report, model), planned_peak_table(report, offload), arena_table(report)]


def render_memory_report(report: Any, console: Any = None, offload: dict[str, Any] | None = None,
                         model: str | None = None) -> None:
    """The per-layer table, the planned peak per plan with its legend, and the planned arena."""
    console = _console(console)
    for table in memory_tables(report, offload, model):
        render_table(table, console)

"""Offload for a training run: the options of ``engine train`` and the object the Trainer plugs in.

``Trainer(..., offload=OffloadSession(OffloadConfig(window=4)))`` calls ``start(trainer)`` before
the first step (the scheduler becomes the network's hook and tensor provider, the plan, arena and
swap file are made for the run's batch size, so a full disk is an error before training) and
``stop(trainer)`` in its ``finally`` (threads end, the swap directory goes, also after an exception).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from engine.offload.scheduler import OffloadScheduler, OffloadTarget
from engine.offload.storage import VERIFY_MODES, DelayHook
from engine.report import Table, format_bytes
from engine.validate import parse_window


@dataclass(frozen=True)
class OffloadConfig:
    """``--offload-n N|auto``, ``--offload-budget BYTES``, ``--offload-dir DIR``, ``--offload-params``,
    ``--offload-verify full|header|off`` (engine.offload.storage)."""

    window: int | str | None = None  # N, "auto", or None with a budget (the largest window that fits)
    budget_bytes: int | None = None
    directory: str | None = None
    params: bool = False  # the optimizer state goes to disk between updates (engine.offload.params)
    verify: str = "full"  # what is checked when a record comes back from the swap file
    host_swap: int | str = "auto"  # a device run's pinned host tier (scheduler ``host_swap_bytes``)

    @classmethod
    def from_options(cls, n: str | None, budget_bytes: int | None, directory: str | None,
                     params: bool = False, verify: str = "full", host_swap: int | str = "auto") -> OffloadConfig | None:
        """The config for the command-line options, None when offload is off; ValueError on bad values.
        ``budget_bytes``: ``--offload-budget`` as ``budget.resolve_budget`` (or ``Budget.bytes_for``) made it."""
        if verify not in VERIFY_MODES:
            raise ValueError(f"--offload-verify must be one of {', '.join(VERIFY_MODES)}, got {verify!r}")
        if n is None and budget_bytes is None:
            if params:
                raise ValueError("--offload-params goes with --offload-n N|auto or --offload-budget BYTES")
            return None
        window = parse_window(n)  # OptionError (a ValueError) on anything but a positive integer or 'auto'
        if budget_bytes is not None and not budget_bytes > 0:
            raise ValueError(f"--offload-budget must be positive, got {budget_bytes!r}")
        budget_bytes = int(budget_bytes) if budget_bytes is not None else None
        return cls(window, budget_bytes, directory, params, verify, host_swap)

    def scheduler(self, backend: Any, delay: DelayHook | None = None, **options: Any) -> OffloadScheduler:
        return OffloadScheduler(backend, self.window, budget_bytes=self.budget_bytes, directory=self.directory,
                                delay=delay, verify=self.verify, host_swap_bytes=self.host_swap, **options)


class OffloadHost(Protocol):
    """What an offload session needs of the trainer (``engine.train.Trainer`` has it), so offload does not
    import the trainer: the network, the batch size, the optimizer (for ``--offload-params``) and the
    fields it may add to every memory-monitor line."""

    @property
    def net(self) -> OffloadTarget: ...
    @property
    def batch_size(self) -> int: ...
    @property
    def optimizer(self) -> Any: ...
    @property
    def memory_fields(self) -> dict[str, Callable[[], Any]]: ...


class OffloadSession:
    """What the Trainer's ``offload`` slot takes (a ``TrainerPlugin``): ``start(trainer)`` / ``stop(trainer)``."""

    def __init__(self, config: OffloadConfig, delay: DelayHook | None = None, **options: Any):
        self.config = config
        self.delay = delay
        self.options = options
        self.scheduler: OffloadScheduler | None = None
        self.state_offload: Any = None
        self.no_offload_bytes: int | None = None  # the baseline the summary compares the resident peak with

    def prepare(self, net: OffloadTarget, batch_size: int) -> OffloadScheduler:
        """Make the scheduler, attach it to ``net`` and plan for ``batch_size`` (swap file included)."""
        if self.no_offload_bytes is None:
            self.no_offload_bytes = offloadable_resident_bytes(net, batch_size)
        if self.scheduler is None:
            scheduler = self.config.scheduler(net.backend, delay=self.delay, **self.options)
            try:
                scheduler.attach(net, batch_size=batch_size)
            except BaseException:
                scheduler.close()
                raise
            self.scheduler = scheduler
        return self.scheduler

    def start(self, trainer: OffloadHost) -> None:
        scheduler = self.prepare(trainer.net, trainer.batch_size)
        try:
            trainer.memory_fields["swap"] = scheduler.swap_report  # each memory-monitor line gets the window
            if self.config.params:
                from engine.offload.params import OptimizerStateOffload

                lookahead = scheduler.window if isinstance(scheduler.window, int) else 4
                self.state_offload = OptimizerStateOffload(trainer.optimizer, self.config.directory, lookahead,
                                                           delay=self.delay)
                trainer.net.hooks.append(self.state_offload)
        except BaseException:
            self.stop(trainer)
            raise

    def summary(self) -> dict[str, Any] | None:
        """What offload measurably did over the run, for the training summary (None before any step).

        Per-step figures are means over the steps after the first (the first step plans, maps the
        arena and warms the swap file; with one step, that step). ``resident_peak_bytes`` is the most
        saved-for-backward bytes resident at once in any step, beside ``no_offload_bytes``, what the
        planned arena holds of the same tensors without offload (``offloadable_resident_bytes``).
        ``page_cache_bytes`` is the swap file's bytes in the page cache at the start of the backward
        (mincore), the most over the steps: O_DIRECT keeps it at 0 where the file system allows it.
        """
        scheduler = self.scheduler
        if scheduler is None or not scheduler.totals.steps:
            return None
        totals = scheduler.totals
        steady = scheduler.steady_totals if scheduler.steady_totals.steps else totals  # one step: that step
        return {
            "requested": str(self.config.window) if self.config.window is not None else "budget",
            "swap_tier": scheduler.storage.kind if scheduler.storage is not None else None,
            "window": scheduler.stats[-1].window,
            "max_window": scheduler.max_window,  # the largest window the budget (or the run) allows
            "window_history": [{"step": step, "window": window} for step, window in totals.changes()],
            "window_changes": totals.window_changes_total,
            "steps": totals.steps,
            "steps_averaged": steady.steps,
            "stall_ms_per_step": 1e3 * steady.stall_s / steady.steps,
            "io_cpu_ms_per_step": 1e3 * steady.io_cpu_s / steady.steps,
            "written_bytes_per_step": int(steady.bytes_written / steady.steps),
            "read_bytes_per_step": int(steady.bytes_read / steady.steps),
            "resident_peak_bytes": totals.peak_resident_bytes,
            "bound_bytes": totals.bound_bytes,
            "shared_region": scheduler.shared_region,  # bound_bytes: the shared region
            "no_offload_bytes": self.no_offload_bytes,
            "page_cache_bytes": totals.page_cache_bytes if totals.page_cache_bytes >= 0 else None,
        }

    def stop(self, trainer: OffloadHost) -> None:
        trainer.memory_fields.pop("swap", None)
        try:
            if self.state_offload is not None:
                if self.state_offload in trainer.net.hooks:
                    trainer.net.hooks.remove(self.state_offload)
                self.state_offload.close()  # the state comes back into memory first
        finally:
            if self.scheduler is not None:
                self.scheduler.close()


def session_from_options(net: OffloadTarget, batch_size: int, n: str | None, budget_bytes: int | None,
                         directory: str | None, params: bool = False, verify: str = "full",
                         host_swap: int | str = "auto") -> OffloadSession | None:
    """For ``engine train``: None without offload options; else a session already planned and attached.

    Planning before the Trainer starts turns a bad option, an unwritable directory or a full disk into
    an error before the first step. Raises ValueError, OffloadError or OffloadStorageError.
    """
    config = OffloadConfig.from_options(n, budget_bytes, directory, params, verify, host_swap)
    if config is None:
        return None
    if params and net.backend.is_device:
        raise ValueError("--offload-params works on the cpu and cudasim backends (the optimizer state of a GPU run "
                         "lives in device memory)")
    session = OffloadSession(config, sample_page_cache=True)  # one mincore per step: the summary's page-cache figure
    session.prepare(net, batch_size)
    return session


def offloadable_resident_bytes(net: Any, batch_size: int) -> int:
    """The bytes of ACTIVATIONS and FF_CACHE a step holds without offload: the planned arena's peak for them.

    The one baseline every "without offload" figure uses (``engine train``'s plan line and summary,
    ``engine memory --offload-n``): the network places those tensors by lifespan
    (``net.arena_plan``), so keeping all of them at once (the offload plan's ``total_bytes``, 248.1
    MiB for ResNet-18 at batch 32 against 144.0 planned) is not what training without offload costs.
    """
    from engine.memory.array_type import ArrayType

    if getattr(net, "arena", None) is None:  # workspaces off: every tensor its own allocation, all kept
        from engine.offload.plan import program_units

        units, _, _ = program_units(net.program(batch_size))
        return sum(u.footprint for u in units)
    return int(net.arena_plan(batch_size, (ArrayType.ACTIVATIONS, ArrayType.FF_CACHE)).planned_peak)


def planned_peaks(net: Any, batch_size: int, window: int, budget_bytes: int | None = None) -> dict[str, Any]:
    """The planned peak of one training step with and without offload (``engine memory --offload-n``).

    Without offload: ``net.memory_report``'s liveness plan. With offload: the same long-lived blocks,
    the largest moment of everything the scheduler does not place (the program's gradients, input and
    loss head buffers, and working memory), plus the offload arena, which holds every ACTIVATIONS and
    FF_CACHE buffer a node makes; without ``budget_bytes`` only what that arena adds to the step's own (the
    scheduler places the units in the bytes the step's tensors leave free: ``OffloadScheduler.sharing``),
    ``offload_units_arena_bytes`` the units' own.
    """
    from engine.memory.planner import lower_bound
    from engine.offload.plan import (
        NETWORK_INPUT,
        budget_refusal,
        build_plan,
        place_around,
        program_units,
        recompute_candidates,
    )
    from engine.offload.scheduler import step_arena_tensors

    report = net.memory_report(batch_size, arena=False)  # the peak and the blocks: no arena plan
    program = net.program(batch_size)
    scratch = program.scratch_at()
    kept = [b for b in program.buffers if not b.offloadable]
    rest = max(sum(b.nbytes for b in kept if b.first <= moment <= b.last) + scratch[moment]
               for moment in range(program.moments))
    units, _, steps = program_units(program)
    candidates = recompute_candidates(program, units)
    window_only = build_plan(units, window, steps, candidates)  # the window's own plan
    if budget_bytes is not None:  # the scheduler's own refusal, in its words
        def plan_at(n: int) -> Any:
            return window_only if n == window else build_plan(units, n, steps, candidates)

        refusal = budget_refusal(units, plan_at, budget_bytes, window, batch_size=batch_size)
        if refusal is not None:
            raise ValueError(refusal)
    plan = build_plan(units, window, steps, candidates, budget_bytes) if budget_bytes is not None else window_only
    swap_only = build_plan(units, window, steps)
    long_lived = report.parameter_bytes + report.gradient_bytes + report.buffer_bytes
    # without a byte budget the scheduler places the units in the step arena's free bytes (one region): what offload
    # adds is the region beyond the step's own bytes (OffloadScheduler.sharing; engine.offload.plan.place_around)
    step = step_arena_tensors(net, batch_size) if budget_bytes is None else None
    arena = plan.arena_bytes
    if step is not None:
        # the region less the most the step's tensors hold at one moment, not less their placed peak: ``rest``
        # counts them by moment, and where their placement leaves gaps (MobileNetV2 224 batch 128 with
        # --chunks pairs: placed 49 MiB above its most at one moment) the region still holds those bytes
        tensors, _ = step
        most = lower_bound([t.nbytes for t in tensors], [[(t.first, t.last)] for t in tensors])
        arena = max(0, place_around(plan, *step).region_bytes - most)
    layers = []
    for unit in sorted(plan.units.values(), key=lambda u: (u.spec.owner, u.spec.part)):
        if unit.spec.backward_start is None:
            continue  # transient: read by forwards only, never kept for backward
        source = ""
        if unit.recompute is not None:
            source = " + ".join(f"its {tensor.name.split(':', 1)[1]}" if key[0] == unit.spec.owner
                                else "the network input" if key == NETWORK_INPUT
                                else program.node_names[key[0]] for key, tensor in unit.recompute.sources)
        by_budget = unit.key in plan.kept  # the window alone would have written or rebuilt it (plan.keep_within)
        layers.append({"layer": unit.spec.name, "tensors": [t.name.split(":", 1)[1] for t in unit.spec.tensors],
                       "bytes": unit.nbytes, "decision": unit.decision, "from": source, "by_budget": by_budget})
    return {
        "window": window,
        "budget_bytes": budget_bytes,
        "planned_peak_bytes_no_offload": report.planned_peak_bytes,
        "planned_peak_bytes_offload": long_lived + rest + arena,
        "long_lived_bytes": long_lived,
        "not_offloaded_peak_bytes": rest,  # gradients, input, loss head, working memory at their worst step
        "offloadable_bytes_no_offload": offloadable_resident_bytes(net, batch_size),
        "offloadable_bytes_all_kept": plan.total_bytes,
        "offload_arena_bytes": arena,  # what the plan adds to the step: its units' arena, less what they share
        "offload_units_arena_bytes": plan.arena_bytes,  # the units' own arena (what a byte budget counts)
        "offload_lower_bound_bytes": plan.lower_bound_bytes,
        "swap_file_bytes": plan.file_bytes,
        "written_per_step_bytes": plan.offloaded_bytes,
        "written_per_step_bytes_window_only": window_only.offloaded_bytes,
        "written_per_step_bytes_swap_only": swap_only.offloaded_bytes,
        "recomputed_per_step_bytes": sum(u.nbytes for u in plan.recomputed),
        "layers": layers,
    }


def plan_layers_table(peaks: dict[str, Any]) -> Table:
    """``engine memory --offload-n``: per layer, what its saved tensors do (keep, swap, recompute).

    A ``Table`` of engine/report.py like every other table a command prints: bytes through
    ``format_bytes``, and no cell cut on a narrow terminal (a long "recompute from a + b" stays whole).
    """
    budget = peaks.get("budget_bytes")
    title = f"saved for backward per layer, offload N={peaks['window']}"
    table = Table(title + (f", budget {format_bytes(budget)}" if budget else ""),
                  ["layer", "tensors", "bytes", "decision"], right={2})
    for row in peaks["layers"]:
        decision = row["decision"] + (f" from {row['from']}" if row["from"] else "")
        decision += " (budget)" if row.get("by_budget") else ""
        table.add_row(row["layer"], ",".join(row["tensors"]), format_bytes(row["bytes"]), decision)
    table.notes.append(f"written per step: {format_bytes(peaks['written_per_step_bytes'])} with recompute, "
                       f"{format_bytes(peaks['written_per_step_bytes_swap_only'])} if all of it were swapped; "
                       f"{format_bytes(peaks['recomputed_per_step_bytes'])} rebuilt before backward instead")
    if budget:
        table.notes.append(f"the budget keeps the units marked (budget) resident: "
                           f"{format_bytes(peaks['written_per_step_bytes_window_only'])} written per step "
                           f"with the window alone")
    return table

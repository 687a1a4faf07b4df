"""``engine train``'s options in one typed home, checked once.

Why: the command took 36 parameters in one function that checked them, resolved their defaults and
threaded them one by one into the trainer, the offload session, the checkpoints and the summary; a
check could sit anywhere in 246 lines and a new option had four places to reach. Here the options are
one frozen value, grouped the way the parts that read them are (``OffloadOptions`` for the offload
session, ``ParallelOptions`` for data parallel, ``OutputOptions`` for the files a run writes), and
every check that needs only the options runs in ``__post_init__``, before any data is read or any
kernel compiled. Checks that need the data, the network or the MPI world stay where those exist.

This module imports nothing heavy (no NumPy, no Numba): ``cli`` builds the options before the backend
is chosen, and ``--backend cudasim`` must be switched on before Numba is imported.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from typing import Any

from engine.errors import OptionError, UserError
from engine.validate import check_output_path, parse_window

DEFAULT_LR = {"sgd": 0.01, "adam": 1e-3}
PLOT_SUFFIXES = (".png", ".pdf", ".svg")  # what matplotlib writes for --memory-plot


DEFAULT_PREFETCH = 2
"""Batches the loader prepares ahead when ``--prefetch`` is not given. Under a tight memory limit ``engine train``
takes 1 or 0 instead (``engine.offload.budget.resolve_budget``, its ``shallower_rings``) and says so."""


@dataclass(frozen=True)
class OffloadOptions:
    """``--offload-n``, ``--offload-budget``, ``--offload-dir``, ``--offload-params``, ``--offload-verify``,
    ``--offload-host-memory`` as typed (the budget stays text: 'auto' and shares like 0.3x are resolved against
    the network, ``engine.offload.budget.resolve_budget``)."""

    n: str | None = None
    budget: str | None = None
    directory: str | None = None
    params: bool = False
    verify: str = "full"
    host_memory: str = "auto"  # --offload-host-memory: a GPU run's pinned host swap tier, bytes or 'auto'
    chunks: str = "auto"  # --chunks: what the chunked layers keep (engine.offload.budget.resolve_budget)

    def __post_init__(self) -> None:
        parse_window(self.n)
        _ = self.host_memory_bytes  # a malformed size is an OptionError now, not at the first step

    @property
    def host_memory_bytes(self) -> int | str:
        """``--offload-host-memory`` as the scheduler takes it (``host_swap_bytes``): bytes, or "auto"."""
        text = str(self.host_memory).strip().lower()
        if text == "auto":
            return "auto"
        from engine.offload.storage import parse_bytes

        try:
            return parse_bytes(text)
        except ValueError as exc:
            raise OptionError(f"--offload-host-memory: {exc}, or 'auto'") from None

    @property
    def enabled(self) -> bool:
        return self.n is not None or self.budget is not None


@dataclass(frozen=True)
class ParallelOptions:
    """``--workers``, ``--averaging``, ``--averaging-frequency`` (issue 12)."""

    workers: int | None = None
    averaging: str = "gradients"
    frequency: int = 1


@dataclass(frozen=True)
class OutputOptions:
    """The files a run writes: ``--save`` (also every ``--checkpoint-every`` steps), ``--summary-json``,
    ``--memory-log``, ``--memory-plot``."""

    save: str | None = None
    checkpoint_every: int = 0
    summary_json: str | None = None
    memory_log: str | None = None
    memory_plot: str | None = None

    def __post_init__(self) -> None:
        if self.checkpoint_every and not self.save:
            raise UserError("--checkpoint-every writes the --save file: give --save FILE too")

    def check_writable(self, checkpoint_nbytes: int) -> None:
        """Every output path writable, with room for the checkpoint's bytes, before the first step: a run
        must not train for hours and then fail to write (``engine.validate.check_output_path``). Then the
        plot's suffix: a path that cannot be written at all is the more useful message."""
        named = {"--save": (self.save, checkpoint_nbytes), "--summary-json": (self.summary_json, 0),
                 "--memory-log": (self.memory_log, 0), "--memory-plot": (self.memory_plot, 0)}
        for option, (path, nbytes) in named.items():
            if path:
                check_output_path(option, path, nbytes)
        if self.memory_plot and os.path.splitext(self.memory_plot)[1].lower() not in PLOT_SUFFIXES:
            raise UserError(f"--memory-plot {self.memory_plot}: give a .png, .pdf or .svg file name")
        if self.memory_plot and importlib.util.find_spec("matplotlib") is None:  # an extra since issue 33
            raise UserError("--memory-plot draws with matplotlib, which is not installed: pip install -e '.[plot]' "
                            "(or pip install matplotlib), or leave out --memory-plot")


@dataclass(frozen=True)
class TrainOptions:
    """Everything ``engine train`` was asked, defaults resolved (``lr``, ``epochs``), combinations checked.

    ``cli.train`` builds it from click's parameters (``from_cli``); ``engine.train.Trainer.from_options``,
    the offload session (``offload``), the checkpoints (``run_record``, ``hyper``) and the summary JSON
    (``summary_fields``) read it.
    """

    model: str
    data: str = "digits"
    image_size: int | None = None
    variant: str | None = None
    num_classes: int | None = None
    batch_size: int = 32
    epochs: int | None = None  # None with --steps; 1 when neither is given
    steps: int | None = None
    lr: float | None = None  # None: the optimizer's default (DEFAULT_LR)
    lr_schedule: str = "constant"
    optimizer: str = "sgd"
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 0.0
    update_after_backward: bool = False
    seed: int = 0
    backend: str = "auto"
    workspace_mode: str = "enabled"
    weights: str | None = None
    # With --weights too, --resume wins (a note says so): after Ctrl-C the hint says "continue with --resume FILE",
    # and the natural next command is the original one with that added; the checkpoint descends from --weights.
    resume: str | None = None
    override: tuple[str, ...] = ()  # with --resume: options allowed to differ from the checkpoint's
    shuffle: bool = True
    augment: bool = False
    threads: int | None = None
    prefetch: int | None = None  # --prefetch; None: DEFAULT_PREFETCH, shallower when the memory limit needs it
    gc_every: int = 100
    progress: bool = True
    progress_interval: float = 10.0  # seconds between plain progress lines when the output is not a terminal
    cuda_graph: bool | None = None  # --cuda-graph/--no-cuda-graph; None: on for --backend cuda where nothing forbids it
    offload: OffloadOptions = field(default_factory=OffloadOptions)
    parallel: ParallelOptions = field(default_factory=ParallelOptions)
    outputs: OutputOptions = field(default_factory=OutputOptions)

    def __post_init__(self) -> None:
        if self.override and not self.resume:
            raise UserError("--override names options that may differ from a --resume checkpoint: "
                            "give --resume FILE too")
        if self.epochs is not None and self.steps is not None:
            raise UserError("give --epochs or --steps, not both")
        if self.workspace_mode == "none" and self.offload.enabled:
            raise UserError("offload swaps workspace tensors: --offload-n/--offload-budget need --workspace-mode "
                            "enabled")
        if self.cuda_graph and self.offload.params:
            raise UserError("--cuda-graph with --offload-params: the optimizer state moves between a step's launches, "
                            "which a replayed graph skips; leave out --cuda-graph (the step then runs eagerly)")
        if self.epochs is None and self.steps is None:
            object.__setattr__(self, "epochs", 1)
        if self.lr is None:
            object.__setattr__(self, "lr", DEFAULT_LR[self.optimizer])

    @classmethod
    def from_cli(cls, params: dict[str, Any]) -> TrainOptions:
        """From click's keyword arguments (the option names of ``cli.train``)."""
        p = dict(params)
        offload = OffloadOptions(p.pop("offload_n"), p.pop("offload_budget"), p.pop("offload_dir"),
                                 p.pop("offload_params"), p.pop("offload_verify"), p.pop("offload_host_memory"),
                                 p.pop("chunks"))
        parallel = ParallelOptions(p.pop("workers"), p.pop("averaging"), p.pop("averaging_frequency"))
        outputs = OutputOptions(p.pop("save"), p.pop("checkpoint_every"), p.pop("summary_json"),
                                p.pop("memory_log"), p.pop("memory_plot"))
        override = tuple(o.strip() for o in p.pop("override").split(",") if o.strip())
        return cls(data=p.pop("data_spec"), backend=p.pop("backend_name"), shuffle=not p.pop("no_shuffle"),
                   override=override, offload=offload, parallel=parallel, outputs=outputs, **p)

    def check_parallel(self) -> None:
        """Checks that hold only when this process is a rank of a data-parallel world."""
        if self.parallel.averaging == "parameters" and self.offload.params:
            raise UserError("--averaging parameters needs the optimizer state in memory: leave out --offload-params")

    @property
    def prefetch_depth(self) -> int:
        """The batches prepared ahead: ``--prefetch``, or ``DEFAULT_PREFETCH`` when it was not given."""
        return DEFAULT_PREFETCH if self.prefetch is None else self.prefetch

    def total_steps(self, train_examples: int, workers: int = 1) -> int:
        """--steps, or --epochs passes over a training split of ``train_examples`` shared by ``workers``."""
        if self.steps is not None:
            return self.steps
        return self.epochs * (train_examples // (self.batch_size * workers))

    def run_record(self, num_classes: int, variant: str | None, image_size: int | None = None) -> dict[str, Any]:
        """What defines the run's data and batches: saved in checkpoints, a resume must match it.

        ``image_size``: the side of the images the network takes (whatever chose it: --image-size or the
        data set), so a resume at another size is refused unless ``--override image_size`` says so
        (before, it continued silently, issue 31)."""
        run = {"model": self.model, "data": self.data, "batch_size": self.batch_size, "seed": self.seed,
               "shuffle": self.shuffle, "augment": self.augment, "num_classes": num_classes}
        if image_size is not None:
            run["image_size"] = int(image_size)
        if variant:  # imagenet issue: which of torchvision's two shapes ran
            run["variant"] = variant
        return run

    def hyper(self, total_steps: int) -> dict[str, Any]:
        """Hyper-parameters a resume must not change silently (issue 14); saved beside ``run_record``."""
        hyper = {"optimizer": self.optimizer, "lr": self.lr, "lr_schedule": self.lr_schedule,
                 "momentum": self.momentum, "nesterov": self.nesterov, "weight_decay": self.weight_decay}
        if self.lr_schedule in ("cosine", "step"):  # their learning rate at step s depends on the run's length
            hyper["steps"] = total_steps
        return hyper


__all__ = ["OffloadOptions", "OutputOptions", "ParallelOptions", "TrainOptions"]

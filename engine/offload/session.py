"""Offload for a training run: the options of ``engine train`` and the object the Trainer plugs in.

``Trainer(..., offload=OffloadSession(OffloadConfig(window=4)))`` calls ``start(trainer)`` before
the first step (the scheduler becomes the network's hook and tensor provider, the plan, arena and
swap file are made for the run's batch size, so a full disk is an error before training) and
``stop(trainer)`` in its ``finally`` (threads end, the swap directory goes, also after an exception).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.offload.scheduler import OffloadScheduler
from engine.offload.storage import DelayHook, parse_bytes


@dataclass(frozen=True)
class OffloadConfig:
    """``--offload-n N|auto``, ``--offload-budget BYTES``, ``--offload-dir DIR``."""

    window: int | str | None = None  # N, "auto", or None with a budget (the largest window that fits)
    budget_bytes: int | None = None
    directory: str | None = None

    @classmethod
    def from_options(cls, n: str | None, budget: str | None, directory: str | None) -> OffloadConfig | None:
        """The config for the command-line options, None when offload is off; ValueError on bad values."""
        if n is None and budget is None:
            return None
        window: int | str | None = None
        if n is not None:
            text = str(n).strip().lower()
            if text == "auto":
                window = "auto"
            else:
                try:
                    window = int(text)
                except ValueError:
                    raise ValueError(f"--offload-n must be a positive integer or 'auto', got {n!r}") from None
                if window < 1:
                    raise ValueError(f"--offload-n must be at least 1 (layers kept in memory), got {window}")
        budget_bytes = parse_bytes(budget) if budget is not None else None
        if budget_bytes is not None and budget_bytes <= 0:
            raise ValueError(f"--offload-budget must be positive, got {budget!r}")
        return cls(window, budget_bytes, directory)

    def scheduler(self, backend: Any, delay: DelayHook | None = None, **options: Any) -> OffloadScheduler:
        return OffloadScheduler(backend, self.window, budget_bytes=self.budget_bytes, directory=self.directory,
                                delay=delay, **options)


class OffloadSession:
    """What the Trainer's ``offload`` slot takes: ``start(trainer)`` / ``stop(trainer)``."""

    def __init__(self, config: OffloadConfig, delay: DelayHook | None = None, **options: Any):
        self.config = config
        self.delay = delay
        self.options = options
        self.scheduler: OffloadScheduler | None = None

    def start(self, trainer: Any) -> None:
        self.scheduler = self.config.scheduler(trainer.net.backend, delay=self.delay, **self.options)
        try:
            self.scheduler.attach(trainer.net, batch_size=trainer.batch_size)
            _report_swap_in_memory_lines(trainer, self.scheduler)
        except BaseException:
            self.scheduler.close()
            raise

    def stop(self, trainer: Any) -> None:
        if self.scheduler is not None:
            self.scheduler.close()


def _report_swap_in_memory_lines(trainer: Any, scheduler: OffloadScheduler) -> None:
    """Make the trainer's memory listener pass ``swap=scheduler.swap_report()`` to the monitor.

    The Trainer's MemoryListener samples the monitor after every step; its subclass below adds the
    scheduler's resident, in-flight and swapped bytes and the window to each JSON line.
    """
    from engine.train import MemoryListener

    class SwapMemoryListener(MemoryListener):
        def on_step_end(self, trainer: Any, record: Any) -> None:
            self.monitor.sample(record.step, loss=record.loss, swap=scheduler.swap_report())

    for i, listener in enumerate(trainer.listeners):
        if type(listener) is MemoryListener:
            trainer.listeners[i] = SwapMemoryListener(listener.monitor, listener.plot_path)

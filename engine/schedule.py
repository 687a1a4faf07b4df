"""Learning-rate schedules: the learning rate as a pure function of the step number.

A schedule is a function, not an object with state, so resuming from a checkpoint needs only the
step count to give the same learning rate as an uninterrupted run. The formulas are PyTorch's
closed forms (StepLR, CosineAnnealingLR), stepped once per training step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from engine.errors import OptionError
from engine.validate import check_number

SCHEDULE_NAMES = ("constant", "step", "cosine")


@dataclass(frozen=True)
class LRSchedule:
    """``lr(step)`` for step 0, 1, ...; ``total_steps`` is the length of the whole run."""

    name: str
    base_lr: float
    total_steps: int
    step_size: int = 0  # "step": decay every step_size steps
    gamma: float = 0.1  # "step": multiply by gamma at each decay
    min_lr: float = 0.0  # "cosine": the learning rate reached at total_steps

    def __call__(self, step: int) -> float:
        if self.name == "constant":
            return self.base_lr
        if self.name == "step":
            return self.base_lr * self.gamma ** (step // self.step_size)
        # cosine: half a cosine wave from base_lr down to min_lr over the run
        progress = min(step, self.total_steps) / self.total_steps
        return self.min_lr + (self.base_lr - self.min_lr) * (1 + math.cos(math.pi * progress)) / 2


def make_schedule(spec: str, base_lr: float, total_steps: int) -> LRSchedule:
    """Parse ``constant``, ``cosine``, ``step`` or ``step:STEP_SIZE[:GAMMA]``.

    A bare ``step`` decays by 0.1 after each third of the run, a common recipe.
    """
    name, _, rest = spec.partition(":")
    if name not in SCHEDULE_NAMES:
        raise OptionError(f"unknown learning-rate schedule {spec!r}: choose constant, cosine, step or step:N[:GAMMA]")
    check_number("--lr", base_lr, low=0, low_open=True)  # NaN or inf would train to NaN weights
    total_steps = max(int(total_steps), 1)
    if name != "step":
        if rest:
            raise OptionError(f"schedule {name!r} takes no arguments, got {spec!r}")
        return LRSchedule(name, base_lr, total_steps)
    parts = rest.split(":") if rest else []
    try:
        step_size = int(parts[0]) if parts else max(total_steps // 3, 1)
        gamma = float(parts[1]) if len(parts) > 1 else 0.1
    except ValueError:
        raise OptionError(f"cannot read {spec!r}: expected step:STEP_SIZE[:GAMMA], e.g. step:100:0.5") from None
    if step_size < 1 or len(parts) > 2:
        raise OptionError(f"cannot read {spec!r}: expected step:STEP_SIZE[:GAMMA] with STEP_SIZE >= 1")
    check_number(f"--lr-schedule {spec}: GAMMA", gamma, low=0, low_open=True)
    return LRSchedule(name, base_lr, total_steps, step_size=step_size, gamma=gamma)


ScheduleFunction = Callable[[int], float]

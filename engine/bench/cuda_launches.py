"""GPU kernel launches per training step, counted without a GPU.

Every CUDA launcher goes through ``kernels.cuda._launch.launch``, which counts launches by kernel
name; under ``count_only()`` it counts and returns without running anything. So a full training
step (forward, loss, backward, SGD update) of a real model at a real batch size costs only the
Python of the launchers here, and the count is exactly what a GPU would see: launch counts depend on
shapes and on the code paths the shapes pick, never on the values in the arrays (the unwritten
outputs are never read by a launcher). Run it on ``engine.backend.counting_backend()`` or
``cudasim`` (NumPy arrays, nothing executes) or on ``cuda`` (CuPy arrays, nothing launches).

Why it matters: each launch with CuPy arguments costs tens of microseconds of host time
(numba-cuda #578); a per-image conv at batch 32 made thousands of them a step.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class StepLaunches:
    """Launches of one training step, in total and by kernel name."""

    model: str
    batch: int
    image_size: int
    total: int
    by_kernel: dict[str, int]

    def as_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "batch": self.batch,
            "image_size": self.image_size,
            "launches": self.total,
            "by_kernel": self.by_kernel,
        }


@dataclass(frozen=True)
class ArrayArg:
    """What the roofline needs of a kernel's array argument: its shape and size (not its bytes)."""

    shape: tuple[int, ...]
    nbytes: int
    dtype: str = "float32"

    @property
    def size(self) -> int:
        return int(np.prod(self.shape)) if self.shape else 1


@dataclass(frozen=True)
class Launch:
    """One kernel launch of a step: kernel name, grid, block and its arguments (arrays as ArrayArg)."""

    kernel: str
    blocks: Any
    threads: Any
    args: tuple[Any, ...]
    function: Any = field(default=None, repr=False, compare=False)  # the kernel object, to replay the launch


def _describe(argument: Any) -> Any:
    if getattr(argument, "ndim", 0) >= 1:  # arrays; NumPy float32 scalars (eps, lr) stay values
        shape = tuple(int(v) for v in argument.shape)
        return ArrayArg(shape, int(argument.size) * argument.dtype.itemsize, str(argument.dtype))
    return argument


def counted_step(
    model: str, batch: int, backend: Any, image_size: int = 32, num_classes: int = 10, **model_options: Any
) -> tuple[Counter[str], list[Launch]]:
    """Build ``model`` on ``backend`` and run one SGD training step under ``count_only``.

    Returns the launches by kernel name and every launch in order. The step is run twice and the
    second one counted, so one-time work (none today) would not inflate it.
    """
    from engine.optim import make_optimizer
    from kernels.cuda import LAUNCHES, count_only, record_launches, reset_launches
    from models import build_model

    if backend.name not in ("cuda", "cudasim", "cuda-count"):
        raise ValueError(f"launch counts need a CUDA backend (cuda, cudasim or cuda-count), not {backend.name!r}")
    net = build_model(model, num_classes, backend, seed=0, image_size=image_size, **model_options)
    try:
        optimizer = make_optimizer("sgd", net, backend, 0.01, momentum=0.9, manager=net.mgr)
        x = backend.to_device(np.zeros((batch, 3, image_size, image_size), np.float32))
        y = backend.to_device(np.zeros(batch, np.int64))
        with count_only():
            for _ in range(2):
                reset_launches()
                with record_launches() as calls:
                    net.forward(x, training=True)
                    net.loss(y)
                    net.backward()
                    optimizer.step()
                counts = Counter(LAUNCHES)
                launches = [Launch(name, blocks, threads, tuple(_describe(a) for a in args), kernel)
                            for name, kernel, blocks, threads, args in calls]
        reset_launches()
    finally:
        net.close()
    return counts, launches


def count_step_launches(
    model: str, batch: int, backend: Any, image_size: int = 32, num_classes: int = 10
) -> StepLaunches:
    """Launches of one SGD training step of ``model`` at ``batch``, in total and by kernel."""
    counts, _ = counted_step(model, batch, backend, image_size, num_classes)
    return StepLaunches(model, batch, image_size, sum(counts.values()), dict(sorted(counts.items())))

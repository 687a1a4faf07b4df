"""Optimizers: one kernel call per step over the network's contiguous parameter block.

The network keeps every parameter in one PARAMETERS block and every gradient in one GRADIENTS block
(``net.parameters.flat`` / ``net.gradients.flat``), so an update is a single pass over two 1-D
arrays. The optimizer's own state (SGD's momentum buffer, Adam's two moments) is one more block of
type UPDATER_STATE, laid out the same way, so a checkpoint saves it as a handful of flat arrays.

The learning rate comes from a schedule (``engine.schedule``) as a function of the step count, and
the step count is part of the optimizer's state: resuming restores both.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

OPTIMIZER_NAMES = ("sgd", "adam")


class Optimizer:
    """Base: holds the parameter and gradient blocks, the schedule and the step count."""

    name = ""
    state_names: tuple[str, ...] = ()

    def __init__(
        self, parameters: Any, gradients: Any, backend: Any, lr: float | Callable[[int], float], manager: Any = None
    ):
        if parameters.flat.shape != gradients.flat.shape:
            raise ValueError(
                f"parameters ({parameters.flat.shape[0]} values) and gradients ({gradients.flat.shape[0]} values) "
                "must have the same size: they are views of the same layers"
            )
        self.parameters = parameters
        self.gradients = gradients
        self.backend = backend
        self.schedule: Callable[[int], float] = (lambda step: float(lr)) if isinstance(lr, int | float) else lr
        self.steps_taken = 0
        self.state = self._make_state(parameters.flat.shape[0], manager) if self.state_names else None

    def _make_state(self, size: int, manager: Any) -> Any:
        """One zeroed UPDATER_STATE block; ``manager`` (the network's) counts it in memory reports."""
        from engine.memory import ArrayType, ContiguousBlock

        specs = [(name, (size,)) for name in self.state_names]
        return ContiguousBlock(self.backend, ArrayType.UPDATER_STATE, specs, manager=manager)

    @property
    def lr(self) -> float:
        """The learning rate the next step will use."""
        return float(self.schedule(self.steps_taken))

    def step(self) -> None:
        """Apply one update from the current gradients; one kernel call."""
        self._update(self.lr)
        self.steps_taken += 1

    def _update(self, lr: float) -> None:
        raise NotImplementedError

    def hyperparameters(self) -> dict[str, Any]:
        raise NotImplementedError

    # -- checkpoints --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, np.ndarray]:
        """Host copies of the state arrays, by name (empty for plain SGD)."""
        if self.state is None:
            return {}
        return {name: np.array(self.backend.to_host(self.state.views[name])) for name in self.state_names}

    def load_state_dict(self, arrays: dict[str, np.ndarray], steps_taken: int) -> None:
        """Restore the state arrays and the step count saved by ``state_dict``."""
        expected = set(self.state_names)
        if set(arrays) != expected:
            raise ValueError(
                f"optimizer {self.name!r} expects state {sorted(expected)}, the checkpoint has {sorted(arrays)}: "
                "resume with the optimizer the checkpoint was written with"
            )
        for name in self.state_names:
            view = self.state.views[name]
            if tuple(arrays[name].shape) != tuple(view.shape):
                raise ValueError(
                    f"optimizer state {name!r} has shape {tuple(arrays[name].shape)} in the checkpoint, "
                    f"the model needs {tuple(view.shape)}: was it written for another model?"
                )
            view[...] = self.backend.to_device(np.asarray(arrays[name], dtype=np.float32))
        self.steps_taken = int(steps_taken)


class SGD(Optimizer):
    """torch.optim.SGD: momentum (dampening 0), optional Nesterov, L2 weight decay."""

    name = "sgd"

    def __init__(
        self,
        parameters: Any,
        gradients: Any,
        backend: Any,
        lr: float | Callable[[int], float] = 0.01,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        manager: Any = None,
    ):
        if nesterov and momentum <= 0:
            raise ValueError("Nesterov momentum needs momentum > 0")
        self.momentum = float(momentum)
        self.weight_decay = float(weight_decay)
        self.nesterov = bool(nesterov)
        # plain SGD keeps no state, so it costs no memory
        self.state_names = ("momentum_buffer",) if self.momentum != 0 else ()
        super().__init__(parameters, gradients, backend, lr, manager)

    def _update(self, lr: float) -> None:
        # the kernel always takes a buffer of the parameters' size; without momentum it never touches
        # it, so the gradients stand in and plain SGD needs no memory of its own
        buffer = self.state.views["momentum_buffer"] if self.state is not None else self.gradients.flat
        self.backend.kernels.sgd_update(
            self.parameters.flat, self.gradients.flat, buffer, lr, self.momentum, self.weight_decay, self.nesterov
        )

    def hyperparameters(self) -> dict[str, Any]:
        return {"momentum": self.momentum, "weight_decay": self.weight_decay, "nesterov": self.nesterov}


class Adam(Optimizer):
    """torch.optim.Adam with L2 weight decay added to the gradient (not AdamW)."""

    name = "adam"
    state_names = ("exp_avg", "exp_avg_sq")

    def __init__(
        self,
        parameters: Any,
        gradients: Any,
        backend: Any,
        lr: float | Callable[[int], float] = 0.001,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        manager: Any = None,
    ):
        self.beta1, self.beta2 = float(betas[0]), float(betas[1])
        self.eps = float(eps)
        self.weight_decay = float(weight_decay)
        super().__init__(parameters, gradients, backend, lr, manager)

    def _update(self, lr: float) -> None:
        self.backend.kernels.adam_update(
            self.parameters.flat,
            self.gradients.flat,
            self.state.views["exp_avg"],
            self.state.views["exp_avg_sq"],
            lr,
            self.beta1,
            self.beta2,
            self.eps,
            self.weight_decay,
            self.steps_taken + 1,  # Adam's bias correction counts steps from 1
        )

    def hyperparameters(self) -> dict[str, Any]:
        return {"betas": [self.beta1, self.beta2], "eps": self.eps, "weight_decay": self.weight_decay}


def make_optimizer(
    name: str,
    net: Any,
    backend: Any,
    lr: float | Callable[[int], float],
    momentum: float = 0.9,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    manager: Any = None,
) -> Optimizer:
    """The optimizer called ``name`` over ``net.parameters`` / ``net.gradients``."""
    if name == "sgd":
        return SGD(net.parameters, net.gradients, backend, lr, momentum, weight_decay, nesterov, manager=manager)
    if name == "adam":
        return Adam(net.parameters, net.gradients, backend, lr, weight_decay=weight_decay, manager=manager)
    raise ValueError(f"unknown optimizer {name!r}: choose one of {', '.join(OPTIMIZER_NAMES)}")

"""Optimizers: one kernel call per step over the network's contiguous parameter block.

The network keeps every parameter in one PARAMETERS block and every gradient in one GRADIENTS block
(``net.parameters.flat`` / ``net.gradients.flat``), so an update is a single pass over two 1-D
arrays. The optimizer's own state (SGD's momentum buffer, Adam's two moments) is one more block of
type UPDATER_STATE, laid out the same way, so a checkpoint saves it as a handful of flat arrays.

The learning rate comes from a schedule (``engine.schedule``) as a function of the step count, and
the step count is part of the optimizer's state: resuming restores both.

**The update in backward** (``UpdateInBackward``; PyTorch's "optimizer step in backward" with
``register_post_accumulate_grad_hook``). The update kernels are elementwise (each element's new
value reads that element of the parameters, gradient and state only), so updating one layer's slice
of the blocks right after that layer's backward gives the same bits as one pass over everything at
the end (tested for SGD with momentum, Nesterov and weight decay, and Adam, on ResNet-18 and an
MLP). Then no layer's gradients are read after its own backward, and the network keeps none beyond
that moment (``Network.set_gradient_storage("per_layer")``: each node's gradients are a buffer of
its backward moment, placed by the training arena in the gaps between activation gradients):
ResNet-18's 42.6 MiB GRADIENTS block goes, the largest layer's 9.0 MiB fit beside layer4's small
activation gradients. Single-process ``engine train`` does this by default
(``update_in_backward``); ``--update-after-backward`` keeps the whole block and the one pass. The
whole block stays where something reads every gradient after backward: the data-parallel gradient
allreduce (``engine.parallel``: the sum must arrive before any update), ``--offload-params`` (the
optimizer state comes back from disk only in the last moments of backward), and every caller that
runs ``net.backward()`` and ``optimizer.step()`` itself (tests, ``engine bench``, the benchmarks).
The price: a step stopped inside backward (a disk fault in the offload path) leaves some layers
updated and others not, so its weights are no step's and ``engine.guard`` does not write them.
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
        self.in_backward: UpdateInBackward | None = None  # set by update_in_backward: the update runs there

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
        """Apply one update from the current gradients (one kernel call over the blocks); after an update in
        backward (``self.in_backward``), check that it covered every layer and count the step."""
        if self.in_backward is None:
            self._update(self.lr, 0, int(self.parameters.flat.shape[0]), self.gradients.flat)
        else:
            self.in_backward.finish()
        self.steps_taken += 1

    @property
    def update_in_progress(self) -> bool:
        """True while an update in backward has updated some layers and the step is not counted yet: the
        parameters are then neither the last step's nor the next one's (``engine.guard`` reads this)."""
        return self.in_backward is not None and self.in_backward.updated > 0

    def _update(self, lr: float, start: int, stop: int, gradient: Any) -> None:
        """Update parameters (and state) [start, stop) of the blocks from ``gradient`` (stop - start values)."""
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

    def _update(self, lr: float, start: int, stop: int, gradient: Any) -> None:
        # the kernel always takes a buffer of the parameters' size; without momentum it never touches
        # it, so the gradients stand in and plain SGD needs no memory of its own
        buffer = self.state.views["momentum_buffer"][start:stop] if self.state is not None else gradient
        self.backend.kernels.sgd_update(
            self.parameters.flat[start:stop], gradient, buffer, lr, self.momentum, self.weight_decay, self.nesterov
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

    def _update(self, lr: float, start: int, stop: int, gradient: Any) -> None:
        self.backend.kernels.adam_update(
            self.parameters.flat[start:stop],
            gradient,
            self.state.views["exp_avg"][start:stop],
            self.state.views["exp_avg_sq"][start:stop],
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


class UpdateInBackward:
    """A network hook that applies the optimizer's update one layer at a time, inside backward.

    ``after_parameter_gradients`` (right after the backward call of a node with parameters, while its
    gradients are alive) updates that node's slice of the parameter and state blocks from them, with
    the learning rate of the step read once at ``on_iteration_start``; ``optimizer.step()`` afterwards
    only checks that every layer was updated and counts the step. Made by ``update_in_backward``.

    Every hook after it sees the layer's parameters already updated; no backward reads another layer's
    parameters (offload recomputes only parameterless layers, and before their own backward), so
    nothing else changes.
    """

    def __init__(self, net: Any, optimizer: Optimizer):
        self.net = net
        self.optimizer = optimizer
        self.slices = net.parameter_slices()  # node index -> [start, stop) of the blocks
        self.updated = 0  # layers updated in the open iteration
        self.lr = 0.0

    def on_iteration_start(self, net: Any) -> None:
        self.updated = 0  # an iteration abandoned in backward is the caller's to handle (engine.guard)
        self.lr = self.optimizer.lr

    def after_parameter_gradients(self, step: int, node: Any, gradients: Any) -> None:
        start, stop = self.slices[node.index]
        self.optimizer._update(self.lr, start, stop, gradients)
        self.updated += 1

    def finish(self) -> None:
        """The end of a step: every layer must have been updated since the iteration began."""
        if self.updated != len(self.slices):
            raise RuntimeError(
                f"optimizer {self.optimizer.name!r} updates in backward: {self.updated} of {len(self.slices)} layers "
                "were updated; call step() after a complete net.backward()"
            )
        self.updated = 0

    def remove(self) -> None:
        """Back to one update after backward over the whole GRADIENTS block."""
        if self in self.net.hooks:
            self.net.hooks.remove(self)
        self.optimizer.in_backward = None
        self.net.set_gradient_storage("whole")
        self.optimizer.gradients = self.net.gradients


def update_in_backward(net: Any, optimizer: Optimizer) -> UpdateInBackward:
    """Update each layer of ``net`` inside backward, right after its gradients are written, and keep each
    layer's gradients for that moment only (module docstring: what it saves, what needs the whole block).

    Call it between iterations, after the optimizer is made (and restored); ``remove()`` undoes it.
    """
    if optimizer.in_backward is not None:
        raise ValueError(f"optimizer {optimizer.name!r} already updates in backward")
    if optimizer.parameters is not net.parameters:
        raise ValueError("update_in_backward: the optimizer must update this network's parameters block")
    net.set_gradient_storage("per_layer")
    optimizer.gradients = net.gradients  # the whole block is gone: nothing may keep it alive
    hook = UpdateInBackward(net, optimizer)
    optimizer.in_backward = hook
    net.hooks.insert(0, hook)  # before other hooks: they see the layer as the step leaves it
    return hook

"""Optimizer updates on the GPU: one thread per parameter over the flat PARAMETERS block.

The step's numbers come in as float32 kernel arguments. Adam's bias corrections depend only on the
step, so the host computes them once (in double precision, as PyTorch does) instead of every thread.

A step captured as a CUDA graph (engine/cuda_graph.py) replays its launches with the arguments
they were captured with, so the numbers that change every step (the learning rate from the schedule,
Adam's step size and bias correction) cannot be arguments there: ``sgd_update_from`` and
``adam_update_from`` read them from a small device array (``step_scalars`` fills it on the host, outside
the graph, before each replay) and run the same per-element arithmetic (the device functions below) on
the same float32 values, so they give the baked-argument launchers' weights bit for bit.

They also take a ``guard``: a one-float device array whose value, when not finite, makes every thread
return before touching anything. ``engine train`` checks the loss before the update (a diverged step
leaves the weights, the momentum and Adam's moments those of the last good step, which the run then
saves); a replayed graph cannot stop between the loss and the update, so the runner passes the step's
loss as the guard and the device makes the same decision.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numba import cuda, float32

from kernels.cuda._launch import THREADS_PER_BLOCK, blocks_for, f32, launch


@cuda.jit(device=True)
def _sgd_element(param, grad, momentum_buf, i, lr, momentum, weight_decay, nesterov):
    g = grad[i] + weight_decay * param[i]
    if momentum != float32(0.0):
        buf = momentum * momentum_buf[i] + g
        momentum_buf[i] = buf
        if nesterov:
            g = g + momentum * buf
        else:
            g = buf
    param[i] -= lr * g


@cuda.jit
def sgd_kernel(param, grad, momentum_buf, lr, momentum, weight_decay, nesterov):
    """PyTorch's SGD (dampening 0): g += wd·p; buf = momentum·buf + g; step with buf (or g + momentum·buf)."""
    i = cuda.grid(1)
    if i < param.size:
        _sgd_element(param, grad, momentum_buf, i, lr, momentum, weight_decay, nesterov)


@cuda.jit
def sgd_scalars_kernel(param, grad, momentum_buf, scalars, guard, momentum, weight_decay, nesterov):
    """sgd_kernel with the learning rate read from ``scalars[0]`` (device memory) instead of an argument;
    nothing is written when ``guard[0]`` (the step's loss) is not finite."""
    i = cuda.grid(1)
    if i < param.size and math.isfinite(guard[0]):
        _sgd_element(param, grad, momentum_buf, i, scalars[0], momentum, weight_decay, nesterov)


@cuda.jit(device=True)
def _adam_element(param, grad, m, v, i, beta1, beta2, eps, weight_decay, step_size, bias_correction2_sqrt):
    g = grad[i] + weight_decay * param[i]
    m_i = beta1 * m[i] + (float32(1.0) - beta1) * g
    v_i = beta2 * v[i] + (float32(1.0) - beta2) * g * g
    m[i] = m_i
    v[i] = v_i
    param[i] -= step_size * m_i / (math.sqrt(v_i) / bias_correction2_sqrt + eps)


@cuda.jit
def adam_kernel(param, grad, m, v, beta1, beta2, eps, weight_decay, step_size, bias_correction2_sqrt):
    """PyTorch's Adam: moments of g (+ L2), then p −= step_size · m / (sqrt(v) / sqrt(bc2) + eps)."""
    i = cuda.grid(1)
    if i < param.size:
        _adam_element(param, grad, m, v, i, beta1, beta2, eps, weight_decay, step_size, bias_correction2_sqrt)


@cuda.jit
def adam_scalars_kernel(param, grad, m, v, scalars, guard, beta1, beta2, eps, weight_decay):
    """adam_kernel with step size and bias correction read from ``scalars[1]``, ``scalars[2]``; nothing is
    written when ``guard[0]`` is not finite."""
    i = cuda.grid(1)
    if i < param.size and math.isfinite(guard[0]):
        _adam_element(param, grad, m, v, i, beta1, beta2, eps, weight_decay, scalars[1], scalars[2])


SCALARS = 3
"""Length of the per-step scalar array: [learning rate, Adam's step size, Adam's sqrt(1 − beta2^step)]."""


def step_scalars(lr: float, beta1: float = 0.9, beta2: float = 0.999, step: int = 1) -> np.ndarray:
    """The per-step values as the baked launchers compute them (double on the host, then float32)."""
    if step < 1:
        raise ValueError(f"step_scalars: step counts from 1, got {step}")
    return np.array([f32(lr), f32(lr / (1.0 - beta1**step)), f32(math.sqrt(1.0 - beta2**step))], np.float32)


def _check_flat(*arrays: Any) -> None:
    size = arrays[0].size
    for a in arrays:
        if a.ndim != 1 or a.size != size:
            raise ValueError(f"optimizer update: arrays must be 1-D of one length, got {[tuple(b.shape) for b in arrays]}")


def sgd_update(
    param: Any, grad: Any, momentum_buf: Any, lr: float, momentum: float, weight_decay: float, nesterov: bool
) -> None:
    if momentum_buf is None:
        if momentum != 0:
            raise ValueError("sgd_update: momentum != 0 needs a momentum_buf array")
        momentum_buf = grad  # never read or written when momentum is 0
    _check_flat(param, grad, momentum_buf)
    launch(
        sgd_kernel,
        blocks_for(param.size),
        THREADS_PER_BLOCK,
        param,
        grad,
        momentum_buf,
        f32(lr),
        f32(momentum),
        f32(weight_decay),
        bool(nesterov),
    )


def adam_update(
    param: Any,
    grad: Any,
    m: Any,
    v: Any,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
) -> None:
    if step < 1:
        raise ValueError(f"adam_update: step counts from 1, got {step}")
    _check_flat(param, grad, m, v)
    step_size = lr / (1.0 - beta1**step)
    bias_correction2_sqrt = math.sqrt(1.0 - beta2**step)
    launch(
        adam_kernel,
        blocks_for(param.size),
        THREADS_PER_BLOCK,
        param,
        grad,
        m,
        v,
        f32(beta1),
        f32(beta2),
        f32(eps),
        f32(weight_decay),
        f32(step_size),
        f32(bias_correction2_sqrt),
    )


def _check_scalars(scalars: Any) -> None:
    if scalars.ndim != 1 or scalars.size < SCALARS or scalars.dtype != np.float32:
        raise ValueError(f"optimizer update: scalars must be a 1-D float32 device array of {SCALARS}, got "
                         f"{scalars.dtype} {tuple(scalars.shape)}")


def sgd_update_from(
    param: Any, grad: Any, momentum_buf: Any, scalars: Any, momentum: float, weight_decay: float, nesterov: bool,
    guard: Any = None,
) -> None:
    """sgd_update with the learning rate read from ``scalars`` on the device (a captured step's update),
    skipped on the device when ``guard[0]`` is not finite (None: no guard)."""
    if momentum_buf is None:
        if momentum != 0:
            raise ValueError("sgd_update: momentum != 0 needs a momentum_buf array")
        momentum_buf = grad
    _check_flat(param, grad, momentum_buf)
    _check_scalars(scalars)
    launch(sgd_scalars_kernel, blocks_for(param.size), THREADS_PER_BLOCK, param, grad, momentum_buf, scalars,
           _guard(guard, scalars), f32(momentum), f32(weight_decay), bool(nesterov))


def adam_update_from(
    param: Any, grad: Any, m: Any, v: Any, scalars: Any, beta1: float, beta2: float, eps: float, weight_decay: float,
    guard: Any = None,
) -> None:
    """adam_update with the step's step size and bias correction read from ``scalars`` on the device, skipped
    on the device when ``guard[0]`` is not finite (None: no guard)."""
    _check_flat(param, grad, m, v)
    _check_scalars(scalars)
    launch(adam_scalars_kernel, blocks_for(param.size), THREADS_PER_BLOCK, param, grad, m, v, scalars,
           _guard(guard, scalars), f32(beta1), f32(beta2), f32(eps), f32(weight_decay))


def _guard(guard: Any, scalars: Any) -> Any:
    """The guard array; without one, ``scalars`` stands in (its first value, the learning rate, is finite)."""
    if guard is None:
        return scalars
    if guard.size < 1 or guard.dtype != np.float32:
        raise ValueError(f"optimizer update: guard must be a float32 device array, got {guard.dtype} "
                         f"{tuple(guard.shape)}")
    return guard

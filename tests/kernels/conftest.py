"""Shared helpers for kernel tests: seeded inputs and central finite differences."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(0)


def finite_difference_gradient(loss: Callable[[], float], x: np.ndarray, step: float = 1e-6) -> np.ndarray:
    """d loss / d x by central differences, perturbing x in place one element at a time (x: float64)."""
    grad = np.zeros_like(x)
    flat_x, flat_grad = x.reshape(-1), grad.reshape(-1)
    for i in range(flat_x.size):
        saved = flat_x[i]
        flat_x[i] = saved + step
        up = loss()
        flat_x[i] = saved - step
        down = loss()
        flat_x[i] = saved
        flat_grad[i] = (up - down) / (2 * step)
    return grad


@pytest.fixture
def numerical_gradient() -> Callable[..., np.ndarray]:
    return finite_difference_gradient

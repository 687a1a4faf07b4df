"""The CUDA SGD and Adam updates against the NumPy reference over a few steps, simulated."""

from __future__ import annotations

import numpy as np
import pytest

from kernels.cuda import optim
from kernels.reference import optim as ref
from tests.kernels.cuda.conftest import assert_close

pytestmark = pytest.mark.cudasim

SIZE = 37


def _state(seed=0):
    rng = np.random.default_rng(seed)
    param = rng.standard_normal(SIZE).astype(np.float32)
    return param, [rng.standard_normal(SIZE).astype(np.float32) for _ in range(3)]


@pytest.mark.parametrize("momentum, weight_decay, nesterov", [(0.0, 0.0, False), (0.9, 1e-2, False), (0.9, 1e-2, True)])
def test_sgd_matches_reference(momentum, weight_decay, nesterov):
    param, grads = _state()
    p_cuda, p_ref = param.copy(), param.copy()
    buf_cuda, buf_ref = np.zeros(SIZE, np.float32), np.zeros(SIZE, np.float32)
    for grad in grads:
        optim.sgd_update(p_cuda, grad, buf_cuda, 0.1, momentum, weight_decay, nesterov)
        ref.sgd_update(p_ref, grad, buf_ref, 0.1, momentum, weight_decay, nesterov)
    assert_close(p_cuda, p_ref)
    assert_close(buf_cuda, buf_ref)


def test_sgd_without_momentum_needs_no_buffer():
    param, grads = _state(1)
    expected = param - 0.1 * grads[0]
    optim.sgd_update(param, grads[0], None, 0.1, 0.0, 0.0, False)
    assert_close(param, expected)
    with pytest.raises(ValueError, match="momentum_buf"):
        optim.sgd_update(param, grads[0], None, 0.1, 0.9, 0.0, False)


@pytest.mark.parametrize("weight_decay", [0.0, 1e-2])
def test_adam_matches_reference(weight_decay):
    param, grads = _state(2)
    p_cuda, p_ref = param.copy(), param.copy()
    m_cuda, v_cuda = np.zeros(SIZE, np.float32), np.zeros(SIZE, np.float32)
    m_ref, v_ref = np.zeros(SIZE, np.float32), np.zeros(SIZE, np.float32)
    for step, grad in enumerate(grads, start=1):
        optim.adam_update(p_cuda, grad, m_cuda, v_cuda, 1e-2, 0.9, 0.999, 1e-8, weight_decay, step)
        ref.adam_update(p_ref, grad, m_ref, v_ref, 1e-2, 0.9, 0.999, 1e-8, weight_decay, step)
    assert_close(p_cuda, p_ref)
    assert_close(m_cuda, m_ref)
    assert_close(v_cuda, v_ref)


def test_adam_step_counts_from_one():
    param, grads = _state(3)
    with pytest.raises(ValueError, match="counts from 1"):
        optim.adam_update(param, grads[0], grads[1].copy(), grads[2].copy(), 1e-3, 0.9, 0.999, 1e-8, 0.0, 0)

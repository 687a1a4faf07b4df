"""The Network on the CUDA kernels (under the simulator): a graph with the layers the cnn lacks
(depthwise conv, ReLU6, a residual Add, average pools, dropout) trains one step like the cpu backend.

Runs only in the process started with NUMBA_ENABLE_CUDASIM=1 (tests/run does that).
"""

import numpy as np
import pytest

from engine.backend import get_backend
from engine.graph import Graph
from engine.layers import Add, AvgPool2d, BatchNorm2d, Conv2d, Dense, Dropout, GlobalAvgPool, ReLU6
from engine.network import Network

pytestmark = pytest.mark.cudasim


def graph() -> Graph:
    return Graph(
        [
            ("expand", Conv2d(3, 4, 1), ["input"]),
            ("bn", BatchNorm2d(4), ["expand"]),
            ("act", ReLU6(), ["bn"]),
            ("depthwise", Conv2d(4, 4, 3, 1, 1, groups=4, bias=False), ["act"]),
            ("add", Add(), ["depthwise", "act"]),
            ("avg", AvgPool2d(2), ["add"]),
            ("gap", GlobalAvgPool(), ["avg"]),
            ("drop", Dropout(0.5), ["gap"]),
            ("fc", Dense(4, 3), ["drop"]),
        ],
        input_shape=(3, 4, 4),
    )


def one_step(backend_name: str, x: np.ndarray, y: np.ndarray):
    backend = get_backend(backend_name)
    net = Network(graph(), backend, seed=2)
    net.forward(backend.to_device(x), training=True)
    loss = net.loss(backend.to_device(y))
    net.backward()
    gradients = {k: np.array(backend.to_host(v)) for k, v in net.gradients.views.items()}
    state = net.state_dict()
    net.close()
    return loss, gradients, state


@pytest.mark.parametrize("split", [None, (4, 2)], ids=["one-block", "split-bn"])
def test_one_step_on_cudasim_matches_cpu(split):
    """``split-bn``: batch norm's 32 values a channel over 4 blocks of 8, so the layer's declared working
    memory (the partial statistics after save_mean, backward's partial sums) is what the kernels get."""
    from kernels.cuda import LAUNCHES, batchnorm, reset_launches

    previous = batchnorm.use_split(batchnorm.Split(*split)) if split else None
    try:
        reset_launches()
        _one_step_on_cudasim_matches_cpu()
        split_kernels = ("batchnorm_partial_stats_kernel", "batchnorm_backward_apply_kernel")
        assert all(LAUNCHES[k] == (1 if split else 0) for k in split_kernels), LAUNCHES
    finally:
        if previous is not None:
            batchnorm.use_split(previous)


def _one_step_on_cudasim_matches_cpu():
    rng = np.random.default_rng(0)
    x = (3 * rng.standard_normal((2, 3, 4, 4))).astype(np.float32)  # reaches ReLU6's upper kink too
    y = np.array([0, 2], np.int64)
    cpu_loss, cpu_grads, cpu_state = one_step("cpu", x, y)
    sim_loss, sim_grads, sim_state = one_step("cudasim", x, y)
    assert sim_loss == pytest.approx(cpu_loss, rel=1e-5)
    for name, grad in cpu_grads.items():
        assert np.abs(grad).max() > 0, name  # every parameter got a gradient (dropout kept some units)
        np.testing.assert_allclose(sim_grads[name], grad, rtol=1e-4, atol=1e-6, err_msg=name)
    for name in ("bn.running_mean", "bn.running_var"):
        np.testing.assert_allclose(sim_state[name], cpu_state[name], rtol=1e-5, atol=1e-7, err_msg=name)

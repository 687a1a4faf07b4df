"""The CUDA training path under the simulator: one step of a tiny cnn matches the cpu backend.

Runs only in the process started with NUMBA_ENABLE_CUDASIM=1 (tests/run does that).
"""

import numpy as np
import pytest

from engine.data.datasets import synthetic
from engine.optim import make_optimizer
from engine.train import Trainer
from models import build_network

pytestmark = pytest.mark.cudasim


def one_step(backend_name, data, optimizer):
    from engine.backend import get_backend

    backend = get_backend(backend_name)
    net = build_network("cnn", data, backend, seed=3, width=2)
    opt = make_optimizer(optimizer, net, backend, 0.1, momentum=0.9, manager=net.mgr)
    trainer = Trainer(net, opt, data, batch_size=2, steps=1, augment=True, seed=4, prefetch=1, evaluate_at_end=False)
    result = trainer.fit()
    return net.state_dict(), result.final_loss


@pytest.mark.parametrize("optimizer", ["adam"])  # SGD and Adam kernels are compared one by one in tests/kernels
def test_one_cudasim_training_step_matches_cpu(optimizer):
    data = synthetic(num_classes=4, seed=0, train=4, test=2, shape=(3, 8, 8))
    cpu_state, cpu_loss = one_step("cpu", data, optimizer)
    sim_state, sim_loss = one_step("cudasim", data, optimizer)
    assert sim_loss == pytest.approx(cpu_loss, rel=1e-5)
    assert sorted(sim_state) == sorted(cpu_state)
    for name, value in cpu_state.items():
        np.testing.assert_allclose(sim_state[name], value, rtol=1e-4, atol=1e-5, err_msg=name)
    # the step changed the weights (the comparison is not between two untouched initializations)
    untouched = build_network("cnn", data, "cpu", seed=3, width=2).state_dict()
    assert not np.allclose(untouched["conv1.weight"], cpu_state["conv1.weight"])


def test_engine_train_cuda_graph_reaches_the_runner_and_refuses_what_the_stand_in_cannot_replay():
    """--cuda-graph under the simulator runs the stand-in graph (tests/engine/test_cuda_graph_cudasim.py trains
    through it bit for bit); the cnn's Flatten copies outside a launch, so it is refused in one line."""
    from click.testing import CliRunner

    from cli import main

    done = CliRunner().invoke(main, ["train", "--model", "cnn", "--data", "synthetic", "--steps", "1", "--batch-size",
                                     "2", "--backend", "cudasim", "--cuda-graph", "--no-progress", "--prefetch", "0"])
    assert done.exit_code == 1, done.output
    assert "the step cannot be captured as a CUDA graph: Flatten copies outside a kernel launch" in done.output
    assert "Traceback" not in done.output

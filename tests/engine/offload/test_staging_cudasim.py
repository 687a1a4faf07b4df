"""The GPU offload path (device -> pinned buffer -> disk, on a copy stream) under the CUDA simulator.

Runs only in the process started with NUMBA_ENABLE_CUDASIM=1 (tests/run does that). A tiny mlp keeps
the simulated kernels cheap.
"""

import numpy as np
import pytest

from engine.offload import OffloadScheduler
from engine.offload.staging import DeviceStaging
from engine.optim import SGD
from models import build_model

pytestmark = pytest.mark.cudasim


def one_step(window, directory):
    from engine.backend import get_backend

    backend = get_backend("cudasim")
    net = build_model("mlp", num_classes=4, backend=backend, seed=3, input_shape=(3, 4, 4), hidden=8, depth=4)
    optimizer = SGD(net.parameters, net.gradients, backend, lr=0.1, momentum=0.9)
    scheduler = OffloadScheduler(backend, window, directory=str(directory)).attach(net) if window else None
    rng = np.random.default_rng(0)
    x = backend.to_device(rng.standard_normal((2, 3, 4, 4)).astype(np.float32))
    y = backend.to_device(np.array([1, 3], dtype=np.int64))
    try:
        net.forward(x, training=True)
        net.loss(y)
        net.backward()
        optimizer.step()
        return net.state_dict(), scheduler
    finally:
        if scheduler is not None:
            scheduler.close()


def test_cudasim_offload_stages_through_pinned_buffers_and_keeps_the_bits(tmp_path):
    reference, _ = one_step(None, tmp_path)
    weights, scheduler = one_step(1, tmp_path)
    for key in reference:
        assert np.array_equal(reference[key], weights[key]), key
    assert isinstance(scheduler._transfer, DeviceStaging)
    assert sum(s.bytes_written for s in scheduler.stats) > 0
    spans = sum(unit.nbytes for unit in scheduler._plan.offloaded)
    assert scheduler._transfer.staged_bytes == 2 * spans  # every unit went through a pinned buffer, both ways

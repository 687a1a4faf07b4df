"""--offload-params: the optimizer state is on disk (its pages handed back) during forward and backward."""

import numpy as np
import pytest

from engine.backend import get_backend
from engine.offload.params import OptimizerStateOffload, page_interior
from engine.optim import make_optimizer
from models import build_model

MLP = dict(input_shape=(3, 8, 8), hidden=512, depth=3)  # a state block of several pages


def train(optimizer_name, steps, tmp_path, offload, skip_update_at=None):
    backend = get_backend("cpu")
    net = build_model("mlp", num_classes=10, backend=backend, seed=0, **MLP)
    optimizer = make_optimizer(optimizer_name, net, backend, 0.01, momentum=0.9, manager=net.mgr)
    hook = OptimizerStateOffload(optimizer, str(tmp_path), lookahead=2) if offload else None
    seen_during_forward = []

    class Peek:  # what the state's memory holds in the middle of a forward
        def after_forward(self, step, node):
            if step == 2 and optimizer.state is not None:
                if hook is not None:
                    hook._finish()  # let the save (it runs beside the forward) complete
                start, stop = page_interior(optimizer.state.flat.view(np.uint8))
                seen_during_forward.append(bool(np.any(optimizer.state.flat.view(np.uint8)[start:stop])))

    if hook is not None:
        net.hooks.append(hook)
    net.hooks.append(Peek())
    rng = np.random.default_rng(1)
    written = []
    try:
        for step in range(steps):
            x = rng.standard_normal((4, 3, 8, 8)).astype(np.float32)
            y = rng.integers(0, 10, 4).astype(np.int64)
            net.forward(x, training=True)
            net.loss(y)
            net.backward()
            if step != skip_update_at:
                optimizer.step()
            written.append(hook.bytes_written if hook else 0)
    finally:
        if hook is not None:
            hook.close()
    return net.state_dict(), optimizer.state_dict(), seen_during_forward, written, hook


@pytest.mark.parametrize("optimizer_name", ["sgd", "adam"])
def test_same_bits_and_the_state_is_gone_during_the_step(tmp_path, optimizer_name):
    weights, state, seen_plain, _, _ = train(optimizer_name, 3, tmp_path, offload=False)
    weights_off, state_off, seen_offload, written, hook = train(optimizer_name, 3, tmp_path, offload=True)
    for key in weights:
        assert np.array_equal(weights[key], weights_off[key]), key
    for key in state:
        assert np.array_equal(state[key], state_off[key]), key
    assert seen_plain[1:] == [True, True]  # after an update the state is not all zeros...
    assert seen_offload[1:] == [False, False]  # ...but with offload its pages were handed back mid-step
    region = hook.region.nbytes
    assert written == [region, 2 * region, 3 * region]  # written once per step
    assert hook.bytes_read == 3 * region


def test_an_unchanged_state_is_not_written_again(tmp_path):
    *_, written, hook = train("sgd", 3, tmp_path, offload=True, skip_update_at=1)
    region = hook.region.nbytes
    assert written == [region, 2 * region, 2 * region]  # no update after step 1: step 2 writes nothing


def test_offload_params_needs_a_window():
    from engine.offload import OffloadConfig

    with pytest.raises(ValueError, match="--offload-params goes with --offload-n"):
        OffloadConfig.from_options(None, None, None, params=True)
    assert OffloadConfig.from_options("2", None, None, params=True).params

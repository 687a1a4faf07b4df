"""A training step as a captured graph (engine/cuda_graph.py), in the CUDA simulator.

The simulator's graph records the captured step's launches (nothing runs while capturing, as in stream
capture) and replays exactly those launches. Same weights, bit for bit, as the eager step with the
learning rate baked into the launch: so no per-step value is baked into a captured launch, nothing the
step needs happens outside a kernel launch, and the per-step scalars read from device memory give the
baked arguments' bits. A host read, allocation or copy inside the capture raises (``Backend.capturing``).
"""

from __future__ import annotations

import numpy as np
import pytest

from engine.backend import CaptureError, get_backend
from engine.cuda_graph import StepRunner, memory_epoch, residual_graph
from engine.graph import Graph
from engine.layers import Dense
from engine.network import Network
from engine.optim import make_optimizer

pytestmark = pytest.mark.cudasim


IMAGE = 2
"""2×2 images: the same launches as at 4×4 (every conv a tile GEMM, the residual add, batch norm), with a
quarter of the simulated threads in the conv GEMMs; what is tested is what the capture holds, not the shape."""


def _schedule(step):
    return 0.05 / (1 + step)  # a new learning rate every step


def _net(optimizer_name):
    backend = get_backend("cudasim")
    net = Network(residual_graph(image=IMAGE), backend, seed=0)
    kwargs = {"momentum": 0.9} if optimizer_name == "sgd" else {}
    return net, make_optimizer(optimizer_name, net, backend, _schedule, manager=net.mgr, **kwargs)


def _batches(sizes):
    rng = np.random.default_rng(0)
    return [(rng.standard_normal((n, 3, IMAGE, IMAGE)).astype(np.float32), rng.integers(0, 3, n).astype(np.int64))
            for n in sizes]


def _baked(optimizer_name, batches):
    net, opt = _net(optimizer_name)
    losses = []
    try:
        for x, y in batches:
            net.forward(x, training=True)
            losses.append(net.loss(y))
            net.backward()
            opt.step()
        return np.array(net.parameters.flat), losses
    finally:
        net.close()


def test_replayed_graphs_give_the_baked_weights():
    """Batch 2: eager, then captured and replayed; a batch of 3 (eager: its own warm-up) grows the workspaces,
    so batch 2's graph holds stale addresses: it is dropped and the next batch of 2 runs eagerly. Every step
    a new learning rate, read by the replayed update from device memory."""
    batches = _batches([2, 2, 3, 2])
    baked, baked_losses = _baked("sgd", batches)
    net, opt = _net("sgd")
    try:
        runner = StepRunner(net, opt, capture="record", warmup=1)
        losses = []
        for x, y in batches:
            runner.step(x, y)
            losses.append(np.float32(runner.last_loss()))
        np.testing.assert_array_equal(np.array(net.parameters.flat), baked)
        assert losses == [np.float32(v) for v in baked_losses]  # the replayed step's loss too
        assert runner.eager_reason is None and opt.steps_taken == 4
        assert net.node("bn1").layer.num_batches_tracked == 4  # host counters advance on replays too
        assert {k[0]: (s.eager_steps, s.captures, s.replays) for k, s in runner.shapes.items()} == {
            2: (1, 1, 1), 3: (1, 0, 0)}
        assert runner.shapes[(2, 3, IMAGE, IMAGE)].graph is None
        assert runner.shapes[(2, 3, IMAGE, IMAGE)].launches > 10  # every launch of the step, the update included
        with pytest.raises(ValueError, match="labels must lie"):
            runner.step(*_batches([2])[0][:1], np.array([0, 7]))
    finally:
        net.close()


@pytest.mark.parametrize("optimizer_name", ["sgd", "adam"])
def test_update_from_device_scalars_is_the_baked_update_bit_for_bit(optimizer_name):
    from kernels.cuda import optim

    rng = np.random.default_rng(1)
    arrays = [rng.standard_normal(300).astype(np.float32) for _ in range(4)]
    arrays[3] = np.abs(arrays[3])  # Adam's second moment
    baked = [a.copy() for a in arrays]
    device = [a.copy() for a in arrays]
    scalars = np.zeros(optim.SCALARS, np.float32)
    for step in (1, 2, 3):
        lr = _schedule(step)
        scalars[...] = optim.step_scalars(lr, 0.9, 0.999, step)
        if optimizer_name == "sgd":
            optim.sgd_update(baked[0], baked[1], baked[2], lr, 0.9, 1e-4, True)
            optim.sgd_update_from(device[0], device[1], device[2], scalars, 0.9, 1e-4, True)
        else:
            optim.adam_update(*baked, lr, 0.9, 0.999, 1e-8, 1e-4, step)
            optim.adam_update_from(*device, scalars, 0.9, 0.999, 1e-8, 1e-4)
    for a, b in zip(baked, device):
        np.testing.assert_array_equal(a, b)
    before = [a.copy() for a in device]
    for bad in (np.nan, np.inf):  # a step whose loss is not finite: nothing written (engine train's divergence check)
        guard = np.array([bad], np.float32)
        if optimizer_name == "sgd":
            optim.sgd_update_from(device[0], device[1], device[2], scalars, 0.9, 1e-4, True, guard=guard)
        else:
            optim.adam_update_from(*device, scalars, 0.9, 0.999, 1e-8, 1e-4, guard=guard)
        for a, b in zip(before, device):
            np.testing.assert_array_equal(a, b)


def test_a_host_read_inside_the_capture_is_refused():
    backend = get_backend("cudasim")
    backend.capturing = True
    try:
        with pytest.raises(CaptureError, match="copy to the host"):
            backend.to_host(np.zeros(1))
        with pytest.raises(CaptureError, match="allocating"):
            backend.alloc_block(64)
    finally:
        backend.capturing = False


def test_dropout_is_captured_and_every_replay_gets_the_eager_steps_mask():
    """A Dropout on the block's branch (16 mask elements a step): the runner draws each step's mask before
    the step from the network's generator, the graph copies it into the layer's slot. Eager (the layer's own
    host draw) and eager → captured → replayed × 2 end with the same weights and losses bit for bit, and
    every step's mask is the eager step's; the masks differ from step to step, so a replay that kept the
    captured step's mask would train other weights."""
    batches = _batches([2, 2, 2, 2])
    backend = get_backend("cudasim")

    def build():
        net = Network(residual_graph(image=IMAGE, dropout=0.5), backend, seed=0)
        return net, make_optimizer("sgd", net, backend, _schedule, manager=net.mgr, momentum=0.9)

    net, opt = build()
    eager_masks, eager_losses = [], []
    try:
        for x, y in batches:
            net.forward(x, training=True)
            eager_masks.append(np.array(net.node("drop").layer.saved["mask"].array))
            eager_losses.append(np.float32(net.loss(y)))
            net.backward()
            opt.step()
        eager = np.array(net.parameters.flat)
        eager_rng = net.rng.bit_generator.state
    finally:
        net.close()
    assert len({m.tobytes() for m in eager_masks}) == len(batches)

    net, opt = build()
    try:
        runner = StepRunner(net, opt, capture="record", warmup=1)
        assert runner.eager_reason is None
        masks, losses = [], []
        for x, y in batches:
            runner.step(x, y)
            shape = runner.shapes[x.shape]
            masks.append(np.array(shape.masks[net.graph.nodes.index(net.node("drop"))]))
            losses.append(np.float32(runner.last_loss()))
        assert (shape.eager_steps, shape.captures, shape.replays) == (1, 1, 3)
        for step, (mask, expected) in enumerate(zip(masks, eager_masks)):
            np.testing.assert_array_equal(mask, expected, err_msg=f"step {step}")
        np.testing.assert_array_equal(np.array(net.parameters.flat), eager)
        assert losses == eager_losses
        assert net.rng.bit_generator.state == eager_rng  # one draw per step, as eager
        with pytest.raises(RuntimeError, match="outside StepRunner.step"):
            net.forward(batches[0][0], training=True)
        net.end_iteration()
        runner.close()
        assert net.node("drop").layer.mask_fill is None
    finally:
        net.close()


def test_a_network_with_hooks_stays_eager():
    """Offload's scheduler and listeners are hooks: host work between a step's launches, which a replay skips."""

    class Listener:
        pass

    graph = Graph([("fc", Dense(48, 3), ["input"])], input_shape=(48,))
    net = Network(graph, get_backend("cudasim"), seed=0)
    try:
        net.hooks.append(Listener())
        runner = StepRunner(net, make_optimizer("sgd", net, net.backend, 0.1, manager=net.mgr))
        assert runner.eager_reason.startswith("hooks on the network (Listener")
    finally:
        net.hooks.clear()
        net.close()
    assert memory_epoch is not None


# -- engine train's step through the graph (Trainer(cuda_graph=...)) ---------------------------------------------


def _dataset():
    from engine.data.datasets import Dataset

    rng = np.random.default_rng(5)
    x = rng.standard_normal((8, 3, IMAGE, IMAGE)).astype(np.float32)
    return Dataset("tiny", x, rng.integers(0, 3, 8).astype(np.int64), x[:2].copy(), np.array([0, 1]), 3,
                   mean=np.zeros(3, np.float32), std=np.ones(3, np.float32))


def _train(cuda_graph, data, steps=4, schedule=_schedule):
    """engine train's set-up: eager runs update inside backward (the CLI's default), the graph the whole block."""
    from engine.optim import update_in_backward
    from engine.train import Trainer

    backend = get_backend("cudasim")
    net = Network(residual_graph(image=IMAGE, dropout=0.5), backend, seed=0)
    opt = make_optimizer("sgd", net, backend, schedule, momentum=0.9, manager=net.mgr)
    if cuda_graph is None:
        update_in_backward(net, opt)
    losses = []

    class Losses:
        def on_step_end(self, trainer, record):
            losses.append((record.loss, record.correct))

        def __getattr__(self, name):
            return lambda *args: None

    trainer = Trainer(net, opt, data, batch_size=2, steps=steps, shuffle=False, prefetch=0, evaluate_at_end=False,
                      listeners=[Losses()], cuda_graph=cuda_graph)
    return net, opt, trainer, losses


def test_engine_train_through_the_graph_gives_the_eager_weights_bit_for_bit():
    """Four steps with dropout, a new learning rate each step: eager (the layer's own mask draws, the update in
    backward) against one eager step, a capture and three replays; same losses, accuracies and weights."""
    data = _dataset()
    results = {}
    for mode in (None, "record"):
        net, opt, trainer, losses = _train(mode, data)
        try:
            trainer.fit()
            results[mode] = (net.state_dict(), losses, opt.steps_taken, net.rng.bit_generator.state)
            assert net.node("drop").layer.mask_fill is None  # the runner is gone after fit
            assert trainer.runner is None
        finally:
            net.close()
    (eager, eager_losses, eager_steps, eager_rng), (graph, graph_losses, graph_steps, graph_rng) = results.values()
    assert graph_losses == eager_losses and graph_steps == eager_steps == 4 and graph_rng == eager_rng
    assert sorted(graph) == sorted(eager)
    for name, value in eager.items():
        np.testing.assert_array_equal(graph[name], value, err_msg=name)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
def test_a_diverged_replay_keeps_the_last_good_steps_weights():
    """An infinite learning rate at step 2 makes step 3's loss NaN (a replay): the update is skipped on the device,
    as eager skips it on the host, so the weights, the momentum and the step count are those after step 2."""
    from engine.train import TrainingDiverged

    kept = {}
    for mode in (None, "record"):
        net, opt, trainer, losses = _train(mode, _dataset(), steps=5, schedule=lambda s: 0.05 if s < 2 else np.inf)
        try:
            with pytest.raises(TrainingDiverged, match="at step 3"):
                trainer.fit()
            momentum = np.array(opt.state.views["momentum_buffer"]) if opt.state is not None else None
            kept[mode] = (net.state_dict(), momentum, opt.steps_taken, trainer.step, len(losses))
        finally:
            net.close()
    (eager, eager_m, *eager_rest), (graph, graph_m, *graph_rest) = kept.values()
    assert graph_rest == eager_rest == [3, 3, 3]
    for name, value in eager.items():
        np.testing.assert_array_equal(graph[name], value, err_msg=name)
    np.testing.assert_array_equal(graph_m, eager_m)


def test_a_network_the_stand_in_cannot_replay_is_refused():
    from engine.layers import Flatten
    from engine.train import Trainer

    graph = Graph([("flat", Flatten(), ["input"]), ("fc", Dense(3 * IMAGE * IMAGE, 3, bias=False), ["flat"])],
                  input_shape=(3, IMAGE, IMAGE))
    backend = get_backend("cudasim")
    net = Network(graph, backend, seed=0)
    try:
        opt = make_optimizer("sgd", net, backend, 0.1, manager=net.mgr)
        trainer = Trainer(net, opt, _dataset(), batch_size=2, steps=1, prefetch=0, evaluate_at_end=False,
                          cuda_graph="record")
        with pytest.raises(ValueError, match="cannot be captured as a CUDA graph: Flatten copies"):
            trainer.fit()
    finally:
        net.close()


def test_a_capture_that_fails_in_engine_train_goes_on_eagerly_with_the_same_weights(monkeypatch):
    """A capture that fails after running the step's Python (as a GPU's end_capture can): the host counters it
    advanced go back, the step and every later one run eagerly, the weights are eager's, and the reason is kept."""
    import engine.cuda_graph as cuda_graph
    from engine.backend import CaptureError

    def failing_capture(body, stream=None):
        from kernels.cuda import count_only

        with count_only():
            body()
        raise CaptureError("stand-in failure at the end of the capture")

    data = _dataset()
    net, _, trainer, eager_losses = _train(None, data, steps=3)
    try:
        trainer.fit()
        eager, eager_bn = net.state_dict(), net.node("bn1").layer.num_batches_tracked
    finally:
        net.close()
    monkeypatch.setattr(cuda_graph, "record_capture", failing_capture)
    net, _, trainer, losses = _train("record", data, steps=3)
    try:
        trainer.fit()
        assert trainer.cuda_graph_error == "CaptureError: stand-in failure at the end of the capture"
        assert losses == eager_losses and net.node("bn1").layer.num_batches_tracked == eager_bn == 3
        for name, value in eager.items():
            np.testing.assert_array_equal(net.state_dict()[name], value, err_msg=name)
    finally:
        net.close()

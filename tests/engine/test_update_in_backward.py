"""The update in backward (engine.optim.UpdateInBackward): each layer updated right after its backward,
one layer's gradients kept. The same bits as the whole-block update after backward, step after step."""

import json
from types import SimpleNamespace

import numpy as np
import pytest
import safetensors.numpy

from engine.errors import DiskFaultError
from engine.guard import CheckpointWriter, guarded_fit
from engine.memory import ArrayType
from engine.memory.planner import align
from engine.optim import SGD, Adam, update_in_backward
from models import build_model

MODELS = {  # tiny shapes: the bits, not the speed, are under test
    "resnet18": dict(num_classes=4, image_size=8),
    "mlp": dict(num_classes=5, input_shape=(1, 6, 6), hidden=12, depth=2),
}
OPTIMIZERS = {
    "sgd-momentum": lambda net: SGD(net.parameters, net.gradients, net.backend, 0.05, momentum=0.9),
    "sgd-nesterov-decay": lambda net: SGD(net.parameters, net.gradients, net.backend, 0.05, momentum=0.9,
                                          weight_decay=1e-2, nesterov=True),
    "adam-decay": lambda net: Adam(net.parameters, net.gradients, net.backend, 1e-2, weight_decay=1e-2),
}


def build(model, make_optimizer):
    net = build_model(model, backend="cpu", seed=3, **MODELS[model])
    return net, make_optimizer(net)


def batches(net, steps, batch=2):
    rng = np.random.default_rng(7)
    classes = MODELS[net.name]["num_classes"]
    for _ in range(steps):
        yield (rng.standard_normal((batch, *net.graph.input_shape), dtype=np.float32),
               rng.integers(0, classes, batch).astype(np.int64))


def train(net, opt, data):
    for x, y in data:
        net.forward(x, training=True)
        net.loss(y)
        net.backward()
        opt.step()


@pytest.mark.parametrize(("model", "optimizer"), [("mlp", name) for name in OPTIMIZERS] + [("resnet18", "adam-decay")])
def test_the_update_in_backward_gives_the_same_bits_as_the_update_after_it(model, optimizer):
    # every optimizer's per-layer update on the MLP; ResNet-18 (convolutions, batch-norm buffers, gradients that
    # meet at the residual adds before a layer's are complete) with the one that keeps the most state: its
    # SGD cases ran the same hooks and slices as the MLP's, at 3 s each
    whole, whole_opt = build(model, OPTIMIZERS[optimizer])
    fused, fused_opt = build(model, OPTIMIZERS[optimizer])
    hook = update_in_backward(fused, fused_opt)
    assert fused.gradients.nbytes == 0 and fused.mgr.reserved_bytes_by_type().get("GRADIENTS", 0) == 0
    train(whole, whole_opt, batches(whole, 3))
    train(fused, fused_opt, batches(fused, 3))
    largest = max(stop - start for start, stop in fused.parameter_slices().values())
    assert fused.mgr.in_use_bytes_by_type()["GRADIENTS"] == align(4 * largest)  # one layer's at a time, in the arena
    assert fused_opt.steps_taken == whole_opt.steps_taken == 3
    np.testing.assert_array_equal(fused.parameters.flat, whole.parameters.flat)
    np.testing.assert_array_equal(fused.buffers.flat, whole.buffers.flat)
    for name, state in whole_opt.state_dict().items():
        np.testing.assert_array_equal(fused_opt.state_dict()[name], state, err_msg=name)
    hook.remove()  # back to the whole block: the next step is the one pass again, still the same bits
    assert fused.gradient_storage == "whole" and fused.gradients.flat.size == whole.gradients.flat.size
    train(whole, whole_opt, batches(whole, 1))
    train(fused, fused_opt, batches(fused, 1))
    np.testing.assert_array_equal(fused.parameters.flat, whole.parameters.flat)
    np.testing.assert_array_equal(fused.gradients.flat, whole.gradients.flat)


def test_a_step_needs_a_complete_backward_and_a_stopped_one_is_an_update_in_progress():
    net, opt = build("mlp", OPTIMIZERS["sgd-momentum"])
    update_in_backward(net, opt)
    (x, y), = batches(net, 1)
    net.forward(x, training=True)
    net.loss(y)
    with pytest.raises(RuntimeError, match="0 of 3 layers were updated"):
        opt.step()
    assert not opt.update_in_progress

    class Fault:  # a disk fault after the first layer's update (the output layer's backward comes first)
        def after_backward(self, step, node):
            raise OSError(5, "Input/output error")

    net.hooks.append(Fault())
    net.forward(x, training=True)
    net.loss(y)
    with pytest.raises(OSError):
        net.backward()
    assert opt.update_in_progress and opt.steps_taken == 0


def test_a_disk_fault_inside_an_update_in_backward_writes_no_checkpoint(tmp_path):
    written = []

    def fit(in_progress):
        def raise_fault():
            raise OSError(5, "Input/output error")
        return SimpleNamespace(fit=raise_fault, step=4, optimizer=SimpleNamespace(update_in_progress=in_progress))

    writer = CheckpointWriter(str(tmp_path / "c.safetensors"), lambda path, trainer: written.append(trainer.step))
    with pytest.raises(DiskFaultError, match="not written .*after some layers were updated.*--update-after-backward"):
        guarded_fit(fit(True), writer)
    assert written == []
    with pytest.raises(DiskFaultError, match="checkpoint of step 4 was written"):
        guarded_fit(fit(False), writer)
    assert written == [4]


def test_memory_reports_and_the_training_summary_count_one_layers_gradients(tmp_path):
    from tests.test_cli_train import engine

    net = build_model("mlp", backend="cpu", **MODELS["mlp"])
    whole = net.memory_report(4)
    net.set_gradient_storage("per_layer")
    per_layer = net.memory_report(4)
    program = net.program(4)
    slices = net.parameter_slices()
    buffers = [b for b in program.buffers if b.array_type is ArrayType.GRADIENTS]
    assert [(b.owner, b.shape, b.first, b.last) for b in buffers] == [  # each in its node's backward moment only
        (i, (stop - start,), 2 * len(net.graph.nodes) - 1 - i, 2 * len(net.graph.nodes) - 1 - i)
        for i, (start, stop) in sorted(slices.items(), reverse=True)]
    assert (whole.gradient_bytes, per_layer.gradient_bytes) == (whole.parameter_bytes, 0)
    assert per_layer.planned_peak_bytes < whole.planned_peak_bytes
    assert per_layer.as_dict()["gradient_storage"] == "per_layer"
    peaks = {}
    for flag in ([], ["--update-after-backward"]):
        summary = tmp_path / "s.json"
        result = engine("train", "--model", "mlp", "--data", "synthetic", "--num-classes", 5, "--image-size", 8,
                        "--batch-size", 4, "--steps", 2, "--no-progress", "--save", tmp_path / f"c{len(flag)}.st",
                        "--summary-json", summary, *flag)
        assert result.exit_code == 0, result.output
        peaks[bool(flag)] = json.loads(summary.read_text())["phases"]["training"]["peak_bytes"]["GRADIENTS"]
    a, b = (safetensors.numpy.load_file(str(tmp_path / f"c{n}.st")) for n in (0, 1))
    assert all(np.array_equal(a[k], b[k]) for k in a)  # the same weights and momentum either way
    mlp = build_model("mlp", backend="cpu", num_classes=5, input_shape=(3, 8, 8))
    assert peaks == {True: mlp.gradients.nbytes,
                     False: align(4 * max(stop - start for start, stop in mlp.parameter_slices().values()))}


def test_averaging_gradients_refuses_a_network_that_keeps_one_layers_gradients():
    from engine.parallel.allreduce import GradientAllreduce

    net = build_model("mlp", backend="cpu", **MODELS["mlp"])
    net.set_gradient_storage("per_layer")
    with pytest.raises(ValueError, match="--update-after-backward"):
        GradientAllreduce(net, comm=None)

"""Checkpoints: round trips, atomic writes, corrupt files, PyTorch state_dicts, and resume == uninterrupted."""

import os

import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch

from engine.backend import get_backend
from engine.checkpoint import CheckpointError, load_weights, read_checkpoint, restore, save_checkpoint
from engine.data import load_dataset
from engine.optim import make_optimizer
from engine.threads import threads
from engine.train import Trainer
from models import build_model


@pytest.fixture(scope="module")
def backend():
    return get_backend("cpu")


@pytest.fixture(scope="module")
def data():
    return load_dataset("synthetic", num_classes=4)


def small_net(backend, seed=0):
    return build_model("cnn", num_classes=4, backend=backend, seed=seed, width=4)


def trainer_for(net, backend, data, optimizer="adam", opt=None, **kwargs):
    opt = opt or make_optimizer(optimizer, net, backend, 0.01, momentum=0.9, manager=net.mgr)
    options = dict(batch_size=8, steps=4, augment=True, seed=5, evaluate_at_end=False, prefetch=1)
    options.update(kwargs)
    return Trainer(net, opt, data, **options), opt


def test_round_trip_keeps_every_tensor_and_the_step(tmp_path, backend, data):
    net = small_net(backend)
    trainer, opt = trainer_for(net, backend, data)
    with threads(1):
        trainer.fit(until=1)
    path = tmp_path / "c.safetensors"
    save_checkpoint(str(path), net, opt, step=trainer.step, metadata={"seed": 5})
    checkpoint = read_checkpoint(str(path))
    assert checkpoint.step == 1 and checkpoint.json("seed") == 5
    for name, value in net.state_dict().items():
        np.testing.assert_array_equal(checkpoint.tensors[name], value)
    assert set(checkpoint.optimizer_state()) == {"exp_avg", "exp_avg_sq"}
    assert "conv1.weight" in checkpoint.tensors and "bn1.num_batches_tracked" in checkpoint.tensors
    assert os.listdir(tmp_path) == ["c.safetensors"]  # the temporary file was renamed, nothing left behind


def test_a_failed_write_leaves_the_old_checkpoint(tmp_path, backend):
    net = small_net(backend)
    path = tmp_path / "c.safetensors"
    save_checkpoint(str(path), net, step=1)
    before = path.read_bytes()

    class Broken:
        name = "sgd"

        def state_dict(self):
            return {"momentum_buffer": object()}  # not an array: safetensors refuses it mid-write

        def hyperparameters(self):
            return {}

        steps_taken = 0

    with pytest.raises(Exception):  # noqa: B017 (whatever safetensors raises)
        save_checkpoint(str(path), net, Broken(), step=2)
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["c.safetensors"]


def test_truncated_or_corrupt_checkpoints_are_named(tmp_path, backend):
    net = small_net(backend)
    path = tmp_path / "c.safetensors"
    save_checkpoint(str(path), net, step=3)
    raw = path.read_bytes()
    (tmp_path / "short.safetensors").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(CheckpointError, match=r"short\.safetensors: not a readable safetensors file.*truncated"):
        read_checkpoint(str(tmp_path / "short.safetensors"))
    flipped = bytearray(raw)
    flipped[-5] ^= 0xFF  # one byte of tensor data
    (tmp_path / "flipped.safetensors").write_bytes(bytes(flipped))
    with pytest.raises(CheckpointError, match=r"flipped\.safetensors: tensor data does not match its SHA-256"):
        read_checkpoint(str(tmp_path / "flipped.safetensors"))
    with pytest.raises(CheckpointError, match="missing.safetensors: file not found"):
        read_checkpoint(str(tmp_path / "missing.safetensors"))


def test_a_pytorch_state_dict_loads_one_to_one(tmp_path, backend):
    torch = pytest.importorskip("torch")
    source = small_net(backend, seed=1)
    state = {k: torch.from_numpy(np.array(v)) for k, v in source.state_dict().items()}
    path = tmp_path / "torch.safetensors"
    safetensors.torch.save_file(state, str(path))
    target = small_net(backend, seed=2)
    load_weights(str(path), target)
    np.testing.assert_array_equal(target.parameters.flat, source.parameters.flat)
    np.testing.assert_array_equal(target.buffers.flat, source.buffers.flat)
    with pytest.raises(CheckpointError, match="has no training state"):
        restore(read_checkpoint(str(path)), target)


def test_weights_for_another_model_are_refused_with_the_mismatches(tmp_path, backend):
    path = tmp_path / "w.safetensors"
    safetensors.numpy.save_file({"conv1.weight": np.zeros((1, 1, 1, 1), np.float32)}, str(path))
    with pytest.raises(CheckpointError, match=r"w\.safetensors: the weights do not fit a cnn.*11 missing"):
        load_weights(str(path), small_net(backend))


def test_a_checkpoint_of_another_model_is_named_in_one_short_line(tmp_path, backend):
    """A cnn file given to a resnet18: one line naming both models with counts, not every key."""
    path = tmp_path / "cnn.safetensors"
    source = small_net(backend)
    safetensors.numpy.save_file(source.state_dict(), str(path))
    resnet = build_model("resnet18", num_classes=4, backend=backend, image_size=8)
    with pytest.raises(CheckpointError) as caught:
        load_weights(str(path), resnet)
    message = str(caught.value)
    assert "this checkpoint holds a cnn (12 tensors), not a resnet18 (" in message
    assert "give --model cnn" in message
    assert "\n" not in message and len(message) < 500 + len(str(path))


def test_a_checkpoint_with_other_classes_says_the_shapes_differ(tmp_path, backend):
    path = tmp_path / "c.safetensors"
    safetensors.numpy.save_file(build_model("cnn", num_classes=7, backend=backend, width=4).state_dict(), str(path))
    with pytest.raises(CheckpointError, match=r"holds a cnn whose shapes differ.*2 differ in shape.*--num-classes"):
        load_weights(str(path), small_net(backend))


def test_resume_with_another_optimizer_is_refused(tmp_path, backend, data):
    net = small_net(backend)
    trainer, opt = trainer_for(net, backend, data, optimizer="adam")
    path = tmp_path / "c.safetensors"
    save_checkpoint(str(path), net, opt, step=0)
    _, sgd = trainer_for(net, backend, data, optimizer="sgd")
    with pytest.raises(CheckpointError, match="written with optimizer 'adam', resuming with 'sgd'"):
        restore(read_checkpoint(str(path)), net, sgd)


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_resume_gives_the_same_bits_as_an_uninterrupted_run(tmp_path, backend, data, optimizer):
    with threads(1):
        straight = small_net(backend)
        trainer, opt = trainer_for(straight, backend, data, optimizer)
        trainer.fit()
        save_checkpoint(str(tmp_path / "straight.safetensors"), straight, opt, step=trainer.step)

        first = small_net(backend)
        trainer, opt = trainer_for(first, backend, data, optimizer)
        trainer.fit(until=2)
        save_checkpoint(str(tmp_path / "half.safetensors"), first, opt, step=trainer.step)

        resumed = small_net(backend, seed=99)  # different initial weights: all must come from the file
        opt = make_optimizer(optimizer, resumed, backend, 0.01, momentum=0.9, manager=resumed.mgr)
        step = restore(read_checkpoint(str(tmp_path / "half.safetensors")), resumed, opt)
        trainer, _ = trainer_for(resumed, backend, data, opt=opt, start_step=step)
        trainer.fit()
        save_checkpoint(str(tmp_path / "resumed.safetensors"), resumed, opt, step=trainer.step)

    a = safetensors.numpy.load_file(str(tmp_path / "straight.safetensors"))
    b = safetensors.numpy.load_file(str(tmp_path / "resumed.safetensors"))
    assert sorted(a) == sorted(b)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    assert read_checkpoint(str(tmp_path / "resumed.safetensors")).step == 4


def dropout_net(backend, seed):
    from engine.graph import Graph
    from engine.layers import Dense, Dropout, Flatten, ReLU
    from engine.network import Network

    nodes = [
        ("flatten", Flatten(), ["input"]),
        ("fc1", Dense(3 * 32 * 32, 16), ["flatten"]),
        ("relu", ReLU(), ["fc1"]),
        ("drop", Dropout(0.5), ["relu"]),
        ("fc2", Dense(16, 4), ["drop"]),
    ]
    return Network(Graph(nodes, input_shape=(3, 32, 32)), backend, seed=seed)


def test_resume_restores_the_dropout_generator(tmp_path, backend, data):
    with threads(1):
        straight = dropout_net(backend, 0)
        trainer, _ = trainer_for(straight, backend, data, optimizer="sgd")
        trainer.fit()

        first = dropout_net(backend, 0)
        trainer, opt = trainer_for(first, backend, data, optimizer="sgd")
        trainer.fit(until=2)
        save_checkpoint(str(tmp_path / "half.st"), first, opt, step=trainer.step)

        resumed = dropout_net(backend, 7)  # another seed: another dropout generator, until restored
        opt = make_optimizer("sgd", resumed, backend, 0.01, momentum=0.9, manager=resumed.mgr)
        step = restore(read_checkpoint(str(tmp_path / "half.st")), resumed, opt)
        trainer, _ = trainer_for(resumed, backend, data, opt=opt, start_step=step)
        trainer.fit()
    assert resumed.rng.bit_generator.state == straight.rng.bit_generator.state
    np.testing.assert_array_equal(resumed.parameters.flat, straight.parameters.flat)


def test_a_writer_killed_mid_save_leaves_a_temporary_the_next_save_removes(tmp_path, backend):
    """SIGKILL (or the OOM killer) runs no handler: the killed writer's temporary file stays. The next
    save to the same path removes it; a live writer's file and other targets' files are kept."""
    import signal
    import subprocess
    import sys
    import textwrap

    path = tmp_path / "c.safetensors"
    killed = textwrap.dedent(f"""
        import os, signal
        import safetensors.numpy
        from engine.backend import get_backend
        from engine.checkpoint import save_checkpoint
        from models import build_model
        net = build_model("cnn", num_classes=4, backend=get_backend("cpu"), seed=0, width=4)
        def die(tensors, filename, metadata=None):
            open(filename, "wb").write(b"partial")
            os.kill(os.getpid(), signal.SIGKILL)
        safetensors.numpy.save_file = die
        save_checkpoint({str(path)!r}, net, step=1)
    """)
    process = subprocess.run([sys.executable, "-c", killed], capture_output=True, timeout=120)
    assert process.returncode == -signal.SIGKILL
    left = [name for name in os.listdir(tmp_path) if name.endswith(".tmp")]
    assert len(left) == 1 and left[0].startswith(".checkpoint-c.safetensors.")
    live = tmp_path / f".checkpoint-c.safetensors.{os.getpid()}.abc.tmp"  # a writer still running
    other = tmp_path / f".checkpoint-d.safetensors.{left[0].split('.')[3]}.abc.tmp"  # another target's
    live.write_bytes(b"x")
    other.write_bytes(b"x")
    save_checkpoint(str(path), small_net(backend), step=2)
    assert sorted(os.listdir(tmp_path)) == sorted(["c.safetensors", live.name, other.name])
    assert read_checkpoint(str(path)).step == 2

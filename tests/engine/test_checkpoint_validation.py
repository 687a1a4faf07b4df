"""Checkpoints fully verified: metadata inside the hash, every field validated, resume refuses changed
hyper-parameters unless --override names them."""

from __future__ import annotations

import json

import numpy as np
import pytest
import safetensors.numpy

from engine.checkpoint import (
    Checkpoint,
    CheckpointError,
    check_resume,
    read_checkpoint,
    save_checkpoint,
    tensor_digest,
)
from tests.test_cli_train import SMALL, engine
from tests.test_faults import tiny_network


@pytest.fixture
def saved(tmp_path):
    net, opt = tiny_network()
    path = tmp_path / "c.safetensors"
    save_checkpoint(str(path), net, opt, step=3, metadata={"run": {"lr": 0.01, "steps": 8}})
    return path


def rewrite(path, change, rehash: bool):
    """The file with its metadata changed by ``change``; ``rehash`` recomputes the SHA-256 (a crafted file)."""
    checkpoint = read_checkpoint(str(path))
    metadata = dict(checkpoint.metadata)
    change(metadata)
    if rehash:
        metadata["sha256"] = tensor_digest(checkpoint.tensors, metadata)
    safetensors.numpy.save_file(checkpoint.tensors, str(path), metadata=metadata)


def test_metadata_is_inside_the_hash(saved):
    rewrite(saved, lambda m: m.update(step="4"), rehash=False)
    with pytest.raises(CheckpointError, match="does not match its SHA-256"):
        read_checkpoint(str(saved))


@pytest.mark.parametrize(("change", "message"), [
    (lambda m: m.update(step="three"), r"field 'step' is 'three', expected a non-negative integer"),
    (lambda m: m.update(step="-1"), r"field 'step' is '-1'"),
    (lambda m: m.pop("optimizer_steps"), r"field 'optimizer_steps' is None"),
    (lambda m: m.update(rng="{not json"), r"field 'rng' is not valid JSON"),
    (lambda m: m.pop("rng"), r"field 'rng' is missing"),
    (lambda m: m.update(run="[1, 2]"), r"field 'run' is list, expected an object"),
    (lambda m: m.update(optimizer=json.dumps({"lr": 1})), r"'optimizer' has no name"),
])
def test_each_malformed_field_is_named(saved, change, message):
    rewrite(saved, change, rehash=True)
    with pytest.raises(CheckpointError, match=message):
        read_checkpoint(str(saved))


def test_a_bfloat16_state_dict_is_a_clear_error(tmp_path):
    torch = pytest.importorskip("torch")
    import safetensors.torch

    path = tmp_path / "bf16.safetensors"
    safetensors.torch.save_file({"w": torch.zeros(3, dtype=torch.bfloat16)}, str(path))
    with pytest.raises(CheckpointError, match="NumPy cannot read.*float32"):
        read_checkpoint(str(path))


def test_resume_refuses_changed_hyper_parameters_unless_overridden():
    checkpoint = Checkpoint("c.st", {}, {"run": json.dumps({"lr": 0.01, "steps": 8, "seed": 0})})
    with pytest.raises(CheckpointError, match=r"lr was 0.01, now 0.001.*--override lr"):
        check_resume(checkpoint, {"lr": 0.001, "steps": 8, "seed": 0})
    check_resume(checkpoint, {"lr": 0.001, "steps": 8, "seed": 0}, overrides=("lr",))
    with pytest.raises(CheckpointError, match="unknown option"):
        check_resume(checkpoint, {"lr": 0.01, "steps": 8, "seed": 0}, overrides=("learning_rate",))


def test_resume_with_another_lr_through_the_command_line(tmp_path):
    path = tmp_path / "run.safetensors"
    assert engine(*SMALL, "--steps", 2, "--save", path).exit_code == 0
    refused = engine(*SMALL, "--steps", 2, "--lr", 0.5, "--resume", path)
    assert refused.exit_code == 1 and "lr was 0.01, now 0.5" in refused.output and "--override lr" in refused.output
    accepted = engine(*SMALL, "--steps", 3, "--lr", 0.5, "--resume", path, "--save", path, "--override", "lr,steps")
    assert accepted.exit_code == 0, accepted.output
    assert read_checkpoint(str(path)).json("run")["lr"] == 0.5
    assert np.isfinite(read_checkpoint(str(path)).tensors[next(iter(read_checkpoint(str(path)).tensors))]).all()


def test_a_cosine_run_resumed_with_another_length_is_refused(tmp_path):
    path = tmp_path / "run.safetensors"
    assert engine(*SMALL, "--steps", 2, "--lr-schedule", "cosine", "--save", path).exit_code == 0
    refused = engine(*SMALL, "--steps", 4, "--lr-schedule", "cosine", "--resume", path)
    assert refused.exit_code == 1 and "steps was 2, now 4" in refused.output

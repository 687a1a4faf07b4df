"""Checkpoints: safetensors files that hold everything a run needs to continue bit for bit.

A checkpoint holds
- the network's parameters and buffers under torchvision's names (so it doubles as a PyTorch
  state_dict, and a PyTorch state_dict saved as safetensors loads as initial weights);
- the optimizer's state arrays as ``optimizer.<name>`` (momentum buffer, Adam's moments);
- as metadata strings: the step count, the optimizer and its hyper-parameters, the data seed (the
  shuffle and augmentation are functions of (seed, epoch, batch), see ``engine.data.batches``), the
  state of every random generator inside the network (dropout) as JSON, and a SHA-256 of the tensor
  bytes *and every other metadata field*, so a corrupt file is caught, not just a truncated one.
  (Format 1 hashed only the tensors: a changed step count or a malformed JSON field went unnoticed and
  ended in a traceback; format-1 files are still read, with their tensor-only hash.) Every field is
  validated on read, each with its own message.

It is written to a temporary file in the same directory, flushed to disk, then renamed over the
target (``os.replace`` is atomic), so a crash mid-write never leaves half a checkpoint. The
temporary file's name carries the target's name and the writer's PID
(``.checkpoint-<name>.<pid>.<random>.tmp``): a run killed while writing (SIGKILL, an OOM kill: no
handler runs) leaves one behind, as large as the checkpoint, and the next save to the same target
removes those whose writer is gone (``remove_stale_temporaries``); a live writer's file is kept.
Safetensors never runs code on load, unlike pickles.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine.errors import UserError

FORMAT = "engine-checkpoint/2"
FORMAT_1 = "engine-checkpoint/1"  # tensors-only hash; still read
OPTIMIZER_PREFIX = "optimizer."


class CheckpointError(UserError, ValueError):
    """A checkpoint cannot be read or does not fit: the message names the file and the problem."""


@dataclass
class Checkpoint:
    """The tensors and metadata of one file, split into model, optimizer and bookkeeping."""

    path: str
    tensors: dict[str, np.ndarray]
    metadata: dict[str, str] = field(default_factory=dict)
    redrawn: list[str] = field(default_factory=list)  # keys left as drawn (load_weights' fresh classifier)

    @property
    def is_training_checkpoint(self) -> bool:
        """True for files written by ``save_checkpoint`` (not plain weights from PyTorch)."""
        return self.metadata.get("format") in (FORMAT, FORMAT_1)

    @property
    def step(self) -> int:
        return int(self.metadata.get("step", 0))

    def model_state(self) -> dict[str, np.ndarray]:
        return {k: v for k, v in self.tensors.items() if not k.startswith(OPTIMIZER_PREFIX)}

    def optimizer_state(self) -> dict[str, np.ndarray]:
        n = len(OPTIMIZER_PREFIX)
        return {k[n:]: v for k, v in self.tensors.items() if k.startswith(OPTIMIZER_PREFIX)}

    def json(self, key: str) -> Any:
        return json.loads(self.metadata[key]) if key in self.metadata else None


def tensor_digest(tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> str:
    """SHA-256 over names, dtypes, shapes and bytes, in name order, then the metadata (but its ``sha256``)."""
    digest = hashlib.sha256()
    if metadata is not None:
        fields = {k: v for k, v in metadata.items() if k != "sha256"}
        digest.update(json.dumps(fields, sort_keys=True).encode())
    for name in sorted(tensors):
        array = np.ascontiguousarray(tensors[name])
        digest.update(f"{name}|{array.dtype.str}|{array.shape}|".encode())
        digest.update(memoryview(array).cast("B"))
    return digest.hexdigest()


def network_generators(net: Any) -> dict[str, np.random.Generator]:
    """Every NumPy generator the network draws from during training (dropout masks), by name."""
    found: dict[str, np.random.Generator] = {}
    if isinstance(getattr(net, "rng", None), np.random.Generator):
        found["net"] = net.rng
    graph = getattr(net, "graph", None)
    for node in getattr(graph, "nodes", []) or []:
        rng = getattr(getattr(node, "layer", None), "rng", None)
        if isinstance(rng, np.random.Generator) and all(rng is not seen for seen in found.values()):
            found[node.name] = rng  # a layer with a generator of its own (most share net.rng)
    return found


def checkpoint_nbytes(net: Any, optimizer: Any = None) -> int:
    """The tensor bytes a checkpoint of ``net`` (and ``optimizer``) will hold: the free space it needs
    (the safetensors header adds a few KiB on top, and the temporary file exists beside the old one)."""
    total = sum(int(np.asarray(a).nbytes) for a in net.state_dict().values())
    if optimizer is not None:
        total += sum(int(np.asarray(a).nbytes) for a in optimizer.state_dict().values())
    return total + 64 * 1024


def non_finite_tensors(tensors: dict[str, np.ndarray]) -> list[str]:
    """Names of floating-point tensors holding NaN or infinity."""
    return [name for name in sorted(tensors)
            if tensors[name].dtype.kind == "f" and not np.isfinite(tensors[name]).all()]


def save_checkpoint(
    path: str, net: Any, optimizer: Any = None, step: int = 0, metadata: dict[str, Any] | None = None
) -> None:
    """Write ``net`` (and ``optimizer``) at ``step`` to ``path`` atomically; ``metadata`` values become JSON.

    Refuses (CheckpointError) weights holding NaN or infinity: a diverged run must never replace a good
    checkpoint. A failed write (no space, I/O error) removes its temporary file and leaves ``path`` as it
    was.
    """
    from safetensors.numpy import save_file

    tensors = {name: np.ascontiguousarray(array) for name, array in net.state_dict().items()}
    bad = non_finite_tensors(tensors)
    if bad:
        raise CheckpointError(f"{path}: not written: {bad[0]} holds NaN or infinite values "
                              f"({len(bad)} tensor(s)); the previous file, if any, is untouched")
    meta: dict[str, str] = {"format": FORMAT, "step": str(int(step))}
    if optimizer is not None:
        for name, array in optimizer.state_dict().items():
            tensors[OPTIMIZER_PREFIX + name] = array
        meta["optimizer"] = json.dumps({"name": optimizer.name, **optimizer.hyperparameters()})
        meta["optimizer_steps"] = str(optimizer.steps_taken)
    generators = {name: rng.bit_generator.state for name, rng in network_generators(net).items()}
    meta["rng"] = json.dumps(generators, default=int)
    for key, value in (metadata or {}).items():
        meta[key] = json.dumps(value)
    meta["sha256"] = tensor_digest(tensors, meta)

    directory = os.path.dirname(os.path.abspath(path))
    temporary = None
    try:
        os.makedirs(directory, exist_ok=True)
        remove_stale_temporaries(path)
        fd, temporary = tempfile.mkstemp(prefix=f"{_temporary_prefix(path)}{os.getpid()}.", suffix=".tmp",
                                         dir=directory)
        os.close(fd)
        save_file(tensors, temporary, metadata=meta)
        with open(temporary, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException as exc:
        if temporary is not None and os.path.exists(temporary):
            os.unlink(temporary)
        if isinstance(exc, Exception) and not isinstance(exc, UserError):
            # safetensors reports a full disk as its own error type: any failure here is the disk's or the path's
            raise CheckpointError(f"{path}: cannot write the checkpoint ({_reason(exc)}); the previous file, if "
                                  "any, is untouched; free some space or choose another --save path") from None
        raise


def _temporary_prefix(path: str) -> str:
    return f".checkpoint-{os.path.basename(path)}."


def remove_stale_temporaries(path: str) -> list[str]:
    """Delete the temporary files a killed writer of ``path`` left beside it; returns their paths.

    Only files named ``.checkpoint-<name>.<pid>.<random>.tmp`` for this very target, owned by this
    user, whose PID is no longer running are removed: another run writing the same path right now
    keeps its file.
    """
    directory = os.path.dirname(os.path.abspath(path))
    prefix = _temporary_prefix(path)
    removed = []
    try:
        entries = os.listdir(directory)
    except OSError:
        return removed
    for entry in entries:
        if not (entry.startswith(prefix) and entry.endswith(".tmp")):
            continue
        pid_text = entry[len(prefix):].split(".", 1)[0]
        if not pid_text.isdigit() or _running(int(pid_text)):
            continue
        full = os.path.join(directory, entry)
        try:
            if os.lstat(full).st_uid == os.getuid():
                os.unlink(full)
                removed.append(full)
        except OSError:
            pass
    return removed


class SaveClaim:
    """One running ``engine train`` per ``--save`` path: an exclusive ``flock`` on ``.<name>.lock`` beside it.

    Two runs given the same ``--save`` both reported success while the file held one of them (issue 31);
    now the second is refused before its first step, naming the first's PID. ``flock`` is released by
    the kernel when a process dies however it dies, so a lock file a SIGKILLed run left behind is taken
    over by the next run, which removes it at its end: nothing is left behind by a run that ends.
    """

    def __init__(self, path: str):
        self.path = path
        self.lock_path = os.path.join(os.path.dirname(os.path.abspath(path)), f".{os.path.basename(path)}.lock")
        self._fd: int | None = None

    def acquire(self) -> SaveClaim:
        """Claim the path, or a CheckpointError naming the run that holds it. A missing directory claims
        nothing: the check of the output paths refuses it with its own words."""
        import fcntl

        if not os.path.isdir(os.path.dirname(self.lock_path)):
            return self
        try:
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise CheckpointError(f"--save {self.path}: cannot create {self.lock_path} ({_reason(exc)}); "
                                  "choose a writable directory") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise CheckpointError(f"--save {self.path}: another engine train (pid {owner}) is writing this "
                                  "checkpoint; give each run its own --save file") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.unlink(self.lock_path)  # while still holding it: a run that opens it now gets a new file
        except OSError:
            pass
        os.close(fd)

    def __enter__(self) -> SaveClaim:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def _reason(exc: BaseException) -> str:
    return exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)


def read_checkpoint(path: str) -> Checkpoint:
    """Read any safetensors file; for engine checkpoints, verify the SHA-256 of the tensors."""
    from safetensors import SafetensorError, safe_open

    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: {_not_a_file(path)}; expected a safetensors checkpoint or state_dict")
    try:
        with safe_open(path, framework="np") as f:
            metadata = dict(f.metadata() or {})
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except TypeError as exc:  # a dtype NumPy has no type for (bfloat16)
        raise CheckpointError(
            f"{path}: holds tensors NumPy cannot read ({exc}); save the state_dict as float32, e.g. "
            "{k: v.float() for k, v in state_dict.items()}"
        ) from None
    except (SafetensorError, OSError, ValueError, OverflowError) as exc:
        raise CheckpointError(
            f"{path}: not a readable safetensors file ({exc}); the file is truncated or corrupt, or not a checkpoint"
        ) from None
    checkpoint = Checkpoint(path, tensors, metadata)
    expected = metadata.get("sha256")
    covers_metadata = metadata.get("format") == FORMAT
    if expected is not None and tensor_digest(tensors, metadata if covers_metadata else None) != expected:
        changed = " (or its metadata was changed)" if covers_metadata else ""
        raise CheckpointError(f"{path}: tensor data does not match its SHA-256{changed}: the file is corrupt")
    if checkpoint.is_training_checkpoint:
        validate_metadata(checkpoint)
    bad = non_finite_tensors(tensors)
    if bad:  # checked here, not at the end: a run from NaN weights trained every step, then refused to save
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise CheckpointError(f"{path}: {bad[0]}{more} holds NaN or infinite values; nothing can be trained from "
                              "it: use an earlier checkpoint, or start without it")
    return checkpoint


def _not_a_file(path: str) -> str:
    """Why ``path`` is not a regular file, in words ("file not found" only when nothing is there)."""
    import stat

    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        if os.path.islink(path):
            return f"a broken symbolic link (to {os.readlink(path)!r})"
        return "file not found"
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    kinds = [(stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket")]
    kind = next((name for test, name in kinds if test(mode)), "not a regular file")
    via = f" (through the symbolic link to {os.path.realpath(path)!r})" if os.path.islink(path) else ""
    return f"is {kind}{via}, not a file"


_FIELDS: dict[str, type] = {"optimizer": dict, "rng": dict, "run": dict}


def validate_metadata(checkpoint: Checkpoint) -> None:
    """Each field of a training checkpoint parses to what ``restore`` expects, or a CheckpointError naming it."""
    meta, path = checkpoint.metadata, checkpoint.path
    for key in ("step", "optimizer_steps"):
        if key == "optimizer_steps" and key not in meta and "optimizer" not in meta:
            continue
        text = meta.get(key)
        if text is None or not text.isdigit():
            raise CheckpointError(f"{path}: metadata field {key!r} is {text!r}, expected a non-negative integer; "
                                  "the file is corrupt or was not written by engine train")
    for key, kind in _FIELDS.items():
        if key not in meta:
            if key == "rng":
                raise CheckpointError(f"{path}: metadata field 'rng' is missing; the file is corrupt")
            continue
        try:
            value = json.loads(meta[key])
        except ValueError:
            raise CheckpointError(f"{path}: metadata field {key!r} is not valid JSON; the file is corrupt") from None
        if not isinstance(value, kind):
            raise CheckpointError(f"{path}: metadata field {key!r} is {type(value).__name__}, expected an object")
    optimizer = checkpoint.json("optimizer")
    if optimizer is not None and not isinstance(optimizer.get("name"), str):
        raise CheckpointError(f"{path}: metadata field 'optimizer' has no name; the file is corrupt")


def check_resume(checkpoint: Checkpoint, run: dict[str, Any], overrides: tuple[str, ...] = (),
                 known: tuple[str, ...] = ()) -> None:
    """Refuse to resume with options other than those the checkpoint was written with.

    ``run`` holds this run's options (model, data, batch size, seed, optimizer, learning rate,
    schedule, momentum, weight decay, total steps, ...); a key saved with another value is an error
    unless ``overrides`` names it. Keys an older checkpoint lacks are not compared. ``known``: names
    ``--override`` may give beside the keys of ``run``.
    """
    saved = checkpoint.json("run") or {}
    names = set(run) | set(known)
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise CheckpointError(f"--override: unknown option(s) {', '.join(unknown)}; choose from "
                              f"{', '.join(sorted(names))}")
    different = {k: (saved[k], v) for k, v in run.items() if k in saved and saved[k] != v and k not in overrides}
    if different:
        raise CheckpointError(
            f"{checkpoint.path}: written by a different run: "
            + ", ".join(f"{k} was {old!r}, now {new!r}" for k, (old, new) in different.items())
            + "; resume with the same options, or name the changed ones in --override "
            + ",".join(different)
        )


def load_weights(path: str, net: Any, fresh_classifier: bool = False) -> Checkpoint:
    """Initial weights from a checkpoint or a PyTorch state_dict saved as safetensors, strictly.

    ``fresh_classifier`` (fine-tuning with another ``--num-classes``): when the file's classifier (the
    last layer with parameters: ``fc`` in ResNet-18, ``classifier.1`` in MobileNetV2) has another
    shape than the network's, the network keeps its freshly drawn one and every other tensor must
    load. ``Checkpoint.redrawn`` lists the keys that were left as drawn.
    """
    checkpoint = read_checkpoint(path)
    state = checkpoint.model_state()
    if fresh_classifier:
        keys = classifier_keys(net)
        shapes = {key: tuple(view.shape) for key, view in net.parameters.views.items() if key in keys}
        if any(key in state and tuple(state[key].shape) != shape for key, shape in shapes.items()):
            state = {k: v for k, v in state.items() if k not in keys}
            checkpoint.redrawn = sorted(keys)
    try:
        result = net.load_state_dict(state, strict=not checkpoint.redrawn)
        missing = [k for k in result.missing_keys if k not in checkpoint.redrawn]
        if missing or result.unexpected_keys:
            raise ValueError(f"missing keys: {', '.join(missing) or 'none'}; "
                             f"unexpected keys: {', '.join(result.unexpected_keys) or 'none'}")
    except (KeyError, ValueError):
        raise CheckpointError(mismatch_message(checkpoint, net, exclude=checkpoint.redrawn)) from None
    return checkpoint


def _expected_shapes(graph: Any) -> dict[str, tuple[int, ...]]:
    """Every tensor name a network of ``graph`` loads, with its shape (num_batches_tracked aside)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for node in graph.nodes:
        for spec in (*node.layer.parameter_specs(), *node.layer.buffer_specs()):
            shapes[node.layer.tensor_key(node.name, spec.name)] = tuple(spec.shape)
    return shapes


def _counted(state: dict[str, Any]) -> set[str]:
    return {k for k in state if not k.endswith(".num_batches_tracked")}


_MODEL_NAMES: Callable[[], dict[str, set[str]]] | None = None


def register_models(names: Callable[[], dict[str, set[str]]]) -> None:
    """How to list every known model's tensor names (``models`` registers itself on import): the engine
    depends on no model, and a mismatch message can still say which model a file holds."""
    global _MODEL_NAMES
    _MODEL_NAMES = names


def guess_model(checkpoint: Checkpoint) -> str | None:
    """Which model a file's tensors are (the run's metadata, else the model whose names match best).

    Names decide, not shapes: a resnet18 trained for 100 classes is still a resnet18. A model counts
    when at least 90% of the names in the file and in the model agree (Jaccard index).
    """
    run = checkpoint.json("run") if checkpoint.is_training_checkpoint else None
    if isinstance(run, dict) and run.get("model"):
        return str(run["model"])
    if _MODEL_NAMES is None:  # nothing registered (the engine never imports the models itself)
        return None
    names = _counted(checkpoint.model_state())
    best, best_score = None, 0.0
    for model, expected in _MODEL_NAMES().items():
        score = len(names & expected) / max(len(names | expected), 1)
        if score > best_score:
            best, best_score = model, score
    return best if best_score >= 0.9 else None


def mismatch_message(checkpoint: Checkpoint, net: Any, exclude: list[str] | None = None) -> str:
    """One line when a file's weights do not fit ``net``: what the file seems to hold, how many tensors
    differ, the first few (a strict load lists every key: 3,000 characters for a cnn file given to a
    resnet18)."""
    state = checkpoint.model_state()
    expected = {k: v for k, v in _expected_shapes(net.graph).items() if k not in (exclude or ())}
    names = _counted(state) - set(exclude or ())
    missing = [k for k in expected if k not in names]
    unexpected = [k for k in state if k in names and k not in expected]
    reshaped = [f"{k}: expected {expected[k]}, got {tuple(np.shape(state[k]))}"
                for k in expected if k in names and tuple(np.shape(state[k])) != expected[k]]
    model = getattr(net, "name", "model")
    held = guess_model(checkpoint)
    if held is not None and held != model:
        head = f"this checkpoint holds a {held} ({len(names)} tensors), not a {model} ({len(expected)} tensors)"
        advice = f"give --model {held}, or a file saved from a {model}"
    elif held == model and reshaped and not missing and not unexpected:
        head = f"this checkpoint holds a {model} whose shapes differ from this one"
        advice = "give the same --num-classes (and --data) it was trained with"
    else:
        head = f"the weights do not fit a {model} ({len(names)} tensors in the file, {len(expected)} in the model)"
        advice = f"give a file saved from a {model}"
    parts = []
    for label, keys in (("missing", missing), ("unexpected", unexpected), ("differ in shape", reshaped)):
        if keys:
            first = ", ".join(keys[:3]) + (", …" if len(keys) > 3 else "")
            parts.append(f"{len(keys)} {label} ({first})")
    return f"{checkpoint.path}: {head}: {'; '.join(parts)}; {advice}"


def classifier_keys(net: Any) -> list[str]:
    """The parameter names of the network's last layer with parameters (its classifier)."""
    for node in reversed(net.graph.nodes):
        specs = node.layer.parameter_specs()
        if specs:
            return [node.layer.tensor_key(node.name, spec.name) for spec in specs]
    return []


def restore(checkpoint: Checkpoint, net: Any, optimizer: Any = None) -> int:
    """Put the network, the optimizer and the network's generators back as saved; returns the step."""
    if not checkpoint.is_training_checkpoint:
        raise CheckpointError(
            f"{checkpoint.path}: has no training state (it is plain weights); use --weights to start from it"
        )
    try:
        net.load_state_dict(checkpoint.model_state(), strict=True)
    except (KeyError, ValueError):
        raise CheckpointError(mismatch_message(checkpoint, net)) from None
    if optimizer is not None:
        saved = checkpoint.json("optimizer") or {}
        if saved.get("name") != optimizer.name:
            raise CheckpointError(
                f"{checkpoint.path}: written with optimizer {saved.get('name')!r}, resuming with {optimizer.name!r}; "
                "resume with the same --optimizer"
            )
        try:
            optimizer.load_state_dict(checkpoint.optimizer_state(), int(checkpoint.metadata["optimizer_steps"]))
        except ValueError as exc:
            raise CheckpointError(f"{checkpoint.path}: {exc}") from None
    saved_generators = checkpoint.json("rng") or {}
    for name, rng in network_generators(net).items():
        if name not in saved_generators:
            raise CheckpointError(f"{checkpoint.path}: no saved state for random generator {name!r}")
        rng.bit_generator.state = saved_generators[name]
    return checkpoint.step

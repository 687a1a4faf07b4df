"""Data sets: read a training and a test split from disk (or make one), checked, in compact form.

Images stay in the form they arrive in (uint8 for CIFAR, MNIST and digits; float32 for ``npz`` and
``synthetic``) and are normalized batch by batch as they are copied into the INPUT workspace
(``engine.data.batches``): CIFAR-10 held as float32 would take four times the memory.

Every model takes 3-channel input. Grayscale sets (MNIST, digits) keep one stored channel that the
batch filler broadcasts to three; MNIST's 28×28 images are padded to 32×32 with two pixels of
background on each side (LeNet's recipe), digits' 8×8 images are resized to 32×32 bilinearly.

Specs: ``synthetic``, ``digits``, ``cifar10:DIR``, ``cifar100:DIR``, ``mnist:DIR``, ``npz:FILE``,
``imagefolder:DIR`` (files decoded batch by batch, see ``engine.data.imagefolder``).
"""

from __future__ import annotations

import gzip
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

DATA_SPECS = ("synthetic", "digits", "cifar10:DIR", "cifar100:DIR", "mnist:DIR", "npz:FILE", "imagefolder:DIR")
SPLIT_SEED = 0  # the fixed permutation that separates train from test where a set has no test split
TEST_FRACTION = 0.2


class DataError(ValueError):
    """A data set cannot be read: the message names the file and what was expected."""


@dataclass
class Dataset:
    """Both splits of a data set plus the per-channel statistics of the training split.

    ``x_*`` are N×C×H×W in stored units (C may be 1 for grayscale; ``channels`` is what the model
    sees), ``y_*`` int64 labels in [0, num_classes). ``mean``/``std`` are per stored channel,
    computed on the training split only, so the test split never leaks into training.
    """

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    channels: int = 3
    mean: np.ndarray | None = None
    std: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.mean is None or self.std is None:
            self.mean, self.std = channel_statistics(self.x_train)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """(C, H, W) of one normalized image as the model receives it."""
        return (self.channels, int(self.x_train.shape[2]), int(self.x_train.shape[3]))

    def batch_source(self, split: str, batch_size: int, *, shuffle: bool = True, augment: bool = False,
                     seed: int = 0, drop_last: bool = True) -> Any:
        """The BatchSource of ``split`` ("train" or "test"); image folders override it to decode files."""
        from engine.data.batches import BatchSource

        x, y = (self.x_train, self.y_train) if split == "train" else (self.x_test, self.y_test)
        return BatchSource(x, y, self.mean, self.std, batch_size, self.channels, shuffle=shuffle, augment=augment,
                           seed=seed, drop_last=drop_last)

    def describe(self) -> str:
        c, h, w = self.image_shape
        return (
            f"{self.name}: {len(self.y_train)} train / {len(self.y_test)} test images, "
            f"{c}×{h}×{w}, {self.num_classes} classes"
        )


def channel_statistics(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel mean and standard deviation (float32), accumulated in float64 one channel at a time."""
    mean = np.empty(x.shape[1], dtype=np.float64)
    std = np.empty(x.shape[1], dtype=np.float64)
    for c in range(x.shape[1]):
        plane = x[:, c].astype(np.float64)
        mean[c] = plane.mean()
        std[c] = plane.std()
    std[std == 0] = 1.0  # a constant channel is left as it is instead of divided by zero
    return mean.astype(np.float32), std.astype(np.float32)


def load_dataset(spec: str, num_classes: int | None = None, seed: int = 0, image_size: int | None = None) -> Dataset:
    """The data set a ``--data`` spec names; ``num_classes`` checks (or, for synthetic, sets) the label count;
    ``image_size`` is the crop of ``imagefolder`` data (default 224) and the side of ``synthetic`` images."""
    kind, _, location = spec.partition(":")
    if image_size is not None and kind not in ("imagefolder", "synthetic"):
        raise DataError(f"--image-size applies to imagefolder and synthetic data; {kind} images keep their size")
    if kind == "imagefolder":
        from engine.data.imagefolder import DEFAULT_IMAGE_SIZE, imagefolder

        if not location:
            raise DataError("--data imagefolder needs a location: imagefolder:DIR (one subfolder per class)")
        data: Dataset = imagefolder(location, image_size or DEFAULT_IMAGE_SIZE)
    elif kind == "synthetic" and image_size:  # large images: fewer of them (96 + 32 at 224×224 is 77 MB)
        many = image_size <= 64
        data = synthetic(num_classes or 10, seed=seed, train=512 if many else 96, test=128 if many else 32,
                         shape=(3, image_size, image_size))
    elif kind == "synthetic":
        data = synthetic(num_classes or 10, seed=seed)
    elif kind == "digits":
        data = digits()
    elif kind in ("cifar10", "cifar100", "mnist", "npz"):
        if not location:
            raise DataError(f"--data {kind} needs a location: {kind}:{'FILE' if kind == 'npz' else 'DIR'}")
        data = {"cifar10": cifar10, "cifar100": cifar100, "mnist": mnist, "npz": npz}[kind](location)
    else:
        raise DataError(f"unknown data set {spec!r}: choose one of {', '.join(DATA_SPECS)}")
    if num_classes is not None and kind != "synthetic":
        largest = int(max(data.y_train.max(), data.y_test.max()))
        if largest >= num_classes:
            raise DataError(f"{data.name} has labels up to {largest}, but --num-classes is {num_classes}")
        data.num_classes = num_classes
    return data


# -- synthetic --------------------------------------------------------------------------------------


def synthetic(
    num_classes: int = 10, seed: int = 0, train: int = 512, test: int = 128, shape: tuple[int, int, int] = (3, 32, 32)
) -> Dataset:
    """Seeded random images: one random pattern per class plus noise, so a network can learn it."""
    rng = np.random.default_rng([seed, 7])
    patterns = rng.standard_normal((num_classes, *shape), dtype=np.float32)

    def split(n: int) -> tuple[np.ndarray, np.ndarray]:
        y = rng.integers(0, num_classes, size=n).astype(np.int64)
        x = patterns[y] + 2.0 * rng.standard_normal((n, *shape), dtype=np.float32)
        return x.astype(np.float32), y

    x_train, y_train = split(train)
    x_test, y_test = split(test)
    return Dataset("synthetic", x_train, y_train, x_test, y_test, num_classes)


# -- digits (ships with scikit-learn) ---------------------------------------------------------------


def bilinear_matrix(size_in: int, size_out: int) -> np.ndarray:
    """The size_out×size_in matrix of 1-D bilinear interpolation (half-pixel centres, as PyTorch's
    ``align_corners=False``); resizing an image is ``M @ image @ M.T``."""
    centres = (np.arange(size_out) + 0.5) * size_in / size_out - 0.5
    centres = np.clip(centres, 0, size_in - 1)
    low = np.floor(centres).astype(int)
    high = np.minimum(low + 1, size_in - 1)
    frac = centres - low
    m = np.zeros((size_out, size_in))
    m[np.arange(size_out), low] += 1 - frac
    m[np.arange(size_out), high] += frac
    return m


def split_off_test(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A fixed split: shuffle once with SPLIT_SEED, the last TEST_FRACTION is the test set."""
    order = np.random.default_rng(SPLIT_SEED).permutation(len(y))
    n_test = max(1, int(round(len(y) * TEST_FRACTION)))
    train, test = order[:-n_test], order[-n_test:]
    return x[train], y[train], x[test], y[test]


def digits() -> Dataset:
    """scikit-learn's 1,797 handwritten digits, 8×8 → 32×32 (bilinear), one channel shown as three."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = bunch.images.astype(np.float64) * (255.0 / 16.0)  # 0..16 → 0..255, like the other sets
    m = bilinear_matrix(8, 32)
    resized = np.einsum("oh,nhw,pw->nop", m, images, m)
    x = np.clip(np.rint(resized), 0, 255).astype(np.uint8)[:, None]  # N×1×32×32
    x_train, y_train, x_test, y_test = split_off_test(x, bunch.target.astype(np.int64))
    return Dataset("digits", x_train, y_train, x_test, y_test, num_classes=10)


# -- CIFAR binary format ----------------------------------------------------------------------------


def _find_dir(location: str, subdir: str, first_file: str) -> str:
    """The directory holding ``first_file``: DIR itself or the archive's DIR/subdir."""
    if not os.path.isdir(location):
        raise DataError(f"data directory {location!r} does not exist")
    for candidate in (location, os.path.join(location, subdir)):
        if os.path.exists(os.path.join(candidate, first_file)):
            return candidate
    return location


def _read_records(path: str, label_bytes: int, what: str) -> tuple[np.ndarray, np.ndarray]:
    """CIFAR records: ``label_bytes`` label bytes then 3,072 pixel bytes (R, G, B planes of 32×32)."""
    record = label_bytes + 3 * 32 * 32
    if not os.path.isfile(path):
        raise DataError(f"{path}: file not found; expected {what}")
    raw = np.fromfile(path, dtype=np.uint8)
    if raw.size == 0 or raw.size % record:
        raise DataError(
            f"{path}: {raw.size} bytes is not a whole number of {record}-byte records; expected {what} "
            f"({label_bytes} label byte(s) + 3072 pixel bytes per image). Is the file truncated?"
        )
    rows = raw.reshape(-1, record)
    labels = rows[:, label_bytes - 1].astype(np.int64)  # CIFAR-100: coarse then fine; we use fine
    images = rows[:, label_bytes:].reshape(-1, 3, 32, 32)
    return np.ascontiguousarray(images), labels


def cifar10(location: str) -> Dataset:
    """CIFAR-10's binary version: data_batch_1..5.bin and test_batch.bin."""
    folder = _find_dir(location, "cifar-10-batches-bin", "data_batch_1.bin")
    what = "CIFAR-10 binary records (the 'CIFAR-10 binary version' archive)"
    parts = [_read_records(os.path.join(folder, f"data_batch_{i}.bin"), 1, what) for i in range(1, 6)]
    x_test, y_test = _read_records(os.path.join(folder, "test_batch.bin"), 1, what)
    x_train = np.concatenate([p[0] for p in parts])
    y_train = np.concatenate([p[1] for p in parts])
    _check_labels(folder, y_train, 10)
    return Dataset("cifar10", x_train, y_train, x_test, y_test, num_classes=10)


def cifar100(location: str) -> Dataset:
    """CIFAR-100's binary version: train.bin and test.bin, coarse and fine label bytes; fine labels used."""
    folder = _find_dir(location, "cifar-100-binary", "train.bin")
    what = "CIFAR-100 binary records (coarse label byte, fine label byte, 3072 pixel bytes)"
    x_train, y_train = _read_records(os.path.join(folder, "train.bin"), 2, what)
    x_test, y_test = _read_records(os.path.join(folder, "test.bin"), 2, what)
    _check_labels(folder, y_train, 100)
    return Dataset("cifar100", x_train, y_train, x_test, y_test, num_classes=100)


def _check_labels(where: str, y: np.ndarray, num_classes: int) -> None:
    if y.max() >= num_classes:
        raise DataError(f"{where}: label {int(y.max())} found, expected labels 0..{num_classes - 1}")


# -- MNIST IDX files --------------------------------------------------------------------------------

IDX_UBYTE = 0x08


def read_idx(path: str, ndim: int) -> np.ndarray:
    """One IDX file (unsigned bytes, ``ndim`` dimensions); ``path`` or ``path.gz``."""
    if not os.path.isfile(path) and os.path.isfile(path + ".gz"):
        path = path + ".gz"
    if not os.path.isfile(path):
        raise DataError(f"{path}: file not found (nor {os.path.basename(path)}.gz); expected an MNIST IDX file")
    try:
        if path.endswith(".gz"):
            with gzip.open(path, "rb") as f:
                raw = f.read()
        else:
            with open(path, "rb") as f:
                raw = f.read()
    except (OSError, EOFError) as exc:
        raise DataError(f"{path}: cannot read ({exc}); expected an MNIST IDX file") from None
    header = 4 + 4 * ndim
    if len(raw) < header or raw[0] != 0 or raw[1] != 0 or raw[2] != IDX_UBYTE or raw[3] != ndim:
        raise DataError(
            f"{path}: not an IDX file of unsigned bytes with {ndim} dimension(s) "
            f"(expected magic 00 00 08 {ndim:02x}, found {raw[:4].hex(' ') or 'nothing'})"
        )
    shape = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    expected = int(np.prod(shape))
    if len(raw) - header != expected:
        raise DataError(
            f"{path}: header says shape {shape} ({expected} bytes of data), the file holds {len(raw) - header}. "
            "Is it truncated?"
        )
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(shape)


def mnist(location: str) -> Dataset:
    """MNIST (or Fashion-MNIST) IDX files, 28×28 padded to 32×32, one channel shown as three."""
    if not os.path.isdir(location):
        raise DataError(f"data directory {location!r} does not exist")

    def split(prefix: str) -> tuple[np.ndarray, np.ndarray]:
        images = read_idx(os.path.join(location, f"{prefix}-images-idx3-ubyte"), 3)
        labels = read_idx(os.path.join(location, f"{prefix}-labels-idx1-ubyte"), 1).astype(np.int64)
        if len(images) != len(labels):
            raise DataError(f"{location}: {prefix} has {len(images)} images but {len(labels)} labels")
        if images.shape[1:] != (28, 28):
            raise DataError(f"{location}: {prefix} images are {images.shape[1:]}, expected 28×28")
        padded = np.zeros((len(images), 1, 32, 32), dtype=np.uint8)
        padded[:, 0, 2:30, 2:30] = images
        return padded, labels

    x_train, y_train = split("train")
    x_test, y_test = split("t10k")
    _check_labels(location, y_train, 10)
    return Dataset("mnist", x_train, y_train, x_test, y_test, num_classes=10)


# -- npz --------------------------------------------------------------------------------------------


def npz(path: str) -> Dataset:
    """Arrays ``x`` (N×C×H×W float32) and ``y`` (N integer labels), optionally ``x_test``/``y_test``.

    Without a test split, a fixed 20% of the examples is held out (SPLIT_SEED). Never unpickles.
    """
    if not os.path.isfile(path):
        raise DataError(f"{path}: file not found; expected an .npz with arrays x (N×C×H×W float32) and y (N labels)")
    with open(path, "rb") as f:
        if f.read(2) != b"PK":  # an .npz is a zip archive of .npy files
            raise DataError(f"{path}: not a readable .npz archive (not a zip file); save it with np.savez")
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {name: archive[name] for name in archive.files}
    except ValueError as exc:
        if "pickle" not in str(exc):
            raise DataError(f"{path}: not a readable .npz archive ({exc})") from None
        raise DataError(f"{path}: holds pickled objects, which are never loaded; save plain numeric arrays") from None
    except Exception as exc:
        raise DataError(f"{path}: not a readable .npz archive ({exc.__class__.__name__}: {exc})") from None
    for name in ("x", "y"):
        if name not in arrays:
            raise DataError(f"{path}: no array {name!r} (found {sorted(arrays)}); expected x (N×C×H×W float32) and y")
    x, y = _check_npz_pair(path, arrays["x"], arrays["y"], "x", "y")
    if ("x_test" in arrays) != ("y_test" in arrays):
        raise DataError(f"{path}: has only one of x_test and y_test; give both or neither")
    if "x_test" in arrays:
        x_test, y_test = _check_npz_pair(path, arrays["x_test"], arrays["y_test"], "x_test", "y_test")
        if x_test.shape[1:] != x.shape[1:]:
            raise DataError(f"{path}: x_test images are {x_test.shape[1:]}, x images are {x.shape[1:]}; must match")
        x_train, y_train = x, y
    else:
        x_train, y_train, x_test, y_test = split_off_test(x, y)
    num_classes = int(max(y_train.max(), y_test.max())) + 1
    channels = x.shape[1] if x.shape[1] != 1 else 3
    return Dataset(os.path.basename(path), x_train, y_train, x_test, y_test, num_classes, channels=channels)


def _check_npz_pair(path: str, x: np.ndarray, y: np.ndarray, xn: str, yn: str) -> tuple[np.ndarray, np.ndarray]:
    if x.ndim != 4:
        raise DataError(f"{path}: {xn} has shape {x.shape}, expected 4 dimensions N×C×H×W")
    if x.dtype != np.float32:
        raise DataError(f"{path}: {xn} is {x.dtype}, expected float32 (save x.astype(np.float32))")
    if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
        raise DataError(f"{path}: {yn} has shape {y.shape} and dtype {y.dtype}, expected N integer labels")
    if len(y) != len(x):
        raise DataError(f"{path}: {xn} has {len(x)} images but {yn} has {len(y)} labels")
    if len(y) == 0:
        raise DataError(f"{path}: {xn} is empty")
    if y.min() < 0:
        raise DataError(f"{path}: {yn} has negative label {int(y.min())}, expected labels 0..num_classes-1")
    return np.ascontiguousarray(x), y.astype(np.int64)

"""Data sets: read a training and a test split from disk (or make one), checked, in compact form.

Images stay in the form they arrive in (uint8 for CIFAR, MNIST and digits; float32 for ``npz`` and
``synthetic``) and are normalized batch by batch as they are copied into the INPUT workspace
(``engine.data.batches``): CIFAR-10 held as float32 would take four times the memory.

Every model takes 3-channel input. Grayscale sets (MNIST, digits) keep one stored channel that the
batch filler broadcasts to three; MNIST's 28×28 images are padded to 32×32 with two pixels of
background on each side (LeNet's recipe), digits' 8×8 images are resized to 32×32 bilinearly.

Specs: ``synthetic``, ``digits``, ``cifar10:DIR``, ``cifar100:DIR``, ``mnist:DIR``, ``npz:FILE``,
``imagefolder:DIR`` (files decoded batch by batch, see ``engine.data.imagefolder``).

Files are distrusted (issue 14): every size a header implies is checked against the file's real size
and against ``MAX_DATA_BYTES`` before anything is allocated; a ``.gz`` is decompressed incrementally,
exactly the bytes its IDX header implies (a gzip bomb used to be inflated whole first: +1 GiB), and
trailing data is an error; the labels of every split are range-checked at load (MNIST and CIFAR test
labels were not, so a bad one ended the run in the final evaluation, after training, before saving);
npz members are checked from their headers before they are read.
"""

from __future__ import annotations

import gzip
import os
import threading
import zipfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.errors import UserError

MAX_DATA_BYTES = 64 << 30
"""Largest array a data file may declare (64 GiB, ImageNet-size uint8 sets fit): beyond is a corrupt header."""
MAX_LABELS = 100_000  # the same cap as --num-classes (engine.validate.MAX_CLASSES)

DATA_SPECS = ("synthetic", "digits", "cifar10:DIR", "cifar100:DIR", "mnist:DIR", "npz:FILE", "imagefolder:DIR")
SPLIT_SEED = 0  # the fixed permutation that separates train from test where a set has no test split
TEST_FRACTION = 0.2


class DataError(UserError, ValueError):
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
    elif kind == "synthetic" and image_size:  # large images: fewer of them (an epoch's time; memory holds none)
        many = image_size <= 64
        data = synthetic(num_classes or 10, seed=seed, train=512 if many else 256, test=128 if many else 32,
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
    check_dataset(data)
    return data


def check_dataset(data: Dataset) -> None:
    """Both splits non-empty, images at least 1×1, every label of every split in [0, num_classes)."""
    for split, x, y in (("training", data.x_train, data.y_train), ("test", data.x_test, data.y_test)):
        if len(y) == 0 or len(x) != len(y):
            raise DataError(f"{data.name}: the {split} split has {len(x)} images and {len(y)} labels; "
                            "expected at least one of each, as many images as labels")
        if x.ndim > 1 and min(x.shape[1:]) < 1:  # (image folders hold paths: 1-D)
            raise DataError(f"{data.name}: {split} images have shape {x.shape[1:]}; expected C×H×W of at least 1")
        low, high = int(y.min()), int(y.max())
        if low < 0 or high >= data.num_classes:
            raise DataError(f"{data.name}: the {split} split has label {low if low < 0 else high}; expected "
                            f"labels 0..{data.num_classes - 1}")
    if not 2 <= data.num_classes <= MAX_LABELS:
        raise DataError(f"{data.name}: {data.num_classes} classes; expected between 2 and {MAX_LABELS:,} "
                        "(a label far above the others is usually a corrupt file)")


# -- synthetic --------------------------------------------------------------------------------------


SYNTHETIC_THREADS = 2
"""Threads that draw a synthetic batch's images (``SyntheticImages.take``), for batches of at least
``SYNTHETIC_PARALLEL_VALUES`` values: numpy's generators release the GIL while they fill."""

SYNTHETIC_PARALLEL_VALUES = 1 << 20

_synthetic_pool: ThreadPoolExecutor | None = None
_synthetic_lock = threading.Lock()
_noise = threading.local()


def _synthetic_map(work, items) -> None:
    """``work(item)`` for every item, on ``SYNTHETIC_THREADS`` threads (created on first use); returns when all are
    done, raising the first exception."""
    global _synthetic_pool
    with _synthetic_lock:
        if _synthetic_pool is None:
            _synthetic_pool = ThreadPoolExecutor(SYNTHETIC_THREADS, thread_name_prefix="synthetic-images")
    for _ in _synthetic_pool.map(work, items):
        pass


class SyntheticImages:
    """The images of one synthetic split, made on demand: image ``i`` is a function of (seed, split, i).

    Image ``i`` is its class's pattern plus twice standard normal noise, both drawn in float32 from
    generators seeded with (seed, 7, ...): the pattern of class k from (seed, 7, 0, k), the noise of
    image i from (seed, 7, split, i). Nothing but the labels is held (8 bytes an image): a batch is made
    when it is filled, like an image folder's, so the data set costs no memory that grows with its size
    or its image side. (The split held whole at 224×224 was 77 MB, and making it peaked at ~890 MiB of
    temporaries, more than a ResNet-18 step with offload needs.) Array-like where the engine needs it:
    ``len``, ``shape``, ``ndim``, ``dtype``, ``take(indices, out)`` (``BatchSource.fill``) and indexing.
    """

    dtype = np.dtype(np.float32)
    ndim = 4

    def __init__(self, labels: np.ndarray, image_shape: tuple[int, int, int], seed: int, split: int):
        self.labels = labels
        self.image_shape = tuple(int(d) for d in image_shape)
        self.seed, self.split = int(seed), int(split)

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.labels), *self.image_shape)

    def __len__(self) -> int:
        return len(self.labels)

    def _checked(self, index: Any) -> int:
        index = int(index)
        if not 0 <= index < len(self.labels):
            raise IndexError(f"image {index} out of range: the split has {len(self.labels)}")
        return index

    def image(self, index: int, out: np.ndarray) -> None:
        """Write image ``index`` into ``out`` (float32, ``image_shape``)."""
        index = self._checked(index)
        label = int(self.labels[index])
        np.random.default_rng([self.seed, 7, 0, label]).standard_normal(self.image_shape, dtype=np.float32, out=out)
        noise = np.random.default_rng([self.seed, 7, self.split, index]).standard_normal(self.image_shape,
                                                                                       dtype=np.float32)
        noise *= np.float32(2.0)
        out += noise

    def take(self, indices: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Images ``indices`` into ``out`` (float32, len(indices) × image_shape): ``image``'s bits, with each class's
        pattern drawn once per call and copied to its other rows (a batch of 32 at 224×224 with 10 classes draws
        about 42 instead of 64 planes of normals: 85-86 → 56-59 ms). A batch of ``SYNTHETIC_PARALLEL_VALUES`` values
        or more is drawn on ``SYNTHETIC_THREADS`` threads, row by row, each row from its own generators (the same
        bits on any number of threads): under a tight limit engine train fills each batch on the training thread,
        without prefetch, and the batch was ~57 ms of its step at 224 (one thread, two: ~30 ms)."""
        indices = [self._checked(i) for i in np.asarray(indices).reshape(-1)]  # every one before any row
        labels = [int(self.labels[index]) for index in indices]
        first: dict[int, int] = {}  # label -> the row its pattern is drawn into
        for row, label in enumerate(labels):
            first.setdefault(label, row)
        parallel = len(indices) * int(np.prod(self.image_shape)) >= SYNTHETIC_PARALLEL_VALUES

        def each(work, items) -> None:
            if parallel:
                _synthetic_map(work, items)
            else:
                for item in items:
                    work(item)

        def pattern(label: int) -> None:
            np.random.default_rng([self.seed, 7, 0, label]).standard_normal(self.image_shape, dtype=np.float32,
                                                                            out=out[first[label]])

        def copy(row: int) -> None:
            if first[labels[row]] != row:
                out[row] = out[first[labels[row]]]

        def noise(row: int) -> None:
            buffer = getattr(_noise, "buffer", None)
            if buffer is None or buffer.shape != self.image_shape:
                buffer = _noise.buffer = np.empty(self.image_shape, np.float32)
            np.random.default_rng([self.seed, 7, self.split, indices[row]]).standard_normal(
                self.image_shape, dtype=np.float32, out=buffer)
            buffer *= np.float32(2.0)
            out[row] += buffer

        each(pattern, list(first))  # the patterns, then their copies, then every row's noise: a row's pattern is
        each(copy, range(len(indices)))  # copied before noise is added to the row it was drawn into
        each(noise, range(len(indices)))
        return out

    def __getitem__(self, key: Any) -> np.ndarray:
        """Materialize the images ``key`` selects (an int, a slice or an index array; then NumPy's indexing)."""
        rest: tuple[Any, ...] = ()
        if isinstance(key, tuple):
            key, rest = key[0], key[1:]
        indices = np.arange(len(self))[key]
        single = np.ndim(indices) == 0
        indices = np.atleast_1d(indices)
        out = self.take(indices, np.empty((len(indices), *self.image_shape), dtype=np.float32))
        out = out[0] if single else out
        return out[(slice(None),) * (0 if single else 1) + rest] if rest else out


def synthetic(
    num_classes: int = 10, seed: int = 0, train: int = 512, test: int = 128, shape: tuple[int, int, int] = (3, 32, 32)
) -> Dataset:
    """Seeded random images: one random pattern per class plus noise, so a network can learn it (made lazily,
    ``SyntheticImages``). Its per-channel statistics are the generator's own: every pixel is N(0, 1) + 2·N(0, 1),
    mean 0 and standard deviation √5, so nothing is read to compute them."""
    def labels(split: int, n: int) -> np.ndarray:
        return np.random.default_rng([seed, 7, split]).integers(0, num_classes, size=n).astype(np.int64)

    y_train, y_test = labels(1, train), labels(2, test)
    channels = shape[0]
    return Dataset("synthetic", SyntheticImages(y_train, shape, seed, 1), y_train,
                   SyntheticImages(y_test, shape, seed, 2), y_test, num_classes,
                   mean=np.zeros(channels, np.float32), std=np.full(channels, np.sqrt(5.0), np.float32))


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


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits as (N×8×8 float64 images 0..16, int64 labels), read from the file it ships.

    ``sklearn.datasets.load_digits`` reads the same ``digits.csv.gz``, but importing scikit-learn costs
    ~80 MiB of resident memory (measured: 91 → 172 MiB RSS) that stays for the whole training run:
    finding the package's directory (``importlib.util.find_spec``) runs none of its code. Where the
    file is not where scikit-learn 1.x keeps it, ``load_digits`` is the fallback.
    """
    import gzip
    import importlib.util

    spec = importlib.util.find_spec("sklearn")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = os.path.join(location, "datasets", "data", "digits.csv.gz")
        if os.path.isfile(path):
            with gzip.open(path, "rt", encoding="ascii") as handle:
                table = np.loadtxt(handle, delimiter=",")
            return table[:, :-1].reshape(-1, 8, 8), table[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits

    bunch = load_digits()
    return bunch.images.astype(np.float64), bunch.target.astype(np.int64)


def digits() -> Dataset:
    """scikit-learn's 1,797 handwritten digits, 8×8 → 32×32 (bilinear), one channel shown as three."""
    raw, labels = digits_arrays()
    images = raw * (255.0 / 16.0)  # 0..16 → 0..255, like the other sets
    m = bilinear_matrix(8, 32)
    resized = np.einsum("oh,nhw,pw->nop", m, images, m)
    x = np.clip(np.rint(resized), 0, 255).astype(np.uint8)[:, None]  # N×1×32×32
    x_train, y_train, x_test, y_test = split_off_test(x, labels)
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
    size = os.path.getsize(path)
    if size > MAX_DATA_BYTES:
        raise DataError(f"{path}: {size:,} bytes, more than the {MAX_DATA_BYTES >> 30} GiB a data file here may "
                        f"hold; expected {what}")
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
    _check_labels(folder, y_test, 10)
    return Dataset("cifar10", x_train, y_train, x_test, y_test, num_classes=10)


def cifar100(location: str) -> Dataset:
    """CIFAR-100's binary version: train.bin and test.bin, coarse and fine label bytes; fine labels used."""
    folder = _find_dir(location, "cifar-100-binary", "train.bin")
    what = "CIFAR-100 binary records (coarse label byte, fine label byte, 3072 pixel bytes)"
    x_train, y_train = _read_records(os.path.join(folder, "train.bin"), 2, what)
    x_test, y_test = _read_records(os.path.join(folder, "test.bin"), 2, what)
    _check_labels(folder, y_train, 100)
    _check_labels(folder, y_test, 100)
    return Dataset("cifar100", x_train, y_train, x_test, y_test, num_classes=100)


def _check_labels(where: str, y: np.ndarray, num_classes: int) -> None:
    if y.max() >= num_classes:
        raise DataError(f"{where}: label {int(y.max())} found, expected labels 0..{num_classes - 1}")


# -- MNIST IDX files --------------------------------------------------------------------------------

IDX_UBYTE = 0x08


def read_idx(path: str, ndim: int, item_shape: tuple[int, ...] | None = None) -> np.ndarray:
    """One IDX file (unsigned bytes, ``ndim`` dimensions); ``path`` or ``path.gz``.

    The header is read first; the size it implies is checked (every dimension at least 1, the trailing
    ``item_shape`` if given, at most ``MAX_DATA_BYTES``, and for a plain file equal to the file's size)
    before the data is allocated. A ``.gz`` is inflated exactly that far, and any byte after it is an
    error, so memory never exceeds what the header promised.
    """
    if not os.path.isfile(path) and os.path.isfile(path + ".gz"):
        path = path + ".gz"
    if not os.path.isfile(path):
        raise DataError(f"{path}: file not found (nor {os.path.basename(path)}.gz); expected an MNIST IDX file")
    header_bytes = 4 + 4 * ndim
    compressed = path.endswith(".gz")
    try:
        with (gzip.open(path, "rb") if compressed else open(path, "rb")) as f:
            raw = f.read(header_bytes)
            if len(raw) < header_bytes or raw[0] != 0 or raw[1] != 0 or raw[2] != IDX_UBYTE or raw[3] != ndim:
                raise DataError(
                    f"{path}: not an IDX file of unsigned bytes with {ndim} dimension(s) "
                    f"(expected magic 00 00 08 {ndim:02x}, found {raw[:4].hex(' ') or 'nothing'})"
                )
            shape = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
            expected = 1
            for size in shape:
                expected *= size
            if min(shape) < 1:
                raise DataError(f"{path}: header says shape {shape}: no data; expected at least one item")
            if item_shape is not None and shape[1:] != item_shape:
                raise DataError(f"{path}: header says items of {shape[1:]}, expected {item_shape}")
            if expected > MAX_DATA_BYTES:
                raise DataError(f"{path}: header says shape {shape} ({expected:,} bytes), more than the "
                                f"{MAX_DATA_BYTES >> 30} GiB any data file here may hold: the header is corrupt")
            if not compressed and os.path.getsize(path) != header_bytes + expected:
                raise DataError(
                    f"{path}: header says shape {shape} ({expected} bytes of data), the file holds "
                    f"{os.path.getsize(path) - header_bytes}. Is it truncated?"
                )
            data = np.empty(expected, dtype=np.uint8)
            filled = f.readinto(memoryview(data)) if not compressed else _read_into(f, data)
            if filled != expected:
                raise DataError(f"{path}: header says shape {shape} ({expected} bytes of data), the file "
                                f"holds {filled}. Is it truncated?")
            if compressed and f.read(1):
                raise DataError(f"{path}: more data after the {expected} bytes the header says: the file is "
                                "corrupt or not what its header claims")
    except DataError:
        raise
    except (OSError, EOFError, zlib.error) as exc:
        raise DataError(f"{path}: cannot read ({exc}); expected an MNIST IDX file, gzip-compressed or not") from None
    return data.reshape(shape)


def _read_into(f: gzip.GzipFile, data: np.ndarray) -> int:
    """Inflate into ``data`` in 1 MiB pieces (the gzip reader never holds more than one piece)."""
    view = memoryview(data)
    done = 0
    while done < len(view):
        n = f.readinto(view[done : done + (1 << 20)])
        if not n:
            break
        done += n
    return done


def mnist(location: str) -> Dataset:
    """MNIST (or Fashion-MNIST) IDX files, 28×28 padded to 32×32, one channel shown as three."""
    if not os.path.isdir(location):
        raise DataError(f"data directory {location!r} does not exist")

    def split(prefix: str) -> tuple[np.ndarray, np.ndarray]:
        images = read_idx(os.path.join(location, f"{prefix}-images-idx3-ubyte"), 3, item_shape=(28, 28))
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
    _check_labels(location, y_test, 10)
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
    _check_npz_members(path)
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


def _check_npz_members(path: str) -> None:
    """Read every member's .npy header (not its data): the declared size must be sane and present."""
    try:
        with zipfile.ZipFile(path) as archive:
            for info in archive.infolist():
                if not info.filename.endswith(".npy"):
                    continue
                with archive.open(info) as member:
                    version = np.lib.format.read_magic(member)
                    read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                                   else np.lib.format.read_array_header_2_0)
                    shape, _, dtype = read_header(member)
                count = 1
                for size in shape:
                    count *= int(size)
                nbytes = count * dtype.itemsize
                if nbytes > MAX_DATA_BYTES:
                    raise DataError(f"{path}: {info.filename} declares shape {shape} ({nbytes:,} bytes), more "
                                    f"than the {MAX_DATA_BYTES >> 30} GiB a data file here may hold")
                if info.file_size < nbytes:
                    raise DataError(f"{path}: {info.filename} declares {nbytes:,} bytes of data but holds "
                                    f"{info.file_size:,}; the file is truncated or corrupt")
    except DataError:
        raise
    except (zipfile.BadZipFile, ValueError, OSError, EOFError, zlib.error) as exc:
        raise DataError(f"{path}: not a readable .npz archive ({exc}); save it with np.savez") from None


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
    if y.max() >= MAX_LABELS:
        raise DataError(f"{path}: {yn} has label {int(y.max())}; expected labels below {MAX_LABELS:,} "
                        "(the class count follows the largest label)")
    if min(x.shape[1:]) < 1:
        raise DataError(f"{path}: {xn} images have shape {x.shape[1:]}; expected C×H×W of at least 1×1×1")
    if not np.isfinite(x).all():
        raise DataError(f"{path}: {xn} holds NaN or infinite values; training on them gives NaN weights")
    return np.ascontiguousarray(x), y.astype(np.int64)

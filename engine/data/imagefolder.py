"""Image folders: torchvision's ImageFolder rules and ImageNet transforms, decoded with Pillow on threads.

``--data imagefolder:DIR`` reads one subfolder per class. The rules are torchvision's
(``torchvision.datasets.folder``): classes are the subfolder names in sorted order, labels their
indices; each class folder is walked recursively (symlinks followed), file names sorted, and a file
counts when its lower-cased name ends in one of ``IMG_EXTENSIONS``. With ``DIR/train`` and ``DIR/val``
both present they are the two splits (``val`` may hold a subset of the classes); otherwise a fixed
20% of the images (``SPLIT_SEED``) is held out.

Transforms equal torchvision's ImageNet recipe on the same image with the same random parameters
(tested against ``torchvision.transforms``):
- training: ``RandomResizedCrop(size)`` (scale 0.08-1, ratio 3/4-4/3, bilinear, antialiased as Pillow
  always is) + ``RandomHorizontalFlip()`` + ``ToTensor()`` + ``Normalize(IMAGENET_MEAN, IMAGENET_STD)``;
- evaluation: ``Resize(size * 256 // 224)`` (shorter side) + ``CenterCrop(size)`` + the same.
The random parameters of image ``row`` of batch (epoch, index) come from a generator seeded with
(seed, epoch, index, row), so batches stay functions of (seed, epoch, index) whichever thread decodes.

Files are opened as torchvision's ``pil_loader`` opens them: ``Image.open(f).convert("RGB")``, which
is how grayscale (L), palette (P), RGBA (alpha dropped), CMYK and 16-bit (I;16) images become RGB.
Problems are errors that name the file, never skipped silently: a file Pillow cannot decode
(corrupt or truncated), a decompression bomb (more than ``PIL.Image.MAX_IMAGE_PIXELS`` pixels: Pillow
only warns up to twice that, we stop there), an empty class folder, a folder with no class folders.
The scan at start reads names only; a corrupt file is found when its batch is decoded.

Decoding runs in the prefetch thread's ``fill``, fanned out to ``workers`` threads: Pillow releases
the GIL while it decodes and resizes, so they overlap (see docs/training.md for images/s of the loader
alone against the training step).
"""

from __future__ import annotations

import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine.data.batches import BatchSource
from engine.data.datasets import DataError, Dataset, split_off_test

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")  # torchvision's
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
CROP_SCALE = (0.08, 1.0)
CROP_RATIO = (3.0 / 4.0, 4.0 / 3.0)
DEFAULT_IMAGE_SIZE = 224


def default_workers() -> int:
    """Decoding threads: one per core, at least 2 (one decodes while the other waits on the disk), at most 8."""
    return max(2, min(8, os.cpu_count() or 2))


# -- the folder -------------------------------------------------------------------------------------


def find_classes(directory: str) -> list[str]:
    """The class folders of ``directory``, sorted (torchvision's ``find_classes``).

    A class folder that is a broken symbolic link is refused, not skipped (torchvision's ``is_dir()``
    is false for it, so the class silently vanished and every later label shifted by one)."""
    if not os.path.isdir(directory):
        raise DataError(f"image folder {directory!r} does not exist")
    entries = sorted(os.scandir(directory), key=lambda entry: entry.name)
    for entry in entries:
        if entry.is_symlink() and not os.path.exists(entry.path):
            raise DataError(f"{entry.path}: a broken symbolic link (to {os.readlink(entry.path)!r}) where a class "
                            "folder or file was expected; fix the link or remove it")
    classes = [entry.name for entry in entries if entry.is_dir()]
    if not classes:
        raise DataError(
            f"{directory}: no class folders; expected one subfolder per class (DIR/cat/1.jpg, DIR/dog/2.png)"
        )
    return classes


def walk_class_folder(folder: str) -> list[str]:
    """Every file under ``folder`` in torchvision's order: ``sorted(os.walk(folder, followlinks=True))``,
    names sorted within each folder.

    A symbolic link back to a folder already on the way down is a loop: ``os.walk`` followed it ~40
    levels deep (until the path was too long) and silently multiplied the data set, so it is refused
    with the link's name. A folder reached twice by two links that do not form a loop is walked both
    times, as torchvision does."""
    folders: list[tuple[str, list[str]]] = []

    def walk(path: str, ancestors: tuple[tuple[int, int], ...], link: str | None) -> None:
        try:
            st = os.stat(path)
            entries = sorted(os.scandir(path), key=lambda entry: entry.name)
        except OSError as exc:
            raise DataError(f"{path}: cannot read the folder ({exc.strerror or exc})") from None
        key = (st.st_dev, st.st_ino)
        if key in ancestors:
            raise DataError(f"{link or path}: a symbolic link loop (through it, {path} is "
                            f"{os.path.realpath(path)}, a folder above it); remove the link")
        subfolders, files = [], []
        for entry in entries:
            if entry.is_dir():
                subfolders.append((entry.path, entry.path if entry.is_symlink() else link))
            else:
                files.append(entry.path)
        folders.append((path, files))
        for sub, via in subfolders:
            walk(sub, (*ancestors, key), via)

    walk(folder, (), None)
    return [file for _, files in sorted(folders) for file in files]


def make_samples(directory: str, classes: list[str]) -> tuple[list[str], list[int]]:
    """(paths, labels) of every image under ``directory/<class>`` in torchvision's order."""
    paths: list[str] = []
    labels: list[int] = []
    for label, name in enumerate(classes):
        folder = os.path.join(directory, name)
        if not os.path.isdir(folder):
            continue  # a validation split may lack classes; torchvision skips them too
        found = 0
        for path in walk_class_folder(folder):
            if os.path.basename(path).lower().endswith(IMG_EXTENSIONS):
                paths.append(path)
                labels.append(label)
                found += 1
        if found == 0:
            raise DataError(
                f"{folder}: class folder holds no images (extensions {', '.join(IMG_EXTENSIONS)}); "
                "add images or remove the folder"
            )
    if not paths:
        raise DataError(f"{directory}: no images found under its class folders")
    return paths, labels


@dataclass
class ImageFolderData(Dataset):
    """An image folder: ``x_*`` hold file paths (decoded batch by batch), ``image_size`` the crop."""

    image_size: int = DEFAULT_IMAGE_SIZE
    classes: list[str] = field(default_factory=list)
    root: str = ""
    workers: int = field(default_factory=default_workers)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return (3, self.image_size, self.image_size)

    def describe(self) -> str:
        return (
            f"imagefolder {self.root}: {len(self.y_train)} train / {len(self.y_test)} val images, "
            f"decoded to 3×{self.image_size}×{self.image_size}, {self.num_classes} classes"
        )

    def batch_source(self, split: str, batch_size: int, *, shuffle: bool = True, augment: bool = False,
                     seed: int = 0, drop_last: bool = True) -> BatchSource:
        """Training split: RandomResizedCrop + flip; the other: Resize + CenterCrop (``augment`` is implied)."""
        paths, labels = (self.x_train, self.y_train) if split == "train" else (self.x_test, self.y_test)
        return ImageFolderSource(paths, labels, self.image_size, batch_size, train=split == "train",
                                 shuffle=shuffle, seed=seed, drop_last=drop_last, workers=self.workers)


def imagefolder(location: str, image_size: int = DEFAULT_IMAGE_SIZE) -> ImageFolderData:
    """The data set of ``--data imagefolder:DIR`` (module docstring)."""
    if image_size < 8:
        raise DataError(f"imagefolder: image size must be at least 8 pixels, got {image_size}")
    train_dir, val_dir = os.path.join(location, "train"), os.path.join(location, "val")
    if os.path.isdir(train_dir) and os.path.isdir(val_dir):
        classes = find_classes(train_dir)
        unknown = sorted(set(find_classes(val_dir)) - set(classes))
        if unknown:
            raise DataError(f"{val_dir}: classes {', '.join(unknown[:5])} are not in {train_dir}")
        train_paths, train_labels = make_samples(train_dir, classes)
        val_paths, val_labels = make_samples(val_dir, classes)
        x_train, y_train = np.array(train_paths), np.array(train_labels, dtype=np.int64)
        x_test, y_test = np.array(val_paths), np.array(val_labels, dtype=np.int64)
    else:
        classes = find_classes(location)
        paths, labels = make_samples(location, classes)
        if len(paths) < 2:
            raise DataError(f"{location}: {len(paths)} image; need at least 2 to hold one out for evaluation")
        x_train, y_train, x_test, y_test = split_off_test(np.array(paths), np.array(labels, dtype=np.int64))
    return ImageFolderData(
        "imagefolder", x_train, y_train, x_test, y_test, num_classes=len(classes), channels=3,
        mean=np.array(IMAGENET_MEAN, np.float32), std=np.array(IMAGENET_STD, np.float32),
        image_size=image_size, classes=classes, root=location,
    )


# -- decoding and transforms ------------------------------------------------------------------------


def load_image(path: str) -> Any:
    """``Image.open(path).convert("RGB")`` as torchvision's ``pil_loader``; DataError naming the file."""
    from PIL import Image, UnidentifiedImageError

    try:
        with open(path, "rb") as f:
            image = Image.open(f)
            if image.width * image.height > Image.MAX_IMAGE_PIXELS:
                raise DataError(
                    f"{path}: {image.width}×{image.height} pixels is more than PIL.Image.MAX_IMAGE_PIXELS "
                    f"({Image.MAX_IMAGE_PIXELS}): a possible decompression bomb; shrink the image or raise the limit"
                )
            return image.convert("RGB")
    except Image.DecompressionBombError as exc:
        raise DataError(f"{path}: decompression bomb refused by Pillow ({exc})") from None
    except UnidentifiedImageError:
        raise DataError(f"{path}: not an image Pillow can read (corrupt, or not the format its name says)") from None
    except FileNotFoundError:
        raise DataError(f"{path}: the image file is gone (deleted or moved since the folder was read)") from None
    except IsADirectoryError:
        raise DataError(f"{path}: is a directory now, not an image file (replaced since the folder was read)") from None
    except PermissionError:
        raise DataError(f"{path}: cannot be read (permission denied); fix its permissions") from None
    except (OSError, SyntaxError, ValueError) as exc:
        raise DataError(f"{path}: cannot decode ({exc}); the file is truncated or corrupt") from None


def sample_crop(rng: np.random.Generator, width: int, height: int,
                scale: tuple[float, float] = CROP_SCALE,
                ratio: tuple[float, float] = CROP_RATIO) -> tuple[int, int, int, int]:
    """(top, left, height, width) of a random crop: torchvision's ``RandomResizedCrop.get_params``,
    drawing from ``rng`` instead of torch's generator (10 tries, then the centre crop fallback)."""
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * rng.uniform(scale[0], scale[1])
        aspect_ratio = math.exp(rng.uniform(log_ratio[0], log_ratio[1]))
        w = int(round(math.sqrt(target_area * aspect_ratio)))
        h = int(round(math.sqrt(target_area / aspect_ratio)))
        if 0 < w <= width and 0 < h <= height:
            top = int(rng.integers(0, height - h + 1))
            left = int(rng.integers(0, width - w + 1))
            return top, left, h, w
    in_ratio = float(width) / float(height)
    if in_ratio < min(ratio):
        w = width
        h = int(round(w / min(ratio)))
    elif in_ratio > max(ratio):
        h = height
        w = int(round(h * max(ratio)))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def resize_shorter(width: int, height: int, size: int) -> tuple[int, int]:
    """(width, height) after torchvision's ``Resize(size)``: the shorter side becomes ``size``."""
    short, long = (width, height) if width <= height else (height, width)
    if short == size:
        return width, height
    new_long = int(size * long / short)
    return (size, new_long) if width <= height else (new_long, size)


def eval_resize(size: int) -> int:
    """The shorter side before the centre crop: 256 for 224 (torchvision's ImageNet ratio 224/256)."""
    return int(size * 256 / 224)


def train_image(image: Any, crop: tuple[int, int, int, int], flip: bool, size: int) -> Any:
    """RandomResizedCrop with the given crop, then the flip: a ``size``×``size`` RGB Pillow image."""
    from PIL import Image

    top, left, h, w = crop
    out = image.crop((left, top, left + w, top + h)).resize((size, size), Image.BILINEAR)
    return out.transpose(Image.FLIP_LEFT_RIGHT) if flip else out


def eval_image(image: Any, size: int) -> Any:
    """Resize(shorter side to ``eval_resize(size)``) then CenterCrop(``size``), as torchvision."""
    from PIL import Image

    width, height = resize_shorter(image.width, image.height, eval_resize(size))
    if (width, height) != image.size:
        image = image.resize((width, height), Image.BILINEAR)
    if width < size or height < size:
        raise DataError(f"image of {image.width}×{image.height} is smaller than the {size}-pixel centre crop")
    top, left = int(round((height - size) / 2.0)), int(round((width - size) / 2.0))
    return image.crop((left, top, left + size, top + size))


def to_normalized(image: Any, mean: np.ndarray, std: np.ndarray, out: np.ndarray) -> None:
    """ToTensor + Normalize into ``out`` (3×H×W float32): (pixel / 255 - mean) / std in float32."""
    pixels = np.asarray(image, dtype=np.uint8)  # H×W×3
    np.divide(pixels.transpose(2, 0, 1), np.float32(255.0), out=out, dtype=np.float32)
    np.subtract(out, mean, out=out)
    np.divide(out, std, out=out)


class ImageFolderSource(BatchSource):
    """A BatchSource over image files: ``fill`` decodes and transforms the batch on ``workers`` threads."""

    def __init__(self, paths: np.ndarray, labels: np.ndarray, image_size: int, batch_size: int, *,
                 train: bool, shuffle: bool = True, seed: int = 0, drop_last: bool = True,
                 workers: int | None = None):
        super().__init__(paths, labels, np.array(IMAGENET_MEAN, np.float32), np.array(IMAGENET_STD, np.float32),
                         batch_size, channels=3, shuffle=shuffle, augment=False, seed=seed, drop_last=drop_last)
        self.std = np.array(IMAGENET_STD, np.float32).reshape(-1, 1, 1)  # Normalize divides (not * 1/std)
        self.image_size = image_size
        self.train = train
        self.workers = workers or default_workers()
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    @property
    def batch_shape(self) -> tuple[int, int, int, int]:
        return (self.batch_size, 3, self.image_size, self.image_size)

    def transform(self, path: str, epoch: int, index: int, row: int, out: np.ndarray) -> None:
        """Decode ``path`` into ``out`` as row ``row`` of batch (epoch, index)."""
        image = load_image(path)
        if self.train:
            rng = np.random.default_rng([self.seed, epoch, index, row])
            crop = sample_crop(rng, image.width, image.height)
            image = train_image(image, crop, bool(rng.random() < 0.5), self.image_size)
        else:
            try:
                image = eval_image(image, self.image_size)
            except DataError as exc:
                raise DataError(f"{path}: {exc}") from None
        to_normalized(image, self.mean, self.std, out)

    def fill(self, epoch: int, index: int, x_out: np.ndarray, y_out: np.ndarray) -> None:
        chosen = self.indices(epoch, index)
        np.take(self.y, chosen, axis=0, out=y_out)
        paths = [str(self.x[i]) for i in chosen]

        def decode(row: int) -> None:
            self.transform(paths[row], epoch, index, row, x_out[row])

        if self.workers <= 1:
            for row in range(len(paths)):
                decode(row)
            return
        for _ in self._executor().map(decode, range(len(paths))):
            pass  # map re-raises the first error (a DataError naming the file)

    def _executor(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="decode")
            return self._pool

    def close(self) -> None:
        """Stop the decoding threads (they also end with the process)."""
        with self._pool_lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None

"""Image folders against torchvision: ImageFolder's classes and file order, pil_loader's mode conversions,
RandomResizedCrop + flip and Resize + CenterCrop with the same random parameters, and clear errors."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from PIL import Image

from engine.data import DataError, load_dataset
from engine.data.imagefolder import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    IMG_EXTENSIONS,
    eval_image,
    find_classes,
    load_image,
    make_samples,
    sample_crop,
    to_normalized,
    train_image,
)

MODES = ("RGB", "L", "P", "RGBA", "CMYK", "I;16")


def make_image(mode: str, size: tuple[int, int], seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    w, h = size
    if mode == "I;16":
        return Image.fromarray(rng.integers(0, 65535, (h, w), dtype=np.uint16))
    rgb = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
    if mode == "RGBA":
        return Image.fromarray(rng.integers(0, 256, (h, w, 4), dtype=np.uint8))
    if mode == "P":
        return rgb.quantize(16)
    return rgb.convert(mode)


def build_folder(root, sizes=((40, 30), (33, 47), (64, 64))) -> list[str]:
    """Three classes, every mode, JPEG and PNG, a nested folder, an upper-case extension, a non-image."""
    paths = []
    for c, name in enumerate(("cat", "dog", "emu")):
        folder = root / name
        (folder / "nested").mkdir(parents=True)
        for k, mode in enumerate(MODES):
            fmt = "JPEG" if mode in ("RGB", "L", "CMYK") else "PNG"
            sub = folder / "nested" if k == 2 else folder
            path = sub / f"{k}_{mode.replace(';', '')}.{'JPG' if k == 0 else fmt.lower()}"
            make_image(mode, sizes[(c + k) % len(sizes)], seed=10 * c + k).save(path, fmt)
            paths.append(str(path))
        (folder / "notes.txt").write_text("not an image")
    return paths


def torchvision_normalize(torchvision, image):
    t = torchvision.transforms
    return t.Normalize(IMAGENET_MEAN, IMAGENET_STD)(t.ToTensor()(image)).numpy()


def ours_normalize(image) -> np.ndarray:
    out = np.empty((3, image.height, image.width), np.float32)
    to_normalized(image, np.array(IMAGENET_MEAN, np.float32).reshape(3, 1, 1),
                  np.array(IMAGENET_STD, np.float32).reshape(3, 1, 1), out)
    return out


def test_classes_and_samples_follow_torchvision(tmp_path, torchvision):
    build_folder(tmp_path)
    classes = find_classes(str(tmp_path))
    reference_classes, class_to_idx = torchvision.datasets.folder.find_classes(str(tmp_path))
    assert classes == reference_classes
    paths, labels = make_samples(str(tmp_path), classes)
    reference = torchvision.datasets.folder.make_dataset(str(tmp_path), class_to_idx, extensions=IMG_EXTENSIONS)
    assert list(zip(paths, labels)) == [(p, y) for p, y in reference]
    assert len(paths) == 3 * len(MODES)


@pytest.mark.parametrize("mode", MODES)
def test_modes_convert_as_torchvision_loader(tmp_path, torchvision, mode):
    path = str(tmp_path / f"image.{'jpg' if mode in ('RGB', 'L', 'CMYK') else 'png'}")
    make_image(mode, (21, 13), seed=3).save(path)
    ours = load_image(path)
    reference = torchvision.datasets.folder.pil_loader(path)
    assert ours.mode == "RGB" and reference.mode == "RGB"
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(reference))


@pytest.mark.parametrize("size", [224, 40])
def test_train_transform_equals_torchvision(tmp_path, torchvision, size):
    functional = torchvision.transforms.functional
    for seed, shape in enumerate(((300, 240), (180, 400), (500, 375))):
        image = make_image("RGB", shape, seed)
        rng = np.random.default_rng(seed)
        top, left, h, w = sample_crop(rng, image.width, image.height)
        for flip in (False, True):
            ours = ours_normalize(train_image(image, (top, left, h, w), flip, size))
            reference = functional.resized_crop(image, top, left, h, w, [size, size],
                                                functional.InterpolationMode.BILINEAR, antialias=True)
            if flip:
                reference = torchvision.transforms.RandomHorizontalFlip(p=1.0)(reference)
            np.testing.assert_allclose(ours, torchvision_normalize(torchvision, reference), rtol=0, atol=1e-6)


@pytest.mark.parametrize("shape", [(300, 240), (240, 300), (256, 256), (900, 257)])
def test_eval_transform_equals_torchvision(torchvision, shape):
    t = torchvision.transforms
    image = make_image("RGB", shape, 5)
    ours = ours_normalize(eval_image(image, 224))
    reference = t.Compose([t.Resize(256), t.CenterCrop(224)])(image)
    np.testing.assert_allclose(ours, torchvision_normalize(torchvision, reference), rtol=0, atol=1e-6)


def test_crop_parameters_follow_torchvision(torchvision):
    """The fallback (every try fails) is torchvision's exactly; random crops stay inside its bounds."""
    get_params = torchvision.transforms.RandomResizedCrop.get_params
    for shape in ((300, 100), (100, 300), (200, 200)):
        image = make_image("RGB", shape, 0)
        impossible = (2.0, 2.0)  # a crop larger than the image: all ten tries fail
        for ratio in ((3 / 4, 4 / 3), (0.5, 0.6), (2.0, 3.0)):
            ours = sample_crop(np.random.default_rng(0), *shape, scale=impossible, ratio=ratio)
            assert ours == tuple(get_params(image, list(impossible), list(ratio)))
    rng = np.random.default_rng(1)
    areas, ratios = [], []
    for _ in range(400):
        top, left, h, w = sample_crop(rng, 500, 375)
        assert 0 <= top and top + h <= 375 and 0 <= left and left + w <= 500
        areas.append(h * w / (500 * 375))
        ratios.append(w / h)
    assert 0.07 < min(areas) and max(areas) <= 1.0 and np.mean(areas) > 0.4  # uniform in [0.08, 1] (clipped)
    assert 0.74 < min(ratios) and max(ratios) < 1.35


class Draws:
    """The same uniform numbers for our sampler (as a Generator) and for torchvision's (as torch calls)."""

    def __init__(self, seed: int):
        self.source = np.random.default_rng(seed)

    def unit(self) -> float:
        return float(self.source.random())

    # our side: the two Generator methods sample_crop calls
    def uniform(self, low: float, high: float) -> float:
        return low + (high - low) * self.unit()

    def integers(self, low: int, high: int) -> int:
        return low + int(self.unit() * (high - low))


class TorchUniform:
    """What ``torch.empty(1)`` returns while patched: its ``uniform_`` takes the shared draw."""

    def __init__(self, draws: Draws):
        self.draws = draws

    def uniform_(self, low: float, high: float) -> torch.Tensor:
        return torch.tensor([self.draws.uniform(low, high)], dtype=torch.float64)


def test_crop_sampler_is_torchvisions_algorithm(torchvision, monkeypatch):
    """Fed the same uniform numbers, sample_crop and RandomResizedCrop.get_params return the same crops."""
    get_params = torchvision.transforms.RandomResizedCrop.get_params
    for shape in ((500, 375), (120, 400), (64, 64)):
        image = make_image("RGB", shape, 0)
        for seed in range(40):
            ours = sample_crop(Draws(seed), *shape)
            draws = Draws(seed)
            monkeypatch.setattr(torch, "empty", lambda *a, d=draws, **k: TorchUniform(d))
            monkeypatch.setattr(torch, "randint", lambda lo, hi, size, d=draws: torch.tensor([d.integers(lo, hi)]))
            theirs = get_params(image, [0.08, 1.0], [3 / 4, 4 / 3])
            monkeypatch.undo()
            assert ours == tuple(theirs), (shape, seed)


def test_batches_are_functions_of_seed_epoch_index(tmp_path):
    build_folder(tmp_path)
    data = load_dataset(f"imagefolder:{tmp_path}", image_size=16)
    assert data.num_classes == 3 and data.image_shape == (3, 16, 16)
    assert len(data.y_train) + len(data.y_test) == 3 * len(MODES)
    batches = []
    for workers in (1, 3):
        data.workers = workers
        source = data.batch_source("train", 4, seed=7)
        x, y = np.empty(source.batch_shape, np.float32), np.empty(4, np.int64)
        source.fill(1, 2, x, y)
        batches.append((x.copy(), y.copy()))
        source.fill(0, 2, x, y)
        assert not np.array_equal(x, batches[-1][0])  # another epoch: another crop
        source.close()
    np.testing.assert_array_equal(batches[0][0], batches[1][0])
    np.testing.assert_array_equal(batches[0][1], batches[1][1])


def test_train_and_val_folders_are_the_splits(tmp_path):
    build_folder(tmp_path / "train")
    build_folder(tmp_path / "val")
    os.remove(next(p for p in build_folder(tmp_path / "spare") if "emu" in p))  # unrelated folder
    data = load_dataset(f"imagefolder:{tmp_path}")
    assert len(data.y_train) == len(data.y_test) == 3 * len(MODES)
    assert data.classes == ["cat", "dog", "emu"] and data.image_size == 224
    source = data.batch_source("test", 5, shuffle=False, drop_last=False)
    x, y = np.empty(source.batch_shape, np.float32), np.empty(5, np.int64)
    source.fill(0, 0, x, y)  # 33×47 and 40×30 images: Resize(256) + CenterCrop(224)
    assert np.isfinite(x).all() and list(y) == [0] * 5


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_errors_name_the_file_or_folder(tmp_path, monkeypatch):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match="no class folders"):
        load_dataset(f"imagefolder:{empty}")
    (empty / "cat").mkdir()
    (empty / "cat" / "readme.txt").write_text("x")
    with pytest.raises(DataError, match=r"cat: class folder holds no images"):
        load_dataset(f"imagefolder:{empty}")
    with pytest.raises(DataError, match="does not exist"):
        load_dataset(f"imagefolder:{tmp_path / 'missing'}")

    root = tmp_path / "data"
    paths = build_folder(root)
    corrupt = paths[0]
    with open(corrupt, "r+b") as f:
        f.truncate(40)  # a truncated JPEG
    with pytest.raises(DataError, match=rf"{corrupt}: "):
        load_image(corrupt)
    garbage = root / "dog" / "garbage.png"
    garbage.write_bytes(b"\x00not a png at all" * 20)
    with pytest.raises(DataError, match=rf"{garbage}: not an image"):
        load_image(str(garbage))
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    with pytest.raises(DataError, match=rf"{paths[1]}: .*decompression bomb"):
        load_image(paths[1])


def test_a_corrupt_file_stops_training_with_its_name(tmp_path):
    from click.testing import CliRunner

    from cli import main

    paths = build_folder(tmp_path)
    runner = CliRunner()
    result = runner.invoke(main, ["train", "--model", "cnn", "--data", f"imagefolder:{tmp_path}", "--image-size", "16",
                                  "--batch-size", "4", "--steps", "2", "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "imagefolder" in result.output and "3 classes" in result.output
    for path in paths:
        with open(path, "wb") as f:
            f.write(b"broken")
    result = runner.invoke(main, ["train", "--model", "cnn", "--data", f"imagefolder:{tmp_path}", "--image-size", "16",
                                  "--batch-size", "4", "--steps", "2", "--no-progress"])
    assert result.exit_code == 1
    assert "not an image Pillow can read" in result.output and str(tmp_path) in result.output

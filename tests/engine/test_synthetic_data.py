"""``--data synthetic`` is made per image, lazily, as a function of (seed, split, index) (issue 30 item 4)."""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner

from engine.data.batches import BatchSource
from engine.data.datasets import SyntheticImages, load_dataset, synthetic


def test_an_image_depends_on_seed_split_and_index_only():
    small = synthetic(10, seed=3, train=8, test=4, shape=(3, 8, 8))
    large = synthetic(10, seed=3, train=100, test=50, shape=(3, 8, 8))
    # the labels of the first images agree (one generator per split), and so do the images
    np.testing.assert_array_equal(small.y_train, large.y_train[:8])
    np.testing.assert_array_equal(small.x_train[[1, 5, 7]], large.x_train[[1, 5, 7]])
    assert small.x_train[2].dtype == np.float32 and small.x_train[2].shape == (3, 8, 8)
    assert not np.array_equal(small.x_train[0], small.x_test[0])  # the splits differ
    other = synthetic(10, seed=4, train=8, test=4, shape=(3, 8, 8))
    assert not np.array_equal(small.x_train[1], other.x_train[1])
    # an image is its class's pattern plus noise: two images of one class share the pattern
    label = int(small.y_train[0])
    pattern = np.random.default_rng([3, 7, 0, label]).standard_normal((3, 8, 8), dtype=np.float32)
    noise = np.random.default_rng([3, 7, 1, 0]).standard_normal((3, 8, 8), dtype=np.float32)
    np.testing.assert_array_equal(small.x_train[0], pattern + np.float32(2.0) * noise)


def test_nothing_but_labels_is_held():
    data = load_dataset("synthetic", image_size=224)
    assert isinstance(data.x_train, SyntheticImages) and data.x_train.shape == (256, 3, 224, 224)
    assert not [v for v in vars(data.x_train).values() if isinstance(v, np.ndarray) and v.nbytes > 256 * 8]


def test_batches_are_the_same_whoever_fills_them():
    data = synthetic(4, seed=1, train=12, test=4, shape=(3, 6, 6))
    source = BatchSource(data.x_train, data.y_train, data.mean, data.std, 4, shuffle=True, seed=5)
    first_x, first_y = np.empty((4, 3, 6, 6), np.float32), np.empty(4, np.int64)
    source.fill(1, 2, first_x, first_y)
    again_x, again_y = np.empty_like(first_x), np.empty_like(first_y)
    BatchSource(data.x_train, data.y_train, data.mean, data.std, 4, shuffle=True, seed=5).fill(1, 2, again_x, again_y)
    np.testing.assert_array_equal(first_x, again_x)
    chosen = source.indices(1, 2)
    np.testing.assert_array_equal(first_y, data.y_train[chosen])
    expected = (data.x_train[chosen] - data.mean.reshape(-1, 1, 1)) * (1 / data.std).reshape(-1, 1, 1)
    np.testing.assert_array_equal(first_x, expected.astype(np.float32))


def test_an_absurd_batch_size_is_refused_before_anything_is_allocated():
    from cli import main

    result = CliRunner().invoke(main, ["train", "--model", "cnn", "--data", "synthetic", "--batch-size", str(10**9)])
    assert result.exit_code == 2 and "--batch-size must be" in result.output
    result = CliRunner().invoke(main, ["train", "--model", "cnn", "--data", "synthetic", "--batch-size", "100000"])
    assert result.exit_code == 1
    assert "--batch-size must be between 1 and the training split's size (512)" in result.output


@pytest.mark.parametrize("index", [-1, 8])
def test_an_image_out_of_range_is_an_index_error(index):
    with pytest.raises(IndexError):
        synthetic(10, train=8, test=2, shape=(3, 4, 4)).x_train.image(index, np.empty((3, 4, 4), np.float32))


@pytest.mark.parametrize("parallel", [False, True])
def test_a_batch_is_its_images_bit_for_bit_with_each_class_pattern_drawn_once(monkeypatch, parallel):
    """``take`` draws each class's pattern once per call and copies it to that class's other rows: the bits of
    ``image`` row by row, whatever the order and the repeats; an index out of range is refused before any row."""
    from engine.data import datasets

    # parallel: the batch drawn on the threads (a 224 batch's size is past the threshold), each row its generators
    monkeypatch.setattr(datasets, "SYNTHETIC_PARALLEL_VALUES", 1 if parallel else 1 << 40)
    images = synthetic(3, seed=2, train=40, test=4, shape=(3, 9, 9)).x_train
    indices = np.array([5, 5, 17, 0, 39, 22, 5, 8, 13, 31, 2])
    rows = np.stack([images[int(i)] for i in indices])
    assert len(set(images.labels[indices].tolist())) < len(indices)  # repeated classes
    drawn = []
    real = np.random.default_rng
    monkeypatch.setattr(np.random, "default_rng", lambda seed: (drawn.append(tuple(seed)), real(seed))[1])
    out = np.full((len(indices), 3, 9, 9), np.nan, np.float32)
    images.take(indices, out)
    assert out.tobytes() == rows.tobytes()
    patterns = [s for s in drawn if s[2] == 0]
    assert sorted(patterns) == sorted({(2, 7, 0, int(images.labels[i])) for i in indices})
    with pytest.raises(IndexError):
        images.take(np.array([1, 40]), out[:2])

"""Data sets from tiny generated files, batches as functions of (seed, epoch, index), and prefetch."""

import gzip
import os

import numpy as np
import pytest

from engine.backend import get_backend
from engine.data import BatchSource, BatchStream, DataError, load_dataset
from engine.data.datasets import bilinear_matrix


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


# -- data sets --------------------------------------------------------------------------------------


def test_digits_are_resized_split_and_fixed(digits):
    assert digits.x_train.shape == (1438, 1, 32, 32) and digits.x_test.shape == (359, 1, 32, 32)
    assert digits.image_shape == (3, 32, 32) and digits.num_classes == 10
    again = load_dataset("digits")
    np.testing.assert_array_equal(again.y_test, digits.y_test)
    # statistics come from the training split only
    assert digits.mean[0] == pytest.approx(digits.x_train.astype(np.float64).mean(), rel=1e-6)


def test_bilinear_matrix_matches_torch_interpolate():
    torch = pytest.importorskip("torch")
    image = np.random.default_rng(0).random((8, 8))
    m = bilinear_matrix(8, 32)
    theirs = torch.nn.functional.interpolate(
        torch.from_numpy(image)[None, None], size=(32, 32), mode="bilinear", align_corners=False
    )[0, 0].numpy()
    np.testing.assert_allclose(m @ image @ m.T, theirs, atol=1e-12)


def write_cifar(folder, names, label_bytes, counts, rng):
    truth = {}
    for name, n in zip(names, counts):
        labels = rng.integers(0, 10, size=(n, label_bytes), dtype=np.uint8)
        pixels = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
        np.concatenate([labels, pixels], axis=1).tofile(os.path.join(folder, name))
        truth[name] = (labels[:, -1], pixels.reshape(n, 3, 32, 32))
    return truth


def test_cifar10_binary(tmp_path):
    names = [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]
    truth = write_cifar(tmp_path, names, 1, [2, 3, 1, 2, 2, 4], np.random.default_rng(1))
    data = load_dataset(f"cifar10:{tmp_path}")
    assert data.x_train.shape == (10, 3, 32, 32) and data.x_test.shape == (4, 3, 32, 32)
    np.testing.assert_array_equal(data.x_train[2:5], truth["data_batch_2.bin"][1])
    np.testing.assert_array_equal(data.y_test, truth["test_batch.bin"][0])


def test_cifar100_uses_the_fine_label(tmp_path):
    truth = write_cifar(tmp_path, ["train.bin", "test.bin"], 2, [3, 2], np.random.default_rng(2))
    data = load_dataset(f"cifar100:{tmp_path}")
    assert data.num_classes == 100
    np.testing.assert_array_equal(data.y_train, truth["train.bin"][0])


def test_truncated_cifar_names_the_file(tmp_path):
    names = [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]
    write_cifar(tmp_path, names, 1, [1] * 6, np.random.default_rng(3))
    path = tmp_path / "data_batch_3.bin"
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(DataError, match=r"data_batch_3\.bin: 3063 bytes is not a whole number of 3073-byte"):
        load_dataset(f"cifar10:{tmp_path}")
    os.remove(tmp_path / "test_batch.bin")
    path.write_bytes(b"")
    with pytest.raises(DataError, match="data_batch_3.bin"):
        load_dataset(f"cifar10:{tmp_path}")


def test_missing_cifar_file_and_directory(tmp_path):
    with pytest.raises(DataError, match=r"data_batch_1\.bin: file not found; expected CIFAR-10"):
        load_dataset(f"cifar10:{tmp_path}")
    with pytest.raises(DataError, match="does not exist"):
        load_dataset(f"cifar100:{tmp_path}/nowhere")


def idx_bytes(array, magic_type=0x08):
    header = bytes([0, 0, magic_type, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    return header + array.astype(np.uint8).tobytes()


def write_mnist(folder, compress=False):
    rng = np.random.default_rng(4)
    files = {}
    for prefix, n in (("train", 5), ("t10k", 3)):
        files[f"{prefix}-images-idx3-ubyte"] = rng.integers(0, 256, (n, 28, 28))
        files[f"{prefix}-labels-idx1-ubyte"] = rng.integers(0, 10, n)
    for name, array in files.items():
        if compress:
            with gzip.open(os.path.join(folder, name + ".gz"), "wb") as f:
                f.write(idx_bytes(array))
        else:
            (folder / name).write_bytes(idx_bytes(array))
    return files


@pytest.mark.parametrize("compress", [False, True])
def test_mnist_idx_padded_to_32(tmp_path, compress):
    files = write_mnist(tmp_path, compress)
    data = load_dataset(f"mnist:{tmp_path}")
    assert data.x_train.shape == (5, 1, 32, 32) and data.image_shape == (3, 32, 32)
    np.testing.assert_array_equal(data.x_train[:, 0, 2:30, 2:30], files["train-images-idx3-ubyte"])
    assert data.x_train[:, :, :2].max() == 0 and data.x_train[:, :, :, 30:].max() == 0
    np.testing.assert_array_equal(data.y_test, files["t10k-labels-idx1-ubyte"])


def test_mnist_errors_name_the_file(tmp_path):
    write_mnist(tmp_path)
    labels = tmp_path / "train-labels-idx1-ubyte"
    labels.write_bytes(labels.read_bytes()[:-1])
    with pytest.raises(DataError, match=r"train-labels-idx1-ubyte: header says shape \(5,\).*holds 4"):
        load_dataset(f"mnist:{tmp_path}")
    labels.write_bytes(b"\x00\x00\x0d\x01" + bytes(8))
    with pytest.raises(DataError, match="train-labels-idx1-ubyte: not an IDX file of unsigned bytes"):
        load_dataset(f"mnist:{tmp_path}")
    os.remove(labels)
    with pytest.raises(DataError, match="train-labels-idx1-ubyte: file not found"):
        load_dataset(f"mnist:{tmp_path}")


def test_npz_with_and_without_a_test_split(tmp_path):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((20, 3, 8, 8)).astype(np.float32)
    y = rng.integers(0, 4, 20)
    np.savez(tmp_path / "a.npz", x=x, y=y)
    data = load_dataset(f"npz:{tmp_path / 'a.npz'}")
    assert len(data.y_train) == 16 and len(data.y_test) == 4 and data.image_shape == (3, 8, 8)
    np.savez(tmp_path / "b.npz", x=x, y=y, x_test=x[:5], y_test=y[:5])
    data = load_dataset(f"npz:{tmp_path / 'b.npz'}", num_classes=6)
    assert len(data.y_train) == 20 and data.num_classes == 6
    np.testing.assert_array_equal(data.x_test, x[:5])


@pytest.mark.parametrize(
    "arrays,message",
    [
        ({"x": np.zeros((4, 3, 8, 8), np.float32)}, r"no array 'y' \(found \['x'\]\)"),
        ({"x": np.zeros((4, 3, 8, 8)), "y": np.zeros(4, int)}, "x is float64, expected float32"),
        ({"x": np.zeros((4, 8, 8), np.float32), "y": np.zeros(4, int)}, "expected 4 dimensions"),
        ({"x": np.zeros((4, 3, 8, 8), np.float32), "y": np.zeros(3, int)}, "4 images but y has 3 labels"),
        ({"x": np.zeros((4, 3, 8, 8), np.float32), "y": np.zeros(4)}, "expected N integer labels"),
        ({"x": np.zeros((4, 3, 8, 8), np.float32), "y": np.zeros(4, object)}, "pickled objects"),
    ],
)
def test_malformed_npz_is_named(tmp_path, arrays, message):
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)
    with pytest.raises(DataError, match=message) as info:
        load_dataset(f"npz:{path}")
    assert str(path) in str(info.value)


def test_missing_or_garbage_npz_and_unknown_specs(tmp_path):
    with pytest.raises(DataError, match="nothing.npz: file not found"):
        load_dataset(f"npz:{tmp_path}/nothing.npz")
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(DataError, match="junk.npz: not a readable .npz"):
        load_dataset(f"npz:{tmp_path}/junk.npz")
    with pytest.raises(DataError, match="unknown data set 'imagenet'"):
        load_dataset("imagenet")
    with pytest.raises(DataError, match="needs a location"):
        load_dataset("cifar10")
    with pytest.raises(DataError, match="labels up to 9, but --num-classes is 5"):
        load_dataset("digits", num_classes=5)


# -- batches ----------------------------------------------------------------------------------------


def source_for(data, **kwargs):
    options = dict(batch_size=32, channels=data.channels, shuffle=True, augment=False, seed=3)
    options.update(kwargs)
    return BatchSource(data.x_train, data.y_train, data.mean, data.std, **options)


def fill(source, epoch, index):
    x = np.empty(source.batch_shape, np.float32)
    y = np.empty(source.batch_size, np.int64)
    source.fill(epoch, index, x, y)
    return x, y


def test_batches_are_normalized_and_broadcast_to_three_channels(digits):
    source = source_for(digits, shuffle=False)
    x, y = fill(source, 0, 1)
    expected = (digits.x_train[32:64].astype(np.float32) - digits.mean[0]) / digits.std[0]
    for c in range(3):
        np.testing.assert_allclose(x[:, c : c + 1], expected, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(y, digits.y_train[32:64])


def test_batches_are_functions_of_seed_epoch_index(digits):
    source = source_for(digits, augment=True)
    a = fill(source, 2, 5)
    fill(source, 0, 0)  # whatever was filled before does not matter
    b = fill(source_for(digits, augment=True), 2, 5)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    assert not np.array_equal(source.order(0), source.order(1))
    assert sorted(source.order(1)) == list(range(len(digits.y_train)))


def test_augmentation_crops_and_flips_within_the_padding(digits):
    plain = source_for(digits, shuffle=False)
    augmented = source_for(digits, shuffle=False, augment=True)
    x, _ = fill(plain, 0, 0)
    xa, _ = fill(augmented, 0, 0)
    rng = np.random.default_rng([3, 0, 0, 1])
    offsets, flips = rng.integers(0, 9, size=(32, 2)), rng.random(32) < 0.5
    for i in (0, 7, 31):
        padded = np.pad(x[i], ((0, 0), (4, 4), (4, 4)))
        crop = padded[:, offsets[i, 0] : offsets[i, 0] + 32, offsets[i, 1] : offsets[i, 1] + 32]
        np.testing.assert_array_equal(xa[i], crop[:, :, ::-1] if flips[i] else crop)


def test_evaluation_batches_pad_the_last_one(digits):
    source = BatchSource(
        digits.x_test, digits.y_test, digits.mean, digits.std, 100, shuffle=False, drop_last=False
    )
    assert source.batches_per_epoch == 4 and source.valid_rows(3) == 59
    x, y = fill(source, 0, 3)
    np.testing.assert_array_equal(y[:59], digits.y_test[300:])
    np.testing.assert_array_equal(y[59:], digits.y_test[300:341])


def test_batch_larger_than_the_data_set_is_refused(digits):
    with pytest.raises(ValueError, match="batch size 5000 is larger than the data set"):
        source_for(digits, batch_size=5000)


# -- prefetch ---------------------------------------------------------------------------------------


def stream_contents(source, start, stop, depth):
    backend = get_backend("cpu")
    seen = []
    with BatchStream(source, backend, start, stop, depth=depth) as stream:
        for batch in stream:
            seen.append((batch.step, batch.epoch, batch.index, batch.x.copy(), batch.y.copy()))
        ring = stream.workspace.statistics()
    return seen, ring


@pytest.mark.parametrize("depth", [1, 3])
def test_prefetch_gives_the_same_batches_as_no_prefetch(digits, depth):
    source = source_for(digits, augment=True)
    steps = source.batches_per_epoch + 5  # across an epoch boundary
    serial, _ = stream_contents(source, 0, steps, depth=0)
    prefetched, ring = stream_contents(source, 0, steps, depth=depth)
    assert len(serial) == len(prefetched) == steps
    for a, b in zip(serial, prefetched):
        assert a[:3] == b[:3]
        np.testing.assert_array_equal(a[3], b[3])
        np.testing.assert_array_equal(a[4], b[4])
    # the ring was allocated once, exactly sized, and never spilled
    assert ring.block_allocations == 1 and ring.spilled_count == 0
    assert ring.generation == (steps - 1) // (depth + 1)  # laps around the ring


def test_a_stream_started_at_step_k_serves_what_an_uninterrupted_one_serves_there(digits):
    source = source_for(digits, augment=True)
    whole, _ = stream_contents(source, 0, 50, depth=2)
    tail, _ = stream_contents(source, 47, 50, depth=2)
    for a, b in zip(whole[47:], tail):
        assert a[:3] == b[:3]
        np.testing.assert_array_equal(a[3], b[3])


def test_a_producer_error_reaches_the_consumer(digits):
    source = source_for(digits)

    def broken(*args):
        raise OSError("disk went away")

    source.fill = broken
    with BatchStream(source, get_backend("cpu"), 0, 4, depth=2) as stream:
        with pytest.raises(OSError, match="disk went away"):
            next(stream)


def test_closing_early_stops_the_thread(digits):
    stream = BatchStream(source_for(digits), get_backend("cpu"), 0, 40, depth=2)
    next(stream)
    stream.close()
    assert not stream._thread.is_alive()


def test_digits_are_read_without_importing_scikit_learn():
    """scikit-learn's import costs ~80 MiB RSS for the whole run; its digits file is read directly instead."""
    import subprocess
    import sys

    code = ("import sys; from engine.data.datasets import digits_arrays; x, y = digits_arrays(); "
            "print(x.shape, y.shape, 'sklearn' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "(1797, 8, 8) (1797,) False"
    from sklearn.datasets import load_digits

    from engine.data.datasets import digits_arrays

    images, labels = digits_arrays()
    reference = load_digits()
    np.testing.assert_array_equal(images, reference.images)
    np.testing.assert_array_equal(labels, reference.target)

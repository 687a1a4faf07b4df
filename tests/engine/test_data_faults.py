"""Malformed data files, generated on the fly: every one is a DataError naming the file, never a
traceback of another kind, never an allocation the file's header made up."""

from __future__ import annotations

import gzip
import io
import os
import tracemalloc
import zipfile

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.data import DataError, load_dataset
from engine.data.datasets import read_idx
from tests.engine.test_data import idx_bytes, write_cifar, write_mnist


def idx_header(*shape: int, ndim: int | None = None) -> bytes:
    ndim = len(shape) if ndim is None else ndim
    return bytes([0, 0, 8, ndim]) + b"".join(int(d).to_bytes(4, "big") for d in shape)


@pytest.mark.parametrize(("header", "message"), [
    (idx_header(0, 28, 28), r"shape \(0, 28, 28\): no data"),
    (idx_header(2, 0, 28), r"no data"),
    (idx_header(0xFFFFFFFF, 28, 28), r"more than the 64 GiB"),
    (idx_header(5, 27, 28), r"items of \(27, 28\), expected \(28, 28\)"),
    (b"\x00\x00\x0d\x03" + idx_header(3, 28, 28)[4:], r"not an IDX file of unsigned bytes"),  # float32 IDX
])
@pytest.mark.parametrize("compress", [False, True])
def test_bad_idx_headers_are_refused_before_any_allocation(tmp_path, header, message, compress):
    path = tmp_path / "train-images-idx3-ubyte"
    data = header + bytes(3 * 28 * 28)
    if compress:
        path = tmp_path / "train-images-idx3-ubyte.gz"
        data = gzip.compress(data)
    path.write_bytes(data)
    tracemalloc.start()
    try:
        with pytest.raises(DataError, match=message):
            read_idx(str(path), 3, item_shape=(28, 28))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_a_gzip_bomb_is_inflated_only_as_far_as_its_header_says(tmp_path):
    path = tmp_path / "train-labels-idx1-ubyte.gz"
    with gzip.open(path, "wb", compresslevel=1) as f:  # header: 10 labels; then 256 MiB of zeros
        f.write(idx_header(10))
        f.write(bytes(10))
        zeros = bytes(1 << 24)
        for _ in range(16):
            f.write(zeros)
    assert path.stat().st_size < 2 << 20
    tracemalloc.start()
    try:
        with pytest.raises(DataError, match="more data after the 10 bytes"):
            read_idx(str(path), 1)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20  # was: the whole 256 MiB inflated before the header was read


def test_a_corrupt_deflate_stream_is_a_data_error(tmp_path):
    good = gzip.compress(idx_header(100) + bytes(range(100)))
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0xFF
    path = tmp_path / "t10k-labels-idx1-ubyte.gz"
    path.write_bytes(bytes(bad))
    with pytest.raises(DataError, match="t10k-labels-idx1-ubyte.gz: cannot read"):
        read_idx(str(path)[:-3], 1)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(0, 200), flip=st.integers(0, 199), value=st.integers(0, 255), compress=st.booleans())
def test_any_damage_to_an_idx_file_is_a_data_error_or_the_right_array(tmp_path_factory, cut, flip, value, compress):
    labels = np.arange(180, dtype=np.uint8) % 10
    raw = bytearray(idx_bytes(labels))  # 8 header bytes + 180
    if flip < len(raw):
        raw[flip] = value
    raw = bytes(raw[: len(raw) - cut])
    folder = tmp_path_factory.mktemp("idx")
    path = folder / ("labels.gz" if compress else "labels")
    path.write_bytes(gzip.compress(raw) if compress else raw)
    try:
        array = read_idx(str(path)[:-3] if compress else str(path), 1)
    except DataError as exc:
        assert "labels" in str(exc)
        return
    assert array.tobytes() == raw[8:]  # accepted only when the header and the data agree


def test_mnist_and_cifar_test_labels_are_checked_at_load(tmp_path):
    write_mnist(tmp_path)
    labels = tmp_path / "t10k-labels-idx1-ubyte"
    labels.write_bytes(idx_bytes(np.array([1, 2, 10])))
    with pytest.raises(DataError, match="label 10 found, expected labels 0..9"):
        load_dataset(f"mnist:{tmp_path}")
    cifar = tmp_path / "cifar"
    cifar.mkdir()
    names = [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]
    write_cifar(cifar, names, 1, [1] * 6, np.random.default_rng(0))
    test = cifar / "test_batch.bin"
    raw = bytearray(test.read_bytes())
    raw[0] = 200
    test.write_bytes(bytes(raw))
    with pytest.raises(DataError, match="label 200 found"):
        load_dataset(f"cifar10:{cifar}")


def _npz(path, **arrays):
    np.savez(path, **arrays)
    return f"npz:{path}"


@pytest.mark.parametrize(("arrays", "message"), [
    (dict(x=np.zeros((4, 3, 8, 8), np.float32), y=np.array([0, 1, 2, 1_000_000_000])), "label 1000000000"),
    (dict(x=np.zeros((4, 3, 0, 0), np.float32), y=np.array([0, 1, 0, 1])), r"shape \(3, 0, 0\)"),
    (dict(x=np.full((4, 3, 2, 2), np.nan, np.float32), y=np.array([0, 1, 0, 1])), "NaN or infinite"),
    (dict(x=np.zeros((4, 3, 2, 2), np.float32), y=np.array([0, 1, 0, 1]),
          x_test=np.zeros((2, 3, 2, 2), np.float32), y_test=np.array([0, 7])), None),
])
def test_npz_labels_sizes_and_values_are_checked(tmp_path, arrays, message):
    spec = _npz(tmp_path / "d.npz", **arrays)
    if message is None:  # a test label above the training labels widens the classes: accepted, in range
        assert load_dataset(spec).num_classes == 8
        return
    with pytest.raises(DataError, match=message):
        load_dataset(spec)


def test_an_npz_member_declaring_terabytes_is_refused_from_its_header(tmp_path):
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, {"descr": "<f4", "fortran_order": False,
                                                   "shape": (1 << 20, 3, 1024, 1024)})
    path = tmp_path / "bomb.npz"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("x.npy", buffer.getvalue() + bytes(64))
        archive.writestr("y.npy", buffer.getvalue())
    with pytest.raises(DataError, match="more than the 64 GiB"):
        load_dataset(f"npz:{path}")
    os.remove(path)

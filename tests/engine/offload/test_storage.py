"""SwapStorage: positional IO with checksums, page-cache drops, and a directory that never outlives us."""

import fcntl
import mmap
import os
import stat
import subprocess
import sys

import numpy as np
import pytest

from engine.offload.storage import (
    DIR_PREFIX,
    OffloadStorageError,
    SwapChecksumError,
    SwapRecord,
    SwapStorage,
    parse_bytes,
    remove_stale_directories,
)


def pack(arrays, start=0, aligned=True):
    """The records of ``arrays`` laid out 64-byte aligned from file offset ``start``, and one buffer holding them.

    ``aligned``: a page-aligned buffer of whole pages (the O_DIRECT path); else an odd-sized NumPy one.
    """
    records, offset = [], start
    for i, a in enumerate(arrays):
        records.append(SwapRecord(offset, a.nbytes, "layer1.0.conv1", f"tensor{i}"))
        offset += (a.nbytes + 63) // 64 * 64
    size = offset - start
    if aligned:
        size = (size + 4095) // 4096 * 4096
        buffer = np.frombuffer(mmap.mmap(-1, size), dtype=np.uint8)
    else:
        buffer = np.zeros(size + 8, dtype=np.uint8)[8:]  # an address that is not page aligned
    for record, a in zip(records, arrays):
        buffer[record.file_offset - start:record.file_offset - start + a.nbytes] = a.reshape(-1).view(np.uint8)
    return records, buffer


def unpack(records, buffer, like, start=0):
    return [buffer[r.file_offset - start:r.file_offset - start + r.nbytes].view(a.dtype).reshape(a.shape)
            for r, a in zip(records, like)]


@pytest.mark.parametrize("aligned", [True, False], ids=["direct", "buffered"])
def test_roundtrip_private_directory_and_cleanup(tmp_path, aligned):
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(s).astype(np.float32) for s in [(3, 5), (7,), (2, 2, 9)]]
    with SwapStorage(1 << 16, str(tmp_path)) as storage:
        assert stat.S_IMODE(os.stat(storage.path).st_mode) == 0o700
        assert os.path.basename(storage.path).startswith(f"{DIR_PREFIX}{os.getpid()}-")
        assert os.path.getsize(storage.file_path) == 1 << 16  # preallocated
        records, buffer = pack(arrays, start=4096, aligned=aligned)
        storage.write(records, buffer, 4096)
        buffer[:] = 0
        storage.read(records, buffer, 4096)
        for a, b in zip(arrays, unpack(records, buffer, arrays, start=4096)):
            np.testing.assert_array_equal(a, b)
        assert storage.bytes_written == storage.bytes_read == sum(a.nbytes for a in arrays)
        if not aligned:
            assert storage.direct_bytes == 0
        elif storage.direct_fd >= 0:  # the file system takes O_DIRECT: the page cache was bypassed
            assert storage.direct_bytes == 2 * buffer.nbytes
        path = storage.path
    assert not os.path.exists(path)


def test_checksum_mismatch_names_layer_and_tensor(tmp_path):
    arrays = [np.arange(100, dtype=np.float32), np.ones(10, dtype=np.float32)]
    storage = SwapStorage(1 << 14, str(tmp_path))
    try:
        records, buffer = pack(arrays)
        storage.write(records, buffer, 0)
        with open(storage.file_path, "r+b") as f:  # flip one byte of the second record
            f.seek(records[1].file_offset + 5)
            byte = f.read(1)
            f.seek(records[1].file_offset + 5)
            f.write(bytes([byte[0] ^ 0xFF]))
            f.flush()
            os.fsync(f.fileno())
        with pytest.raises(SwapChecksumError, match=r"layer 'layer1.0.conv1', tensor 'tensor1'"):
            storage.read(records, buffer, 0)
    finally:
        storage.close()


def _flip(storage, offset):
    with open(storage.file_path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
        f.flush()
        os.fsync(f.fileno())


def test_verify_modes_header_sample_stale_step_and_off(tmp_path):
    """header: a flip inside the sample (first 4 KiB) and a record from another step are errors, a flip
    between the sampled pieces is not; off: nothing is checked; full (above): every byte."""
    array = np.arange(64 * 1024, dtype=np.float32)  # 256 KiB: the sample is a small part of it
    for verify in ("header", "off"):
        with SwapStorage(1 << 20, str(tmp_path), verify=verify) as storage:
            records, buffer = pack([array])
            storage.write(records, buffer, 0, step=3)
            storage.read(records, buffer, 0, step=3)
            _flip(storage, 4096 + 2048)  # between the first 4 KiB and the first sampled piece after them
            storage.read(records, buffer, 0, step=3)
            _flip(storage, 100)  # inside the first 4 KiB
            if verify == "header":
                with pytest.raises(SwapChecksumError, match=r"layer 'layer1.0.conv1', tensor 'tensor0'"):
                    storage.read(records, buffer, 0, step=3)
                with pytest.raises(SwapChecksumError, match="step 4.*step 3"):
                    storage.read(records, buffer, 0, step=4)
            else:
                storage.read(records, buffer, 0, step=4)
    with pytest.raises(ValueError, match="verify must be one of full, header, off"):
        SwapStorage(4096, str(tmp_path), verify="crc")


def test_reading_what_was_never_written_is_an_error(tmp_path):
    with SwapStorage(1 << 14, str(tmp_path)) as storage:
        records, buffer = pack([np.zeros(4, np.float32)])
        with pytest.raises(OffloadStorageError, match="before it was ever written"):
            storage.read(records, buffer, 0)


def test_records_must_lie_inside_the_file_and_the_buffer(tmp_path):
    with SwapStorage(4096, str(tmp_path)) as storage:
        records, buffer = pack([np.zeros(4, np.float32)])
        with pytest.raises(ValueError, match="past the end of the swap file"):
            storage.write(records, buffer, 4096)
        with pytest.raises(ValueError, match="outside the buffer"):
            storage.write([SwapRecord(8192, 16, "fc1", "fc1:out")], buffer, 0)


def test_unwritable_directory_is_refused(tmp_path):
    if os.geteuid() == 0:  # root writes anywhere permissions allow; /sys refuses new entries
        target = "/sys"
    else:
        target = tmp_path / "locked"
        target.mkdir(mode=0o500)
    with pytest.raises(OffloadStorageError, match="not writable.*--offload-dir"):
        SwapStorage(4096, str(target))


def test_missing_directory_and_file_instead_of_directory(tmp_path):
    with pytest.raises(OffloadStorageError, match="does not exist"):
        SwapStorage(4096, str(tmp_path / "nope"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(OffloadStorageError, match="not a directory"):
        SwapStorage(4096, str(tmp_path / "file"))


def test_free_space_is_checked_against_the_plan(tmp_path):
    with pytest.raises(OffloadStorageError, match="swap space.*free"):
        SwapStorage(1 << 62, str(tmp_path))
    assert not [p for p in os.listdir(tmp_path) if p.startswith(DIR_PREFIX)]


def _stale_layout(path, held: bool = False):
    """A directory as a dead (or, with ``held``, a live) run leaves it: lock and swap.bin."""
    path.mkdir()
    (path / "swap.bin").write_bytes(b"old")
    (path / "lock").write_bytes(b"")
    if not held:
        return None
    fd = os.open(path / "lock", os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another open file description: conflicts with ours
    return fd


def test_stale_directories_are_removed_by_free_lock_and_layout_never_by_name(tmp_path):
    dead = tmp_path / f"{DIR_PREFIX}999999999-abc"
    _stale_layout(dead)
    live = tmp_path / f"{DIR_PREFIX}1-xyz"  # pid 1 "alive", but what matters is the held lock
    live_fd = _stale_layout(live, held=True)
    dead_pid_live_lock = tmp_path / f"{DIR_PREFIX}999999998-other-namespace"
    other_ns_fd = _stale_layout(dead_pid_live_lock, held=True)
    notes = tmp_path / f"{DIR_PREFIX}12345-notes"  # a user's own directory with our prefix
    notes.mkdir()
    (notes / "notes.txt").write_text("mine")
    extra = tmp_path / f"{DIR_PREFIX}999999997-extra"  # our layout plus a file we did not write
    _stale_layout(extra)
    (extra / "results.csv").write_text("keep")
    no_lock = tmp_path / f"{DIR_PREFIX}999999996-nolock"  # an older engine's directory: not provably ours
    no_lock.mkdir()
    (no_lock / "swap.bin").write_bytes(b"x")
    target = tmp_path / "elsewhere"
    _stale_layout(target)
    (tmp_path / f"{DIR_PREFIX}999999995-link").symlink_to(target)
    try:
        with SwapStorage(4096, str(tmp_path)) as storage:
            assert not dead.exists()
            assert sorted(os.listdir(storage.path)) == ["lock", "swap.bin"]
            for kept in (live, dead_pid_live_lock, notes, extra, no_lock, target):
                assert kept.exists(), kept
            assert (notes / "notes.txt").read_text() == "mine" and (target / "swap.bin").exists()
            # a second run must not take a live run's directory either
            assert remove_stale_directories(str(tmp_path)) == []
            assert os.path.exists(storage.path)
    finally:
        os.close(live_fd)
        os.close(other_ns_fd)
    removed = sorted(remove_stale_directories(str(tmp_path)))  # their runs ended: the locks are free now
    assert removed == sorted([str(live), str(dead_pid_live_lock)])
    assert not live.exists() and not dead_pid_live_lock.exists()
    assert notes.exists() and extra.exists() and no_lock.exists() and target.exists()


def test_a_killed_run_leaves_a_directory_the_next_run_removes(tmp_path):
    code = ("import os, sys; from engine.offload.storage import SwapStorage; "
            f"s = SwapStorage(4096, {str(tmp_path)!r}); print(s.path, flush=True); os._exit(0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert os.path.isdir(out)  # os._exit: no atexit, as after SIGKILL
    with SwapStorage(4096, str(tmp_path)):
        assert not os.path.exists(out)


def test_cleanup_after_an_exception(tmp_path):
    with pytest.raises(RuntimeError, match="boom"):
        with SwapStorage(4096, str(tmp_path)):
            raise RuntimeError("boom")
    assert not [p for p in os.listdir(tmp_path) if p.startswith(DIR_PREFIX)]


def _on_tmpfs(path) -> bool:
    path = os.path.realpath(path)
    best, fstype = "", ""
    with open("/proc/mounts") as mounts:
        for line in mounts:
            _, mount_point, kind = line.split()[:3]
            if path.startswith(mount_point) and len(mount_point) > len(best):
                best, fstype = mount_point, kind
    return fstype in ("tmpfs", "ramfs")


def test_written_bytes_leave_the_page_cache(tmp_path):
    if _on_tmpfs(tmp_path):
        pytest.skip("tmpfs keeps files in memory by design")
    big = np.ones(1 << 20, dtype=np.float32)  # 4 MiB
    for aligned in (True, False):  # O_DIRECT, and buffered + fdatasync + DONTNEED
        with SwapStorage(2 * big.nbytes, str(tmp_path)) as storage:
            records, buffer = pack([big], aligned=aligned)
            storage.write(records, buffer, 0)
            assert storage.page_cache_bytes() < big.nbytes // 4


def test_delay_hook_sees_every_operation(tmp_path):
    calls = []
    with SwapStorage(4096, str(tmp_path), delay=lambda op, n: calls.append((op, n))) as storage:
        records, buffer = pack([np.ones(16, np.float32)])
        storage.write(records, buffer, 0)
        storage.read(records, buffer, 0)
    assert calls == [("write", 4096), ("read", 4096)]


@pytest.mark.parametrize("text, expected", [("4096", 4096), ("256MB", 256_000_000), ("1.5GiB", 3 << 29), ("2k", 2000)])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


def test_parse_bytes_rejects_nonsense():
    with pytest.raises(ValueError, match="as a size"):
        parse_bytes("lots")

"""The swap storage under injected faults (tests/faults.py): each is a named error or, for a short
write, no error and the same bytes back."""

from __future__ import annotations

import errno

import numpy as np
import pytest

from engine.errors import UserError
from engine.offload.storage import OffloadStorageError, SwapChecksumError, SwapStorage
from tests import faults
from tests.engine.offload.test_storage import pack


@pytest.fixture
def inject():
    installed = []

    def install(op, at, kind, sticky=True):
        installed.append(faults.inject(op, at, kind, sticky))
        return installed[-1]

    yield install
    faults.remove()


@pytest.mark.parametrize("aligned", [True, False], ids=["direct", "buffered"])
def test_a_short_write_is_completed(tmp_path, inject, aligned):
    data = np.arange(5000, dtype=np.float32)
    fault = inject("write", 1, "short", sticky=False)
    with SwapStorage(1 << 16, str(tmp_path)) as storage:
        records, buffer = pack([data], aligned=aligned)
        storage.write(records, buffer, 0)
        back = np.zeros_like(buffer)
        storage.read(records, back, 0)
    assert fault.injected == 1 and np.array_equal(back, buffer)


def test_no_space_mid_write_is_a_named_user_error(tmp_path, inject):
    inject("write", 1, "ENOSPC")
    with SwapStorage(1 << 16, str(tmp_path)) as storage:
        records, buffer = pack([np.ones(100, np.float32)])
        with pytest.raises(OffloadStorageError, match="no space left writing the swap file") as caught:
            storage.write(records, buffer, 0)
    assert isinstance(caught.value, UserError)


def test_a_write_that_moves_nothing_is_named(tmp_path, inject):
    inject("write", 1, "zero")
    with SwapStorage(1 << 16, str(tmp_path)) as storage:
        records, buffer = pack([np.ones(100, np.float32)], aligned=False)
        with pytest.raises(OffloadStorageError, match="write returned 0"):
            storage.write(records, buffer, 0)


def test_an_io_error_on_read_reaches_the_caller_as_eio(tmp_path, inject):
    with SwapStorage(1 << 16, str(tmp_path)) as storage:
        records, buffer = pack([np.ones(100, np.float32)])
        storage.write(records, buffer, 0)
        inject("read", 1, "EIO")
        with pytest.raises(OSError) as caught:
            storage.read(records, np.zeros_like(buffer), 0)
    assert caught.value.errno == errno.EIO  # the scheduler turns it into a DiskFaultError (one line)


@pytest.mark.parametrize("aligned", [True, False], ids=["direct", "buffered"])
def test_a_corrupt_read_is_a_checksum_error(tmp_path, inject, aligned):
    with SwapStorage(1 << 16, str(tmp_path)) as storage:
        records, buffer = pack([np.ones(1000, np.float32)], aligned=aligned)
        storage.write(records, buffer, 0)
        fault = inject("read", 1, "corrupt")
        with pytest.raises(SwapChecksumError, match="checksum mismatch reading layer"):
            storage.read(records, np.zeros_like(buffer), 0)
    assert fault.injected >= 1

"""SwapStorage: the file the offload scheduler writes layer windows to, and reads them back from.

Why it looks like this:

* One private directory (mode 0700) under ``--offload-dir``: nobody else can read a model's
  activations. The run holds an exclusive ``flock`` on the ``lock`` file inside it for as long as the
  storage is open; the kernel drops it when the process dies, however it dies. A later run removes a
  directory only when its layout is exactly ours (``lock`` and ``swap.bin``, nothing else), it belongs
  to the same user, and its lock is free. The name alone decides nothing: cleanup by name and pid once
  deleted a user's own ``engine-offload-12345-notes/`` and a live run's directory from another PID
  namespace sharing /tmp (issue 14).
* One preallocated file (``posix_fallocate``): a full disk is an error before training starts, not a
  short write in the middle of a step. Records sit at offsets the plan chose once.
* ``os.pwritev`` / ``os.preadv`` straight between the file and the arena's memory (memoryviews of the
  NumPy arrays): no intermediate copies, no seek, safe from two threads at once. One call per layer:
  the caller hands one contiguous buffer covering all of a layer's records.
* A checksum per record, verified on read (``verify="full"``, the default): a flipped bit on disk is
  an error naming the layer and the tensor, never a silently wrong gradient. XXH3-64 (``xxhash``), not
  zlib's CRC-32: measured here (one thread, other jobs running, median of 15): zlib.crc32 0.8-5 GiB/s,
  ``crc32c`` (SSE4.2 hardware CRC32C) 18-27 GiB/s, XXH3-64 16 GiB/s on 32 MiB (memory bound, a tie)
  and 46-51 GiB/s on 64 KiB-1 MiB (in cache, twice CRC32C). ``google-crc32c`` was dropped: its
  ``value`` wants ``bytes``, i.e. a copy of every record. Both release the GIL on large buffers, so
  what they cost on two cores is CPU taken from the kernels' parallel half: at batch 32 zlib's CRC
  was most of the IO threads' ~95 ms per step. ``verify="header"`` checks, per record, the length,
  the step it was written in (a stale record is an error), the unit and tensor, and a hash of a
  sample (first and last 4 KiB and 16 evenly spaced 256-byte pieces): it catches the scheduler
  reading the wrong record and most torn writes for ~1% of the bytes hashed. ``verify="off"`` checks
  nothing (what nntrainer and DeepSpeed's NVMe path do). In full mode the caller may take over the
  byte check of some records (``check_elsewhere``): the offload scheduler sums the sources of ReLU
  rebuilds in the two passes that read them anyway (``scheduler._FusedCheck``), where the bytes are
  in registers, instead of this storage hashing them once they are out of the caches (MobileNetV2
  batch 128: the IO threads' CPU 90-98 -> 35 ms per step).
* The page cache must not keep what we "freed" (it is memory too). Page-aligned buffers go through an
  ``O_DIRECT`` descriptor, which bypasses the cache (and copies nothing in the kernel); anything else,
  or a file system without O_DIRECT (tmpfs), goes through the buffered descriptor followed by
  ``fdatasync`` + ``posix_fadvise(POSIX_FADV_DONTNEED)`` (and DONTNEED after each read).
* The directory is removed at close, at interpreter exit and when the ``with`` block ends in an
  exception. Never from a signal handler: that once took a lock the main thread could hold (a hang)
  and closed descriptors under a running IO thread; signals only set a flag (``engine.signals``) and
  the run unwinds through ``close()`` between two steps.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import logging
import os
import shutil
import stat
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from engine.errors import DiskFaultError, UserError
from engine.report import format_bytes

log = logging.getLogger("engine.offload")

DIR_PREFIX = "engine-offload-"
PAGE = 4096
LOCK_NAME = "lock"
SWAP_NAME = "swap.bin"
OUR_LAYOUT = frozenset({LOCK_NAME, SWAP_NAME})

VERIFY_MODES = ("full", "header", "off")
SAMPLE_EDGE = 4096  # header mode hashes the first and last 4 KiB of a record ...
SAMPLE_PIECES = 16  # ... and this many evenly spaced pieces
SAMPLE_PIECE = 256

DelayHook = Callable[[str, int], None]
"""Called as ``delay(operation, nbytes)`` before each read ("read") or write ("write"): tests slow the disk with it."""


class OffloadStorageError(UserError, RuntimeError):
    """The swap directory or file cannot be used (unwritable, no space); the message says what to do."""


class SwapChecksumError(OffloadStorageError, DiskFaultError):
    """A record read back from the swap file is not what was written."""


@dataclass(frozen=True)
class SwapRecord:
    """One tensor's bytes in the swap file: where, how many, and whose (for error messages)."""

    file_offset: int
    nbytes: int
    layer: str
    tensor: str


def byte_view(array: Any) -> memoryview:
    """The bytes of a C-contiguous host array, without copying (what pwritev/preadv take)."""
    array = np.asarray(array)
    if not array.flags.c_contiguous:
        raise ValueError("swap I/O needs C-contiguous arrays")
    return memoryview(array.reshape(-1).view(np.uint8))


def checksum(piece: memoryview) -> int:
    """XXH3-64 of a record's bytes (the GIL is released inside for large buffers)."""
    return xxhash.xxh3_64_intdigest(piece)


def sample_checksum(piece: memoryview) -> int:
    """XXH3-64 of a fixed sample of a record: its first and last 4 KiB and 16 evenly spaced 256-byte pieces."""
    n = piece.nbytes
    if n <= 2 * SAMPLE_EDGE + SAMPLE_PIECES * SAMPLE_PIECE:
        return checksum(piece)
    state = xxhash.xxh3_64()
    state.update(piece[:SAMPLE_EDGE])
    step = (n - 2 * SAMPLE_EDGE) // SAMPLE_PIECES
    for i in range(SAMPLE_PIECES):
        start = SAMPLE_EDGE + i * step
        state.update(piece[start:start + SAMPLE_PIECE])
    state.update(piece[n - SAMPLE_EDGE:])
    return state.intdigest()


@dataclass(frozen=True)
class RecordHeader:
    """What ``verify`` remembers of a record when it is written, checked when it is read back."""

    nbytes: int
    step: int
    layer: str
    tensor: str
    digest: int | None  # XXH3-64 of all bytes (full), of the sample (header), 0 (off); None: the caller checks it


def page_align(nbytes: int) -> int:
    return (int(nbytes) + PAGE - 1) // PAGE * PAGE


class SwapStorage:
    """A private directory holding one preallocated swap file of ``capacity_bytes``.

    ``write(records, buffers)`` and ``read(records, buffers)`` move one batch of records (one layer's
    tensors) with one positional system call each; records of a batch must be consecutive in the file
    in the order given, padding between them is allowed and skipped. ``verify`` is "full", "header"
    or "off" (module docstring).
    """

    kind = "swap file"  # the swap tier, as the run's summary names it (staging.PinnedStorage: pinned host memory)

    def __init__(self, capacity_bytes: int, directory: str | None = None, delay: DelayHook | None = None,
                 direct: bool = True, verify: str = "full"):
        if verify not in VERIFY_MODES:
            raise ValueError(f"offload verify must be one of {', '.join(VERIFY_MODES)}, got {verify!r}")
        self.verify = verify
        self.capacity_bytes = page_align(max(int(capacity_bytes), PAGE))
        self.delay = delay
        base = os.path.abspath(directory or tempfile.gettempdir())
        self.base = base
        self._headers: dict[int, RecordHeader] = {}
        self.bytes_written = 0
        self.bytes_read = 0
        self.bytes_hashed = 0  # of bytes_written + bytes_read, those this storage hashed (full mode)
        # records (file offsets) whose full check the caller does where the bytes are in cache anyway
        # (``check_elsewhere``): full mode neither hashes them on write nor verifies them on read
        self.checked_elsewhere: frozenset[int] = frozenset()
        self.direct_bytes = 0  # of bytes_written + bytes_read, those that bypassed the page cache
        self.fd = -1
        self.direct_fd = -1
        self.lock_fd = -1
        self.path: str | None = None
        self.file_path: str | None = None
        check_directory(base)
        remove_stale_directories(base)
        check_free_space(base, self.capacity_bytes)
        try:
            self.path = tempfile.mkdtemp(prefix=f"{DIR_PREFIX}{os.getpid()}-", dir=base)  # mode 0700
            _register(self)
            # the lock first, the swap file second: a directory without swap.bin is never cleaned up,
            # so nobody can take it between our creating the lock file and locking it
            self.lock_fd = _open_locked(os.path.join(self.path, LOCK_NAME))
            self.file_path = os.path.join(self.path, SWAP_NAME)
            self.fd = os.open(self.file_path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
            _preallocate(self.fd, self.capacity_bytes, base)
        except OSError as exc:
            self.close()
            raise OffloadStorageError(
                f"cannot create the swap file under {base!r}: {exc.strerror or exc}; "
                f"choose a writable directory with enough space with --offload-dir"
            ) from exc
        except BaseException:
            self.close()
            raise
        if direct and hasattr(os, "O_DIRECT"):
            try:
                self.direct_fd = os.open(self.file_path, os.O_RDWR | os.O_DIRECT | getattr(os, "O_CLOEXEC", 0))
            except OSError:  # tmpfs and some other file systems refuse O_DIRECT: the buffered path remains
                self.direct_fd = -1
        log.debug("swap storage %s: %d bytes preallocated, O_DIRECT %s", self.file_path, self.capacity_bytes,
                  "on" if self.direct_fd >= 0 else "off")

    # -- I/O ------------------------------------------------------------------------------------

    def check_elsewhere(self, file_offsets: frozenset[int]) -> None:
        """In full mode, the records starting at these file offsets are checked by the caller (the
        offload scheduler sums them where a kernel reads them anyway): this storage still checks their
        length, step and names, not their bytes. The caller must check every byte it reads back."""
        self.checked_elsewhere = frozenset(file_offsets)

    def _digest(self, piece: memoryview) -> int:
        if self.verify == "full":
            self.bytes_hashed += piece.nbytes
            return checksum(piece)
        return sample_checksum(piece) if self.verify == "header" else 0

    def write(self, records: Sequence[SwapRecord], buffer: Any, file_offset: int, step: int = 0) -> None:
        """Write ``buffer`` (holding ``records`` at their offsets relative to ``file_offset``) in one call.

        Each record's header (length, ``step``, names, digest) is remembered; the bytes do not stay in
        the page cache.
        """
        view = byte_view(buffer)
        pieces = self._pieces(records, view, file_offset)
        if self.delay is not None:
            self.delay("write", view.nbytes)
        for record, piece in zip(records, pieces):
            elsewhere = self.verify == "full" and record.file_offset in self.checked_elsewhere
            self._headers[record.file_offset] = RecordHeader(record.nbytes, step, record.layer, record.tensor,
                                                             None if elsewhere else self._digest(piece))
        if self._direct_ok(view, file_offset):
            done = _full_io(os.pwritev, self.direct_fd, view, file_offset, "write", self.file_path, direct=True)
            self.direct_bytes += done
        else:
            done = 0
        if done < view.nbytes:  # unaligned (or a short direct write): buffered, then out of the cache
            _full_io(os.pwritev, self.fd, view[done:], file_offset + done, "write", self.file_path)
            os.fdatasync(self.fd)
            os.posix_fadvise(self.fd, file_offset, view.nbytes, os.POSIX_FADV_DONTNEED)
        self.bytes_written += sum(r.nbytes for r in records)

    def read(self, records: Sequence[SwapRecord], buffer: Any, file_offset: int, step: int = 0) -> None:
        """Read ``buffer``'s span from ``file_offset`` in one call and verify every record (``verify``).

        ``step`` is the step the records must have been written in (header and full modes): reading a
        record left from an earlier step is an error, not stale values.
        """
        view = byte_view(buffer)
        pieces = self._pieces(records, view, file_offset)
        for record in records:
            header = self._headers.get(record.file_offset)
            if header is None:
                raise OffloadStorageError(
                    f"layer {record.layer!r}, tensor {record.tensor!r}: read before it was ever written"
                )
            if self.verify != "off" and (header.nbytes, header.step, header.layer, header.tensor) != (
                    record.nbytes, step, record.layer, record.tensor):
                raise SwapChecksumError(
                    f"layer {record.layer!r}, tensor {record.tensor!r} ({record.nbytes} bytes, step {step}): the "
                    f"swap file holds layer {header.layer!r}, tensor {header.tensor!r} ({header.nbytes} bytes, "
                    f"step {header.step}) at offset {record.file_offset}: the offload schedule read a record it did "
                    f"not write"
                )
        if self.delay is not None:
            self.delay("read", view.nbytes)
        if self._direct_ok(view, file_offset):
            done = _full_io(os.preadv, self.direct_fd, view, file_offset, "read", self.file_path, direct=True)
            self.direct_bytes += done
        else:
            done = 0
        if done < view.nbytes:
            _full_io(os.preadv, self.fd, view[done:], file_offset + done, "read", self.file_path)
            os.posix_fadvise(self.fd, file_offset, view.nbytes, os.POSIX_FADV_DONTNEED)
        if self.verify == "off":
            self.bytes_read += sum(r.nbytes for r in records)
            return
        for record, piece in zip(records, pieces):
            expected = self._headers[record.file_offset].digest
            if expected is not None and self._digest(piece) != expected:
                raise SwapChecksumError(
                    f"checksum mismatch reading layer {record.layer!r}, tensor {record.tensor!r} "
                    f"({record.nbytes} bytes at offset {record.file_offset} of {self.file_path}): the swap file "
                    f"was changed or the disk is failing; training cannot continue with these values"
                )
        self.bytes_read += sum(r.nbytes for r in records)

    def _pieces(self, records: Sequence[SwapRecord], view: memoryview, file_offset: int) -> list[memoryview]:
        if file_offset < 0 or file_offset + view.nbytes > self.capacity_bytes:
            raise ValueError(f"swap IO of {view.nbytes} bytes at {file_offset} runs past the end of the swap file "
                             f"({self.capacity_bytes} bytes)")
        pieces = []
        for record in records:
            start = record.file_offset - file_offset
            if start < 0 or start + record.nbytes > view.nbytes:
                raise ValueError(f"layer {record.layer!r}, tensor {record.tensor!r}: record outside the buffer")
            pieces.append(view[start:start + record.nbytes])
        return pieces

    def _direct_ok(self, view: memoryview, file_offset: int) -> bool:
        """O_DIRECT needs the address, the length and the file offset aligned to the block size."""
        if self.direct_fd < 0 or view.nbytes == 0 or file_offset % PAGE or view.nbytes % PAGE:
            return False
        return np.frombuffer(view, dtype=np.uint8).ctypes.data % PAGE == 0

    # -- measurement ----------------------------------------------------------------------------

    def page_cache_bytes(self) -> int:
        """Bytes of the swap file the kernel holds in its page cache now (mmap + mincore)."""
        if self.fd < 0:
            return 0
        return file_page_cache_bytes(self.fd, self.capacity_bytes)

    # -- cleanup --------------------------------------------------------------------------------

    def close(self) -> None:
        """Close the file and remove the directory (idempotent); the lock is released last."""
        for fd in (self.fd, self.direct_fd):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.fd = self.direct_fd = -1
        path, self.path = self.path, None
        if path is not None:
            shutil.rmtree(path, ignore_errors=True)
            log.debug("swap storage %s removed", path)
        if self.lock_fd >= 0:
            try:
                os.close(self.lock_fd)
            except OSError:
                pass
            self.lock_fd = -1
        _unregister(self)

    @property
    def closed(self) -> bool:
        return self.path is None

    def __enter__(self) -> SwapStorage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # the last resort; close() is the way
        try:
            self.close()
        except Exception:
            pass


# -- directory checks -----------------------------------------------------------------------------


def check_directory(base: str) -> None:
    """Raise OffloadStorageError unless ``base`` is an existing directory we may create entries in."""
    if not os.path.exists(base):
        raise OffloadStorageError(f"offload directory {base!r} does not exist: create it or choose another "
                                  f"with --offload-dir")
    if not os.path.isdir(base):
        raise OffloadStorageError(f"offload directory {base!r} is not a directory: choose one with --offload-dir")
    if not os.access(base, os.W_OK | os.X_OK):
        raise OffloadStorageError(f"offload directory {base!r} is not writable: choose a writable one with "
                                  f"--offload-dir")
    try:  # root passes os.access everywhere; a read-only file system still refuses: find out now
        probe = tempfile.mkdtemp(prefix=f"{DIR_PREFIX}{os.getpid()}-probe-", dir=base)  # stale-cleanable
        os.rmdir(probe)
    except OSError as exc:
        raise OffloadStorageError(f"offload directory {base!r} is not writable ({exc.strerror or exc}): choose a "
                                  f"writable one with --offload-dir") from exc


def check_free_space(base: str, nbytes: int) -> None:
    """Raise OffloadStorageError when the file system of ``base`` cannot hold ``nbytes`` more."""
    free = shutil.disk_usage(base).free
    if free < nbytes:
        raise OffloadStorageError(
            f"offload needs {format_bytes(nbytes)} of swap space but {base!r} has {format_bytes(free)} free: "
            f"free some space, choose another --offload-dir, or raise --offload-n (fewer layers go to disk)"
        )


def remove_stale_directories(base: str) -> list[str]:
    """Remove swap directories left by runs that died; returns them.

    A directory is removed only if all hold: its name starts with ``DIR_PREFIX``; it is a real
    directory (not a symlink) of this user; it holds exactly ``lock`` and ``swap.bin`` as regular
    files; and we can take its lock (its run is gone: the kernel released the lock). Only those two
    files are unlinked and then the empty directory removed, so anything else stays, whatever happens.
    """
    removed = []
    try:
        names = os.listdir(base)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(DIR_PREFIX):
            continue
        path = os.path.join(base, name)
        try:
            info = os.lstat(path)
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
                continue
            entries = frozenset(os.listdir(path))
            if entries != OUR_LAYOUT or not all(
                stat.S_ISREG(os.lstat(os.path.join(path, e)).st_mode) for e in entries
            ):
                continue
            fd = os.open(os.path.join(path, LOCK_NAME), os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # held: a live run (in any PID namespace) owns it
            if frozenset(os.listdir(path)) != OUR_LAYOUT:
                continue
            os.unlink(os.path.join(path, SWAP_NAME))
            os.unlink(os.path.join(path, LOCK_NAME))
            os.rmdir(path)
        except OSError:
            continue
        finally:
            os.close(fd)
        log.info("removed stale offload directory %s (its lock was free)", path)
        removed.append(path)
    return removed


def _open_locked(lock_path: str) -> int:
    """Create ``lock_path`` and hold an exclusive flock on it; returns the descriptor."""
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _preallocate(fd: int, nbytes: int, base: str) -> None:
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise OffloadStorageError(f"no space left under {base!r} for the {format_bytes(nbytes)} swap file: "
                                      f"choose another --offload-dir or raise --offload-n") from exc
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):  # file systems without fallocate: reserve by size
            os.ftruncate(fd, nbytes)
        else:
            raise


def _full_io(call: Callable[..., int], fd: int, view: memoryview, offset: int, what: str, path: Any,
             direct: bool = False) -> int:
    """pwritev/preadv until every byte moved (both may return short counts); returns the bytes moved.

    On the O_DIRECT descriptor a short count would leave the rest unaligned: stop, the caller finishes
    through the buffered one.
    """
    done = 0
    while done < view.nbytes:
        try:
            moved = call(fd, [view[done:]], offset + done)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise OffloadStorageError(f"no space left writing the swap file {path}: choose another "
                                          f"--offload-dir") from exc
            raise
        if moved <= 0:
            raise OffloadStorageError(f"swap file {path}: {what} returned {moved} with {view.nbytes - done} "
                                      f"bytes to go")
        done += moved
        if direct and done % PAGE:
            break
    return done


# -- page cache measurement -----------------------------------------------------------------------


def file_page_cache_bytes(fd: int, length: int) -> int:
    """How many bytes of the file's first ``length`` are in the page cache (mincore over a mapping)."""
    import ctypes
    import mmap

    length = min(int(length), os.fstat(fd).st_size)
    if length <= 0:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    address = libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if address in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap of the swap file failed")
    try:
        pages = (length + PAGE - 1) // PAGE
        vec = (ctypes.c_ubyte * pages)()
        if libc.mincore(ctypes.c_void_p(address), length, vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore failed")
        resident = int(np.count_nonzero(np.frombuffer(vec, dtype=np.uint8) & 1))
    finally:
        libc.munmap(ctypes.c_void_p(address), length)
    return resident * PAGE


def parse_bytes(text: str) -> int:
    """'256MB', '1.5GiB', '4096' -> bytes (decimal and binary suffixes)."""
    units = {"": 1, "B": 1, "K": 1000, "KB": 1000, "KIB": 1024, "M": 1000**2, "MB": 1000**2, "MIB": 1024**2,
             "G": 1000**3, "GB": 1000**3, "GIB": 1024**3}
    cleaned = str(text).strip().upper().replace(" ", "")
    number = cleaned.rstrip("KMGIB")
    suffix = cleaned[len(number):]
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"cannot read {text!r} as a size: write e.g. 256MB, 1GiB or 4096") from None
    if suffix not in units or not value >= 0 or value * units[suffix] >= 2**62:  # NaN, inf, exabytes
        raise ValueError(f"cannot read {text!r} as a size: write e.g. 256MB, 1GiB or 4096")
    return int(value * units[suffix])


# -- cleanup at exit and on signals ---------------------------------------------------------------

_open_storages: list[SwapStorage] = []
_registry_lock = threading.Lock()
_handlers_installed = False


def _register(storage: SwapStorage) -> None:
    with _registry_lock:
        _open_storages.append(storage)
    _install_cleanup_handlers()


def _unregister(storage: SwapStorage) -> None:
    with _registry_lock:
        if storage in _open_storages:
            _open_storages.remove(storage)


def open_bases() -> list[str]:
    """The directories holding this process's open swap directories (where a dead partner's may be)."""
    with _registry_lock:
        return sorted({os.path.dirname(storage.path) for storage in _open_storages if getattr(storage, "path", None)})


def cleanup_all() -> None:
    """Remove every swap directory this process still has open (exit and signal path)."""
    with _registry_lock:
        storages = list(_open_storages)
    for storage in storages:
        storage.close()


def _install_cleanup_handlers() -> None:
    """Remove what is still open at interpreter exit. No signal handlers: see the module docstring; a
    process killed outright leaves a directory whose lock is free, which the next run removes."""
    global _handlers_installed
    if _handlers_installed:
        return
    _handlers_installed = True
    atexit.register(cleanup_all)

"""Numba's on-disk kernel cache: where it really is, and a damaged entry compiled again, not a traceback.

Two faults a user meets (issue 31, class 6), each seen before this module existed:

- A ``NUMBA_CACHE_DIR`` that cannot be written (a read-only mount, a shared pre-warmed cache, a
  directory of another user). Numba does not say so: its locator tries to create a temporary file
  there, fails, and silently falls back to the next place it can write (``__pycache__`` beside the
  kernels, then the user's cache directory), so the directory the user named is ignored entirely,
  while the engine printed "cached in NUMBA_CACHE_DIR, later runs start at once". When no place is
  writable (an installed package under a read-only ``$HOME``), Numba raises ``RuntimeError: cannot
  cache function ... no locator available`` while the kernel modules are imported: no command ran.
  ``locate()`` asks Numba's own locators, in Numba's order, before any kernel is decorated; when none
  can be written, the kernels are cached in a private temporary directory removed at exit (they
  compile on every run, and ``where()`` says so).
- A truncated entry: a ``.nbi`` index or ``.nbc`` data file cut short (a compile killed while the file
  system had not written it all, a full disk, a copy of a cache interrupted). Numba unpickles it and
  the ``UnpicklingError``/``EOFError`` reaches the user as a traceback from the first call of that
  kernel. ``guard()`` makes a file that cannot be read a cache miss: the file is removed, one
  warning line names it, and Numba compiles the kernel and writes the entry again. The files are
  Numba's own (written by this process's Numba or an earlier one), never user input.

The patch is on Numba's ``IndexDataCacheFile`` (the only class that reads those files): applied once,
by ``kernels.cpu`` before its kernels are defined, it covers every cached kernel of the process.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass

log = logging.getLogger(__name__)

KERNEL_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "elementwise.py")
"""A kernel module: every kernel module of kernels/cpu lives in this directory, so one stands for all."""


@dataclass(frozen=True)
class CacheLocation:
    """Where Numba caches the kernels, and what the user should know about it.

    ``directory``: the folder Numba writes (``NUMBA_CACHE_DIR`` itself when it works). ``persistent``:
    False when no cache location can be written and the kernels go to a temporary directory (they
    compile on every run). ``problem``: one sentence naming what cannot be written and what to do, or
    None when the cache is where the user asked."""

    directory: str
    persistent: bool = True
    problem: str | None = None


def _probe() -> None:  # a function for Numba's locators: they read its source line only
    pass


def _writable(path: str) -> str | None:
    """None when a file can be created in ``path`` (made if missing), else the reason (strerror)."""
    try:
        os.makedirs(path, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def locate() -> CacheLocation:
    """Where Numba will cache the kernels of kernels/cpu, found with Numba's own locators, in its order."""
    from numba.core import config
    from numba.core.caching import CacheImpl

    requested = os.path.abspath(config.CACHE_DIR) if config.CACHE_DIR else None
    for cls in CacheImpl._locator_classes:
        locator = cls.from_function(_probe, KERNEL_SOURCE)
        if locator is None:
            continue
        path = os.path.abspath(locator.get_cache_path())
        if requested is not None and (path == requested or path.startswith(requested + os.sep)):
            return CacheLocation(requested)
        if requested is None:
            return CacheLocation(path)
        reason = _writable(requested) or "not usable"
        return CacheLocation(path, True, (
            f"NUMBA_CACHE_DIR={requested} cannot be written ({reason}): Numba ignores it and caches the "
            f"kernels in {path}; make it writable, or unset NUMBA_CACHE_DIR"))
    reasons = []
    if requested is not None:
        reasons.append(f"NUMBA_CACHE_DIR={requested}: {_writable(requested) or 'not usable'}")
    beside = os.path.join(os.path.dirname(KERNEL_SOURCE), "__pycache__")
    reasons.append(f"{beside}: {_writable(beside) or 'not usable'}")
    return CacheLocation("", False, (
        f"no kernel cache can be written ({'; '.join(reasons)}; nor the user's cache directory): the "
        "kernels are compiled again on every run; set NUMBA_CACHE_DIR to a writable directory"))


_LOCATION: CacheLocation | None = None


def where() -> CacheLocation:
    """The cache location now: Numba's locators are asked again (a test or a tool may change
    ``NUMBA_CACHE_DIR`` at run time), except when ``guard()`` found none writable and made its own."""
    return _LOCATION if _LOCATION is not None and not _LOCATION.persistent else locate()


def _discard(path: str, exc: BaseException, what: str) -> None:
    """Remove a cache file that cannot be read, with one warning line that names it."""
    try:
        os.unlink(path)
        done = "removed it; the kernel is compiled again"
    except FileNotFoundError:
        done = "the kernel is compiled again"
    except OSError as error:
        done = f"could not remove it ({error.strerror}); the kernel is compiled again"
    log.warning("kernel cache: %s %s cannot be read (%s: %s); %s", what, path, type(exc).__name__, exc, done)


def _install_patch() -> None:
    from numba.core.caching import IndexDataCacheFile

    if getattr(IndexDataCacheFile, "_engine_guarded", False):
        return
    read_index = IndexDataCacheFile._load_index

    def _load_index(self):  # a damaged index is an empty one (its file removed, so save() starts afresh)
        try:
            return read_index(self)
        except Exception as exc:  # noqa: BLE001  any unreadable index: truncated, garbage, wrong types
            _discard(self._index_path, exc, "index")
            return {}

    def load(self, key):  # Numba's load(), with a data file that cannot be unpickled as a miss
        data_name = self._load_index().get(key)
        if data_name is None:
            return None
        try:
            return self._load_data(data_name)
        except OSError:
            return None  # removed while the index still refers to it (Numba's own rule)
        except Exception as exc:  # noqa: BLE001  truncated or corrupt data: compile again
            _discard(self._data_path(data_name), exc, "entry")
            return None

    IndexDataCacheFile._load_index = _load_index
    IndexDataCacheFile.load = load
    IndexDataCacheFile._engine_guarded = True


def guard() -> CacheLocation:
    """Before the kernels are defined: patch the cache reader, and find (or make) a writable cache."""
    global _LOCATION
    _install_patch()
    if _LOCATION is not None:
        return _LOCATION
    location = locate()
    if not location.persistent:
        from numba.core import config

        folder = tempfile.mkdtemp(prefix="engine-kernel-cache-")
        atexit.register(shutil.rmtree, folder, True)
        config.CACHE_DIR = folder  # read by Numba's locator when each kernel is decorated, after this
        os.environ["NUMBA_CACHE_DIR"] = folder  # and the warm-up's worker processes compile into it too
        location = CacheLocation(folder, False, location.problem)
    _LOCATION = location
    return location


__all__ = ["CacheLocation", "guard", "locate", "where"]

"""Fault injection for the swap storage: ENOSPC, EIO, short writes and corrupt reads at a chosen call.

``inject(op, at, kind)`` replaces the ``os`` module as ``engine.offload.storage`` sees it by a proxy
whose ``pwritev`` ("write") or ``preadv`` ("read") misbehaves on the ``at``-th call (1-based) and on
every call after it when ``sticky``. Everything else passes through to the real ``os``. The storage
code itself is unchanged: what is tested is exactly what runs.

Kinds:
- ``ENOSPC``, ``EIO``: the call raises ``OSError`` with that errno (a full disk, a failing one);
- ``short``: a write moves only half its bytes (legal for pwritev: the storage must loop for the rest);
- ``zero``: a write returns 0 (a disk that stopped accepting data);
- ``corrupt``: a read succeeds and then one byte of what it read is flipped (bit rot, a changed file).

From the command line (for subprocess tests): ``ENGINE_FAULT=op:at:kind python -m tests.faults train ...``
installs the fault and then runs the ``engine`` command line with the remaining arguments;
``ENGINE_STOP_AT_STEP=k`` sends the process a real SIGTERM during step k-1, so the run stops with
exactly k steps done (a signal at a chosen moment, without racing a timer).
"""

from __future__ import annotations

import errno
import os
import sys
import threading
from typing import Any

KINDS = ("ENOSPC", "EIO", "short", "zero", "corrupt")


class FaultyOS:
    """Stands in for ``os`` inside ``engine.offload.storage``."""

    def __init__(self, real: Any, op: str, at: int, kind: str, sticky: bool = True):
        if op not in ("write", "read") or kind not in KINDS or at < 1:
            raise ValueError(f"fault {op}:{at}:{kind}: op is write or read, at >= 1, kind one of {KINDS}")
        self._real, self.op, self.at, self.kind, self.sticky = real, op, at, kind, sticky
        self.calls = {"write": 0, "read": 0}
        self.injected = 0
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def _hit(self, op: str) -> bool:
        with self._lock:
            self.calls[op] += 1
            n = self.calls[op]
        hit = op == self.op and (n == self.at or (self.sticky and n > self.at))
        if hit:
            self.injected += 1
        return hit

    def pwritev(self, fd: int, buffers: list, offset: int) -> int:
        if not self._hit("write"):
            return self._real.pwritev(fd, buffers, offset)
        if self.kind in ("ENOSPC", "EIO"):
            code = getattr(errno, self.kind)
            raise OSError(code, os.strerror(code))
        if self.kind == "zero":
            return 0
        if self.kind == "short":
            view = memoryview(buffers[0]).cast("B")
            half = max(len(view) // 2 // 4096 * 4096, min(len(view), 1))  # keeps O_DIRECT's alignment
            return self._real.pwritev(fd, [view[:half]], offset)
        return self._real.pwritev(fd, buffers, offset)

    def preadv(self, fd: int, buffers: list, offset: int) -> int:
        if not self._hit("read"):
            return self._real.preadv(fd, buffers, offset)
        if self.kind in ("ENOSPC", "EIO"):
            code = getattr(errno, self.kind)
            raise OSError(code, os.strerror(code))
        moved = self._real.preadv(fd, buffers, offset)
        if self.kind == "corrupt" and moved > 0:
            view = memoryview(buffers[0]).cast("B")
            view[0] ^= 0xFF
        return moved


def inject(op: str, at: int, kind: str, sticky: bool = True) -> FaultyOS:
    """Install a fault into ``engine.offload.storage``; ``remove()`` puts the real ``os`` back."""
    import engine.offload.storage as storage

    real = storage.os._real if isinstance(storage.os, FaultyOS) else storage.os
    faulty = FaultyOS(real, op, at, kind, sticky)
    storage.os = faulty
    return faulty


def remove() -> None:
    import engine.offload.storage as storage

    if isinstance(storage.os, FaultyOS):
        storage.os = storage.os._real


def stop_at_step(k: int) -> None:
    """SIGTERM to ourselves inside step k-1: the handler records it, the loop stops before step k."""
    import signal

    from engine.train import Trainer

    train_step = Trainer.train_step

    def signalling_step(self: Any, batch: Any) -> Any:
        if batch.step == k - 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return train_step(self, batch)

    Trainer.train_step = signalling_step


def main() -> None:
    spec = os.environ.get("ENGINE_FAULT", "")
    if spec:
        op, at, kind = spec.split(":")
        inject(op, int(at), kind, sticky=kind != "short")
    if os.environ.get("ENGINE_STOP_AT_STEP"):
        stop_at_step(int(os.environ["ENGINE_STOP_AT_STEP"]))
    import cli

    sys.argv[0] = "engine"
    cli.main()


if __name__ == "__main__":
    main()

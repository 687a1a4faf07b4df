"""Stop signals that only set a flag: the training loop stops at the next step boundary.

Why a flag and nothing else: the old handler (in the swap storage) removed the swap directory from
inside the signal handler, taking a lock the main thread could be holding (a hang), closing file
descriptors an IO thread was using (``Bad file descriptor``), and it was installed even when the
signal had been ignored by the parent (a background job of a script), so an ignored SIGINT still tore
the run down. A Python signal handler runs in the main thread between two bytecodes, anywhere, so the
only safe thing it can do is record: here it assigns one attribute. The ``Trainer`` reads it before
every step; the normal ``finally`` paths then close the swap storage, and the command line writes the
last completed step as a checkpoint and exits with the shell's code, 128 + the signal number.

Rules:
- SIGINT, SIGTERM, SIGHUP (terminal closed) and SIGQUIT all stop the run the same way.
- A signal that was ignored when ``install()`` ran stays ignored (``nohup``, ``cmd &`` in a script).
- Only the first signal is kept; later ones change nothing (SIGKILL remains for an impatient user).
- A signal during ``--save`` does not interrupt the write: the checkpoint is completed and renamed,
  so there is never a half-written temporary file to clean up.
- A lost terminal or a closed output pipe (``engine.streams``) stops the run as SIGHUP or SIGPIPE
  would, through ``record``: the same flag, the same path.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

from engine.errors import Interrupted, stopped_by

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


class StopSignals:
    """Records the first stop signal in ``received``; ``restore()`` puts the previous handlers back."""

    def __init__(self, signals: tuple[int, ...] = STOP_SIGNALS):
        self.signals = tuple(signals)
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> StopSignals:
        """Take over every stop signal that is not ignored (from the main thread only; elsewhere a no-op)."""
        if threading.current_thread() is not threading.main_thread():
            return self
        from engine import streams

        streams.on_lost(self.record)
        for signum in self.signals:
            previous = signal.getsignal(signum)
            if previous == signal.SIG_IGN:
                continue  # ignored by whoever started us: it stays ignored
            self._previous[signum] = previous
            signal.signal(signum, self._record)
        return self

    def _record(self, signum: int, frame: Any) -> None:
        self.record(signum)

    def record(self, signum: int) -> None:
        """Stop as ``signum`` would (the first stop wins): a signal handler's, or a lost output stream's."""
        if self.received is None:  # one attribute store: no locks, no I/O, nothing that can block
            self.received = signum

    @property
    def installed(self) -> tuple[int, ...]:
        """The signals this object handles (those not ignored at install time)."""
        return tuple(self._previous)

    def check(self, where: str, outcome: str = "nothing was trained or saved") -> None:
        """Raise ``Interrupted`` if a stop signal has arrived (``where``: when; ``outcome``: what was kept)."""
        if self.received is not None:
            raise Interrupted(f"{stopped_by(self.received, where)}; {outcome}", self.received)

    def restore(self) -> None:
        """Put back the handlers that were there before ``install()``."""
        if threading.current_thread() is not threading.main_thread():
            return
        from engine import streams

        streams.on_lost(None)
        for signum, previous in self._previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    def __enter__(self) -> StopSignals:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.restore()


__all__ = ["STOP_SIGNALS", "StopSignals"]

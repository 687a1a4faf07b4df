"""The user's terminal and pipes never decide the fate of a training run (issue 31).

What happened before: a progress bar or a log line written to a terminal that had gone away (SIGHUP,
then EIO on every write) raised ``OSError`` inside a step, which the fault path took for a swap disk
fault ("disk I/O failed … check the disk"): no checkpoint, exit 120 or 1 instead of 129. A closed pipe
(``engine train … | head -1``, a pager quit mid-run) ended the run with exit 1 and without its
``--save``; a full disk under a redirected stderr turned a SIGTERM's exit 143 into 1 (the error line
itself failed to print). Exit 120 is CPython's own: flushing ``sys.stdout`` at exit failed.

What happens now: ``guard_standard_streams()`` wraps ``sys.stdout`` and ``sys.stderr`` (every writer
goes through them: rich's console and its refresh thread, logging, click) in ``GuardedStream``. The
first write or flush that fails makes the stream *lost*: its file descriptor is pointed at /dev/null
(so no later flush, ours or the interpreter's at exit, can fail again) and every later write is
dropped. Then, by the cause:

- EPIPE (the reader of a pipe is gone): the run stops like a signal, SIGPIPE (exit 141, 128 + 13),
  the last completed step saved where ``--save`` was given. Not "keep training silently": in a
  pipeline the shell waits for every member, so a user who quit the pager would wait, without a line
  of output, for the whole run.
- EIO, ENXIO (the terminal is gone; SIGHUP usually arrives too): the run stops like SIGHUP (exit 129),
  the weights saved the same way.
- anything else (ENOSPC, EDQUOT, EFBIG: a full disk under a redirected stdout/stderr): the stream is
  dropped and the run goes on; a log that cannot be written is no reason to lose hours of training.

The stop goes through ``StopSignals`` (``engine.signals``): one attribute store, read by the Trainer
between steps, so a lost terminal takes exactly the path of a signal.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

LOST_TERMINAL = signal.SIGHUP
"""The signal a lost terminal stops the run as (its exit code is 129, as when the terminal hangs up)."""

CLOSED_PIPE = signal.SIGPIPE
"""The signal a closed output pipe stops the run as (exit 141, what a process killed by SIGPIPE gives)."""

_STOP_ERRNOS = {errno.EPIPE: CLOSED_PIPE, errno.EIO: LOST_TERMINAL, errno.ENXIO: LOST_TERMINAL}

_on_lost: Callable[[int], None] | None = None  # where a lost stream's stop goes: StopSignals.record


def on_lost(callback: Callable[[int], None] | None) -> None:
    """Send the stop a lost stream asks for (a signal number) to ``callback`` (None: to nobody)."""
    global _on_lost
    _on_lost = callback


def stop_signal_for(error: OSError) -> int | None:
    """The signal a failed write stops the run as (module docstring), None to drop the stream and go on."""
    if isinstance(error, BrokenPipeError):
        return CLOSED_PIPE
    return _STOP_ERRNOS.get(error.errno or 0)


class GuardedStream:
    """A text stream whose write and flush never raise ``OSError``: the first failure loses the stream."""

    def __init__(self, stream: Any, name: str):
        self._stream = stream
        self.name_for_messages = name  # "stdout", "stderr"
        self.lost: OSError | None = None
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        if self.lost is not None:
            return len(text)
        try:
            return self._stream.write(text)
        except OSError as error:
            self._lose(error)
            return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        if self.lost is not None:
            return
        try:
            self._stream.flush()
        except OSError as error:
            self._lose(error)

    def _lose(self, error: OSError) -> None:
        with self._lock:
            if self.lost is not None:
                return
            self.lost = error
            try:  # whatever is still buffered, and CPython's flush at exit, now go to /dev/null
                devnull = os.open(os.devnull, os.O_WRONLY)
                try:
                    os.dup2(devnull, self._stream.fileno())
                finally:
                    os.close(devnull)
            except (OSError, ValueError, AttributeError):
                pass  # no descriptor (a test's StringIO): dropping the writes is enough
        signum = stop_signal_for(error)
        if signum is not None and _on_lost is not None:
            _on_lost(signum)

    def isatty(self) -> bool:
        return self.lost is None and self._stream.isatty()

    def __getattr__(self, name: str) -> Any:  # encoding, fileno, buffer, errors, ...: the stream's own
        return getattr(self._stream, name)


def guard_standard_streams() -> tuple[GuardedStream, GuardedStream]:
    """Wrap ``sys.stdout`` and ``sys.stderr`` once (idempotent); returns the two guards."""
    guards = []
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if not isinstance(stream, GuardedStream):
            stream = GuardedStream(stream, name)
            setattr(sys, name, stream)
        guards.append(stream)
    return guards[0], guards[1]


def lost_streams() -> list[GuardedStream]:
    """The standard streams lost so far (for the summary's note that output was dropped)."""
    return [s for s in (sys.stdout, sys.stderr) if isinstance(s, GuardedStream) and s.lost is not None]


__all__ = ["CLOSED_PIPE", "LOST_TERMINAL", "GuardedStream", "guard_standard_streams", "lost_streams", "on_lost",
           "stop_signal_for"]

"""The errors a user can cause, as one hierarchy the command line catches in one place.

Why one hierarchy: a bad option, a malformed file, a full disk or a signal are not bugs, so they must
end in one line that names the problem and the fix, a non-zero exit and no traceback; everything else
(a bug) keeps its traceback. Before this module each command caught a list of module errors at each
call site and about a third of 112 bad inputs tried still ended in a traceback (issue 14), because
the lists were never complete. Now every module's user-facing error derives from ``UserError``
(``DataError``, ``CheckpointError``, ``OffloadStorageError``, ``TrainingDiverged``, ...), and
``cli.EngineGroup`` turns any of them into ``Error: <message>`` with ``exit_code``.

This module imports nothing from the engine, so the lowest layers (storage, data) can use it.
"""

from __future__ import annotations

import signal


class UserError(Exception):
    """An error the user can fix: the message names the problem and what to do; no traceback is shown."""

    exit_code: int = 1


class OptionError(UserError, ValueError):
    """A command-line option is out of range or not a finite number."""

    exit_code = 2  # click's exit code for usage errors


class OutputPathError(UserError):
    """An output path (--save, --summary-json, --memory-log, ...) cannot be written."""


class OutputWriteError(UserError):
    """An output file stopped being writable during the run (--memory-log on a disk that filled)."""


class DiskFaultError(UserError):
    """The disk failed under a running step (no space, I/O error, a record read back changed)."""


class Interrupted(UserError):
    """The run stopped on a signal; the exit code is the shell's convention, 128 + the signal number."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum
        self.exit_code = 128 + int(signum)


def signal_name(signum: int) -> str:
    """'SIGTERM' for 15 (the number itself for a signal Python has no name for)."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


STOP_MEANINGS = {
    signal.SIGHUP: "the terminal was closed or lost",
    signal.SIGPIPE: "the output pipe was closed: its reader, e.g. head or a pager, exited",
}
"""What a stop means where it is not a kill: a lost terminal and a closed output pipe stop a run as
SIGHUP and SIGPIPE would (engine.streams)."""


def stopped_by(signum: int, when: str) -> str:
    """"stopped by SIGHUP after step 3 of 10 (the terminal was closed or lost)": the start of the one line."""
    meaning = STOP_MEANINGS.get(signum)
    return f"stopped by {signal_name(signum)} {when}" + (f" ({meaning})" if meaning else "")


__all__ = ["DiskFaultError", "Interrupted", "OptionError", "OutputPathError", "OutputWriteError", "UserError",
           "signal_name", "stopped_by"]

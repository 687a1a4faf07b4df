"""Option and output-path checks that run before anything starts.

Why here and not in click's types: click parses ``--lr nan`` and ``--offload-budget inf`` as valid
floats, and a NaN learning rate trained to the end and wrote NaN weights over a good ``--save`` file
(issue 14). Every numeric option is therefore checked as a number (finite, in its range) by
``number(...)``, a click callback whose error is an ``OptionError`` (a ``UserError``: one line, exit 2).
The checks are plain functions so the engine's own entry points (the Trainer, the schedule) use them
too, without click.

Output paths are checked before the first step: ``--save``, ``--summary-json``, ``--memory-log`` and
``--memory-plot`` used to be first touched after training, so a path under a regular file or on a full
disk lost the whole run's weights. ``check_output_path`` creates and removes a probe file next to the
target (root passes ``os.access`` even on a read-only mount, so asking is not enough) and compares the
free space with the size the file will have.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

from engine.errors import OptionError, OutputPathError

MAX_CLASSES = 100_000
"""Largest class count accepted: ImageNet-21k has 21,841; a typo such as 1000000000 would ask for terabytes."""

MAX_BATCH_SIZE = 1 << 20
MAX_IMAGE_SIZE = 4096


def check_number(
    option: str,
    value: float | int,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
) -> float | int:
    """``value`` when it is a finite number in [low, high] (open ends where asked); else OptionError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise OptionError(f"{option} must be a number, got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise OptionError(f"{option} must be a finite number, got {value}")
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and (value >= high if high_open else value > high)
    if too_low or too_high:
        raise OptionError(f"{option} must be {_describe_range(low, high, low_open, high_open)}, got {_format(value)}")
    return value


def _describe_range(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    parts = []
    if low is not None:
        parts.append(f"{'greater than' if low_open else 'at least'} {_format(low)}")
    if high is not None:
        parts.append(f"{'less than' if high_open else 'at most'} {_format(high)}")
    return " and ".join(parts)


def _format(value: float | int) -> str:
    return f"{value:,}" if isinstance(value, int) else f"{value:g}"


def number(
    low: float | None = None, high: float | None = None, *, low_open: bool = False, high_open: bool = False
) -> Callable[[Any, Any, Any], Any]:
    """A click option callback running ``check_number`` under the option's own name (None passes)."""

    def callback(ctx: Any, param: Any, value: Any) -> Any:
        if value is None:
            return None
        name = param.opts[0] if getattr(param, "opts", None) else str(getattr(param, "name", "option"))
        return check_number(name, value, low=low, high=high, low_open=low_open, high_open=high_open)

    return callback


def parse_window(text: str | int | None, option: str = "--offload-n") -> int | str | None:
    """``--offload-n``: a positive integer, 'auto', or None; OptionError (exit 2, like any bad option) else."""
    if text is None:
        return None
    value = str(text).strip().lower()
    if value == "auto":
        return "auto"
    try:
        window = int(value)
    except ValueError:
        raise OptionError(f"{option} must be a positive integer or 'auto', got {text!r}") from None
    if window < 1:
        raise OptionError(f"{option} must be at least 1 (layers kept in memory), got {window}")
    return window


def check_num_classes(num_classes: int, where: str = "--num-classes") -> int:
    """2..MAX_CLASSES classes (a classifier of one class has nothing to learn)."""
    if num_classes < 2 or num_classes > MAX_CLASSES:
        raise OptionError(f"{where}: {num_classes} classes; expected between 2 and {MAX_CLASSES:,}")
    return num_classes


# -- output paths -----------------------------------------------------------------------------------


def check_output_path(option: str, path: str, nbytes: int = 0) -> str:
    """Raise OutputPathError unless ``path`` can be written now: its directory exists (or can be created),
    is a directory, accepts a new file, ``path`` itself is not a directory, and ``nbytes`` fit.

    Nothing is left behind: the probe file is removed and missing directories are not created here.
    """
    target = os.path.abspath(path)
    if os.path.isdir(target):
        raise OutputPathError(f"{option} {path}: is a directory; give a file name")
    directory = os.path.dirname(target)
    existing = directory
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise OutputPathError(f"{option} {path}: {existing} is a file, not a directory; choose another path")
    try:  # in the nearest existing directory: missing ones are created when the file is written
        fd, probe = tempfile.mkstemp(prefix=".engine-probe-", dir=existing)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise OutputPathError(
            f"{option} {path}: cannot write in {existing} ({exc.strerror or exc}); choose a writable directory"
        ) from None
    if nbytes:
        free = shutil.disk_usage(existing).free
        if free < nbytes:
            raise OutputPathError(
                f"{option} {path}: needs {nbytes / 2**20:.1f} MiB but {existing} has {free / 2**20:.1f} MiB free; "
                "free some space or choose another path"
            )
    return target


def write_output(option: str, path: str, text: str) -> None:
    """Write ``text`` to ``path`` (atomically: temporary file, then rename), or OutputPathError."""
    target = os.path.abspath(path)
    temporary = None
    try:
        if not os.path.exists(target) or os.path.isfile(target):
            fd, temporary = tempfile.mkstemp(prefix=".engine-output-", dir=os.path.dirname(target))
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            os.chmod(temporary, 0o644)
            os.replace(temporary, target)
            temporary = None
        else:  # a device or a pipe (/dev/stdout): write in place
            with open(target, "w", encoding="utf-8") as f:
                f.write(text)
    except OSError as exc:
        raise OutputPathError(f"{option} {path}: cannot write ({exc.strerror or exc}); choose another path") from None
    finally:
        if temporary is not None and os.path.exists(temporary):
            os.unlink(temporary)


__all__ = ["MAX_BATCH_SIZE", "write_output", "MAX_CLASSES", "MAX_IMAGE_SIZE", "check_num_classes", "check_number",
           "check_output_path", "number"]

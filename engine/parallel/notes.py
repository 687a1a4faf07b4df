"""The launch directory of ``--workers K``: small notes between the launcher, the supervisors and the ranks.

``engine.parallel.comm.launch`` makes one private directory per job (``ENGINE_LAUNCH_DIR``) and removes
it when mpiexec has ended. Notes in it: ``stop`` (the launcher was told to stop: the signal number,
passed on to each rank by its supervisor) and ``lost-RANK`` (that rank ended by a signal, written by
its supervisor before Hydra tells the other ranks). Each note is one number, written whole (a
temporary file renamed into place). Kept apart from ``comm`` so the supervisor imports nothing else.
"""

from __future__ import annotations

import os

LAUNCH_DIR_ENV = "ENGINE_LAUNCH_DIR"


def write_note(folder: str, name: str, value: int) -> None:
    """``folder/name`` holding ``value``, written whole (a temporary file renamed into place)."""
    temporary = os.path.join(folder, f".{name}.{os.getpid()}.tmp")
    with open(temporary, "w", encoding="ascii") as f:
        f.write(str(int(value)))
    os.replace(temporary, os.path.join(folder, name))


def read_note(folder: str | None, name: str) -> int | None:
    """The number in ``folder/name``, or None when there is none (yet)."""
    if not folder:
        return None
    try:
        with open(os.path.join(folder, name), encoding="ascii") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None

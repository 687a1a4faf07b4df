"""Nothing lost: how a run that cannot finish ends (a signal, a diverging loss, a failing disk).

``guarded_fit(trainer, checkpoint)`` runs ``trainer.fit()`` and turns each way of stopping early into
one ``UserError`` line that says what happened, at which step, and what was kept:

- a stop signal (``engine.signals``): the loop ends between two steps; with ``--save`` the last
  completed step is written as a resumable checkpoint; exit code 128 + the signal number;
- a diverging loss: the loss is checked before backward, so the weights are still those of the last
  completed step; they are written (a checkpoint with NaN weights is refused anyway, see
  ``engine.checkpoint.save_checkpoint``);
- a lost terminal or a closed output pipe (``engine.streams``): a stop signal (SIGHUP, SIGPIPE), above;
- a data file that changed under the run (an image deleted, truncated, replaced by a folder): the
  batch that met it is not trained; the last completed step is written, as for a signal (before, the
  finished steps were lost);
- an output file that cannot be written (``--memory-log`` on a full disk): ``OutputWriteError`` names
  the file; the last completed step is written (before, the fault was blamed on the swap disk and the
  checkpoint skipped although ``--save`` was writable);
- a disk fault (ENOSPC, EIO, a record read back changed): written only when the checkpoint goes to
  another file system than the failing swap directory, and never with ``--offload-params`` (the
  optimizer state on the failing disk may be lost), nor when the fault came inside backward after
  the update in backward (``engine.optim.UpdateInBackward``) had begun: some layers then hold the
  next step's weights, the others the last one's, and no step is what they are (the message says so
  and names ``--update-after-backward``, which keeps a step's weights whole until its update). Any
  other ``OSError`` escaping a step is a disk fault of the swap storage: during a step the engine
  touches no other file (the memory log raises ``OutputWriteError``, the terminal never raises).

The checkpoint writer is a callable so this module does not decide file names or metadata.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from engine.errors import DiskFaultError, Interrupted, OutputWriteError, UserError, stopped_by


class CheckpointWriter:
    """Writes the trainer's current step to ``path`` through ``write(path, trainer)``; says what it did."""

    def __init__(self, path: str | None, write: Callable[[str, Any], None], fault_dirs: tuple[str, ...] = (),
                 state_on_disk: bool = False):
        self.path = path
        self.write = write
        self.fault_dirs = fault_dirs  # directories whose disk a fault may be on (the swap directories)
        self.state_on_disk = state_on_disk  # --offload-params: the optimizer state lives on the swap disk

    def save(self, trainer: Any, why: str, then: str = "") -> str:
        """Write the checkpoint; returns the clause for the one-line message (never raises a UserError)."""
        if self.path is None:
            return "; nothing was saved (give --save FILE to keep the weights of a stopped run)"
        try:
            self.write(self.path, trainer)
        except UserError as exc:
            return f"; the checkpoint was not written ({exc})"
        except OSError as exc:
            return f"; the checkpoint was not written ({exc.strerror or exc})"
        return (f"; {why}: the checkpoint of step {trainer.step} was written to {self.path}; continue with "
                f"--resume {self.path}{then}")

    def disk_is_shared(self) -> bool:
        """True when the checkpoint would go to the same file system as a failing swap directory."""
        if self.path is None:
            return False
        target = os.path.dirname(os.path.abspath(self.path))
        while not os.path.exists(target):
            target = os.path.dirname(target)
        try:
            device = os.stat(target).st_dev
            return any(os.path.exists(d) and os.stat(d).st_dev == device for d in self.fault_dirs)
        except OSError:
            return True


def guarded_fit(trainer: Any, writer: CheckpointWriter) -> Any:
    """``trainer.fit()``; a signal, a diverging loss or a disk fault becomes one UserError (see module doc)."""
    from engine.data.datasets import DataError
    from engine.offload.storage import OffloadStorageError
    from engine.train import TrainingDiverged

    try:
        result = trainer.fit()
    except TrainingDiverged as exc:
        note = writer.save(trainer, "the weights before it", " --override lr --lr SMALLER")
        raise TrainingDiverged(f"{exc}{note}") from None
    except Interrupted as exc:  # a stop that could not wait for the step's end (an MPI rank lost mid-step)
        note = writer.save(trainer, getattr(exc, "kept", "the last step every rank completed"))
        raise type(exc)(f"{exc} during step {trainer.step + 1} of {trainer.total_steps}{note}", exc.signum) from None
    except (DataError, OutputWriteError) as exc:  # a file of the user's, not the swap disk: the weights are whole
        note = writer.save(trainer, "the last completed step")
        raise type(exc)(f"{exc} (at step {trainer.step} of {trainer.total_steps}){note}") from None
    except (DiskFaultError, OffloadStorageError, OSError) as exc:
        message = str(exc) if isinstance(exc, UserError) else (
            f"disk I/O failed during step {trainer.step} ({exc.strerror or exc}"
            f"{': ' + str(exc.filename) if getattr(exc, 'filename', None) else ''}); check the disk")
        if writer.path is None:
            note = ""
        elif writer.state_on_disk:
            note = "; the checkpoint was not written (the optimizer state was on the failing disk)"
        elif writer.disk_is_shared():
            note = f"; the checkpoint was not written ({writer.path} is on the failing disk)"
        elif getattr(trainer.optimizer, "update_in_progress", False):
            note = ("; the checkpoint was not written (the fault came inside backward, after some layers were "
                    "updated: the weights are no step's; --update-after-backward keeps them whole until the update)")
        else:
            note = writer.save(trainer, "the last completed step")
        raise DiskFaultError(f"{message}{note}") from None
    if trainer.stopped_by is not None:
        signum = trainer.stopped_by
        note = writer.save(trainer, "the last completed step")
        raise Interrupted(
            f"{stopped_by(signum, f'after step {trainer.step} of {trainer.total_steps}')}{note}", signum
        )
    return result


__all__ = ["CheckpointWriter", "guarded_fit"]

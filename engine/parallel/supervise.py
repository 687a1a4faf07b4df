"""One rank's supervisor under ``--workers K``: ``python -m engine.parallel.supervise COMMAND...``.

Why a process between mpiexec and each rank. The mpich wheel's Hydra proxy SIGKILLs every other rank
of the job as soon as one of its children ends by a signal (``WIFSIGNALED`` in its wait loop,
whatever ``-disable-auto-cleanup`` says; seen: a rank killed with SIGKILL took its partner down
before that partner could remove its swap directory or save a step). Run under this supervisor, a
rank killed by a signal is seen by Hydra as a process that exited (128 + n); with
``-disable-auto-cleanup`` Hydra then only sends SIGUSR1 to the other ranks' supervisors, which pass it
on, and those ranks stop, remove what they keep on disk and save the last step every rank completed
(``engine.parallel.comm.check_peers``).

What the supervisor does, and nothing else:
- runs COMMAND with the same environment and descriptors (MPI's ``PMI_FD`` must reach the rank), as a
  child that dies with it (``PR_SET_PDEATHSIG``: an ``MPI_Abort`` that SIGKILLs the supervisors
  still ends the ranks, as it did without them);
- passes every stop signal and Hydra's SIGUSR1 on to the rank;
- when the rank ends by a signal, writes ``lost-RANK`` (the signal number) into the launch directory
  before exiting, so the ranks left can name it. It exits with the rank's status (128 + n for a signal).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from engine.parallel.notes import LAUNCH_DIR_ENV, write_note

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1)


def _prepare_child() -> None:
    """In the child, before exec: SIGKILL when the supervisor dies (Linux; elsewhere nothing), and
    SIGUSR1 ignored until the rank installs its handler (``comm.install_peer_loss_handler``): Hydra's
    notice that another rank ended must not kill a rank that is still starting."""
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def main(command: list[str]) -> int:
    folder = os.environ.get(LAUNCH_DIR_ENV)
    child = subprocess.Popen(command, close_fds=False, preexec_fn=_prepare_child)
    pmi_fd = os.environ.get("PMI_FD", "")
    if pmi_fd.isdigit():  # the rank's alone now: Hydra sees it close when the rank ends, not when we do
        try:
            os.close(int(pmi_fd))
        except OSError:
            pass

    def forward(signum: int, frame: object) -> None:
        try:
            child.send_signal(signum)
        except OSError:
            pass

    for signum in FORWARDED:
        signal.signal(signum, forward)
    status = child.wait()  # the handlers above run while it waits (PEP 475)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # a notice for a rank that has ended: nothing to pass on
    if status < 0:  # ended by a signal: say which rank, for the ranks left (before our exit tells Hydra)
        if folder:
            try:
                write_note(folder, f"lost-{os.environ.get('PMI_RANK', '?')}", -status)
            except OSError:
                pass
        return 128 - status
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

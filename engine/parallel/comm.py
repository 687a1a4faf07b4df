"""The MPI world: who launched us, how many ranks, which rank speaks, and how a failure ends the job.

Importing this module does not import MPI: ``mpi4py`` is loaded only by ``join_world()``, and only
when the process was started by an MPI launcher (``mpiexec``, ``srun``) or by ``--workers``. So
``import engine`` and a plain one-process ``engine train`` never need MPI installed.

Why MPI, and the ``mpich`` wheel: it is the distributed engine HPC codes already use (one
``mpiexec`` on a laptop, the same program under a host file or a batch scheduler on a cluster), and
mpi4py's buffer methods (``Allreduce``, ``Iallreduce``, ``Bcast``) work on NumPy arrays without
copies. ``--workers K`` starts the K ranks through the ``mpiexec`` of the wheel (Hydra) rather than
MPI's dynamic process management (``Spawn``): a spawned world is a second communicator beside
``COMM_WORLD`` that every collective would have to be written for, while a relaunch under
``mpiexec`` gives exactly the world an external ``mpiexec -n K`` or ``srun`` gives, so there is one
code path. The cost is one process start (~0.5 s measured here for ``mpiexec -n 2 python``).
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

FAILURE_TAG, ACK_TAG = 7301, 7302  # point-to-point tags of the failure notice and its acknowledgement
GRACE_SECONDS = 5.0  # how long a failing rank waits for the others to clean up before MPI_Abort

LAUNCHED_ENV = "ENGINE_WORKERS_LAUNCHED"
"""Set by ``launch`` in the ranks it starts: their world must then have exactly that many ranks."""

# What launchers put in the environment of the processes they start: (variable for the world size).
_LAUNCHER_SIZE_VARIABLES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS")


class ParallelError(RuntimeError):
    """The parallel set-up cannot work: the message names the problem and what to do."""


def launcher_world_size() -> int | None:
    """The world size a launcher (mpiexec, srun) announced in the environment, or None if none did."""
    for name in _LAUNCHER_SIZE_VARIABLES:
        value = os.environ.get(name)
        if value and value.isdigit():
            if name == "SLURM_NTASKS" and "SLURM_PROCID" not in os.environ:
                continue  # inside an allocation, but not a task started by srun
            return int(value)
    return None


def under_launcher() -> bool:
    """True when this process was started by mpiexec/srun (or by ``--workers``): it should join the world."""
    return LAUNCHED_ENV in os.environ or launcher_world_size() is not None


def mpi_available() -> str | None:
    """None when mpi4py can be imported, else the reason and the fix."""
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "mpi4py is not installed: pip install 'numba-offload-engine[mpi]' (mpi4py and the mpich wheel)"
    return None


@dataclass
class World:
    """This process's place in the MPI world: ``comm`` is COMM_WORLD, ``local_size`` the ranks on this host."""

    comm: Any
    rank: int
    size: int
    local_rank: int
    local_size: int

    @property
    def is_root(self) -> bool:
        """Rank 0 alone prints, writes checkpoints, logs and summaries."""
        return self.rank == 0

    def threads_per_rank(self, cores: int | None = None) -> int:
        """The default ``--threads`` of a rank: this host's cores split between its ranks (at least 1)."""
        cores = cores or os.cpu_count() or 1
        return max(1, cores // self.local_size)

    def abort(self, code: int = 1) -> None:
        """End every rank of the job now (``MPI_Abort``): a rank blocked in a collective cannot hang."""
        self.comm.Abort(code)


_JOINED: World | None = None  # the world this process joined (join_world), for abort_on_error()


def current_world() -> World | None:
    """The world ``join_world`` joined in this process, or None (one process, or not joined yet)."""
    return _JOINED


def join_world(expected: int | None = None) -> World:
    """Initialize MPI and return this process's World; check it is the world that was asked for.

    ``expected`` is ``--workers`` when given. A process the launcher meant to be one of several that
    nevertheless sees a world of one (an ``mpiexec`` of another MPI than mpi4py's, a bad host file)
    is an error that says so, instead of K independent runs that each think they are rank 0.
    """
    reason = mpi_available()
    if reason is not None:
        raise ParallelError(reason)
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
    world = World(comm, comm.rank, comm.size, local.rank, local.size)
    local.Free()
    announced = launcher_world_size()
    launched = os.environ.get(LAUNCHED_ENV)
    wanted = int(launched) if launched and launched.isdigit() else announced
    if wanted is not None and wanted > 1 and world.size == 1:
        raise ParallelError(
            f"this process was started as one of {wanted} ranks, but MPI sees a world of 1: the mpiexec that "
            f"started it does not belong to the MPI mpi4py uses ({MPI.Get_library_version().splitlines()[0].strip()}),"
            " or the host file lists hosts that cannot reach each other; start it with that MPI's mpiexec "
            f"({mpiexec_path() or 'not found'}), or use --workers K on one machine"
        )
    if expected is not None and expected != world.size:
        raise ParallelError(
            f"--workers {expected} asks for {expected} ranks, but this job's world has {world.size}: under "
            f"mpiexec/srun leave --workers out (the world decides) or give --workers {world.size}"
        )
    global _JOINED
    _JOINED = world
    if world.size > 1:
        install_signal_handler()
    return world


def mpiexec_path() -> str | None:
    """The ``mpiexec`` next to this Python (the mpich wheel installs it there), else the one on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.path.isfile(beside) and os.access(beside, os.X_OK):
        return beside
    return shutil.which("mpiexec")


def launch_command(workers: int, argv: Sequence[str]) -> list[str]:
    """The command that runs ``engine <argv>`` as ``workers`` ranks on this machine."""
    if workers < 2:
        raise ValueError(f"launching needs at least 2 workers, got {workers}")
    mpiexec = mpiexec_path()
    if mpiexec is None:
        raise ParallelError("--workers needs mpiexec: pip install 'numba-offload-engine[mpi]' (the mpich wheel has it)")
    return [mpiexec, "-n", str(workers), sys.executable, "-m", "cli", *argv]


def launch(workers: int, argv: Sequence[str]) -> int:
    """Run ``engine <argv>`` as ``workers`` ranks under mpiexec, wait, and return the job's exit status."""
    reason = mpi_available()
    if reason is not None:
        raise ParallelError(reason)
    command = launch_command(workers, argv)
    env = {**os.environ, LAUNCHED_ENV: str(workers)}
    # the ranks import ``cli`` by module name: put the directory the running one came from on their
    # path (looked up, not imported: the runtime never imports the command line)
    cli = sys.modules.get("cli")
    if cli is not None and getattr(cli, "__file__", None):
        root = os.path.dirname(os.path.abspath(cli.__file__))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return subprocess.call(command, env=env)


def start_or_join(workers: int | None, argv: Sequence[str]) -> tuple[World | None, int | None]:
    """What ``--workers`` means for this process: (world, None) to run as a rank of ``world`` (None: one
    process), or (None, exit status) after launching the ranks itself.

    Under mpiexec/srun the process joins the world the launcher made (``--workers`` must then match
    or be left out); otherwise ``--workers K`` (K > 1) relaunches ``engine <argv>`` as K ranks on this
    machine, and this process only waits for them.
    """
    if workers is not None and workers < 1:
        raise ParallelError(f"--workers must be at least 1, got {workers}")
    if under_launcher():
        world = join_world(expected=workers)
        return (world if world.size > 1 else None), None
    if workers is None or workers == 1:
        return None, None
    return None, launch(workers, argv)


@contextmanager
def abort_on_error(world: World | None = None, stream: Any = None) -> Iterator[None]:
    """Run a block; if it raises (or a signal interrupts it) on this rank, print one line naming the rank
    and the error, then ``MPI_Abort`` the whole job, so no other rank waits forever in a collective.

    ``world`` defaults to the one this process has joined when the error happens (so a block may join
    the world itself). ``SystemExit(0)`` passes through (a normal end). In one process this does nothing.
    """
    stream = stream or sys.stderr
    try:
        yield
    except BaseException:
        joined = world or _JOINED
        if joined is None or joined.size == 1:
            raise
        _abort_for_current(joined, stream)


def _abort_for_current(world: World, stream: Any) -> None:
    """Report the exception being handled and abort, unless it is a normal exit."""
    try:
        raise
    except SystemExit as exc:
        if exc.code in (0, None):
            raise
        code = exc.code if isinstance(exc.code, int) else 1
        _report_and_abort(world, stream, f"exited with status {exc.code}", code)
    except PeerFailed as failure:
        _acknowledge_and_abort(world, failure)
    except KeyboardInterrupt:
        _report_and_abort(world, stream, "interrupted (SIGINT)", 130)
    except Terminated:
        _report_and_abort(world, stream, "terminated (SIGTERM)", 143)
    except BaseException as exc:  # noqa: BLE001 — every other error ends the whole job
        message = getattr(exc, "format_message", None)
        text = message() if callable(message) else f"{type(exc).__name__}: {exc}"
        if os.environ.get("ENGINE_TRACEBACK"):
            traceback.print_exc(file=stream)
        _report_and_abort(world, stream, text, 1)


def abort_on_error_in_ranks(function: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a command's function: an error on any rank ends the whole job (``abort_on_error``)."""

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with abort_on_error():
            return function(*args, **kwargs)

    return wrapper


def _report_and_abort(world: World, stream: Any, text: str, code: int) -> None:
    """The failing rank: say what failed, let the others clean up (``GRACE_SECONDS`` at most), abort."""
    print(f"Error: rank {world.rank} of {world.size}: {text}; ending every rank", file=stream, flush=True)
    _clean_up_local()
    from mpi4py import MPI

    notice = np.array([world.rank, code], dtype=np.int32)
    others = [r for r in range(world.size) if r != world.rank]
    requests = [world.comm.Isend(notice, dest=r, tag=FAILURE_TAG) for r in others]
    acknowledged: set[int] = set()
    status = MPI.Status()
    deadline = time.monotonic() + GRACE_SECONDS
    ack = np.empty(1, dtype=np.int32)
    while len(acknowledged) < len(others) and time.monotonic() < deadline:
        if world.comm.Iprobe(source=MPI.ANY_SOURCE, tag=ACK_TAG, status=status):
            world.comm.Recv(ack, source=status.Get_source(), tag=ACK_TAG)
            acknowledged.add(status.Get_source())
        else:
            time.sleep(0.001)
    del requests  # MPI_Abort ends them with everything else
    world.abort(code)


class PeerFailed(RuntimeError):
    """Another rank failed and said so: this rank stops, cleans up and lets the job end quietly."""

    def __init__(self, rank: int, code: int):
        super().__init__(f"rank {rank} failed")
        self.rank, self.code = rank, code


def check_peers(world: World | None = None) -> None:
    """Raise PeerFailed if another rank has reported a failure (a cheap probe; call it while waiting)."""
    world = world or _JOINED
    if world is None or world.size == 1:
        return
    from mpi4py import MPI

    status = MPI.Status()
    if world.comm.Iprobe(source=MPI.ANY_SOURCE, tag=FAILURE_TAG, status=status):
        notice = np.empty(2, dtype=np.int32)
        world.comm.Recv(notice, source=status.Get_source(), tag=FAILURE_TAG)
        raise PeerFailed(int(notice[0]), int(notice[1]))


def wait_all(requests: list[Any], world: World | None = None) -> None:
    """``MPI.Request.Waitall`` that gives up (PeerFailed) when another rank reports a failure.

    A rank blocked in a plain Waitall for a partner that died would be killed by ``MPI_Abort``
    (SIGKILL from Hydra: no clean-up, its swap directory left behind); polling lets it unwind.
    """
    from mpi4py import MPI

    while not MPI.Request.Testall(requests):
        check_peers(world)
        time.sleep(0)  # let the input thread have the GIL between polls


def _acknowledge_and_abort(world: World, failure: PeerFailed) -> None:
    """A rank told of another's failure: clean up, tell the failed rank, then end (no message of its own)."""
    _clean_up_local()
    world.comm.Send(np.array([world.rank], dtype=np.int32), dest=failure.rank, tag=ACK_TAG)
    world.abort(failure.code)


def _clean_up_local() -> None:
    """Remove what this process keeps on disk (offload swap directories), if offload was used at all."""
    storage = sys.modules.get("engine.offload.storage")
    if storage is not None:
        storage.cleanup_all()


class Terminated(BaseException):
    """SIGTERM, turned into an exception in the ranks, so a terminated rank reports it and cleans up."""


def install_signal_handler() -> None:
    """In a rank: SIGTERM raises Terminated (default SIGTERM would end the rank with no word and no clean-up)."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        def terminate(signum: int, frame: Any) -> None:
            raise Terminated()

        signal.signal(signal.SIGTERM, terminate)

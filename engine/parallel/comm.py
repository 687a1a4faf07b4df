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

import atexit
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.errors import Interrupted, UserError, signal_name
from engine.parallel.notes import LAUNCH_DIR_ENV, read_note, write_note

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
        """End every rank of the job now (``MPI_Abort``): a rank blocked in a collective cannot hang.

        MPI_Abort leaves the job's MPICH shared memory in /dev/shm (RAM) under any launcher, so this rank first
        unlinks the segments it maps (``unlink_own_segments``); the mappings live on until the processes end."""
        unlink_own_segments()
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
        install_peer_loss_handler()
    return world


def mpiexec_path() -> str | None:
    """The ``mpiexec`` next to this Python (the mpich wheel installs it there), else the one on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.path.isfile(beside) and os.access(beside, os.X_OK):
        return beside
    return shutil.which("mpiexec")


def mpiexec_command(workers: int, *options: str) -> list[str]:
    """``mpiexec [options] -n workers``, with the mpiexec of ``mpiexec_path()``."""
    if workers < 2:
        raise ValueError(f"launching needs at least 2 workers, got {workers}")
    mpiexec = mpiexec_path()
    if mpiexec is None:
        raise ParallelError("--workers needs mpiexec: pip install 'numba-offload-engine[mpi]' (the mpich wheel has it)")
    return [mpiexec, *options, "-n", str(workers)]


def launch_command(workers: int, argv: Sequence[str]) -> list[str]:
    """The command that runs ``engine <argv>`` as ``workers`` ranks on this machine, each under its
    supervisor (``engine.parallel.supervise``: why, and why ``-disable-auto-cleanup``)."""
    return [*mpiexec_command(workers, "-disable-auto-cleanup"), sys.executable, "-m", "engine.parallel.supervise",
            sys.executable, "-m", "cli", *argv]


def launch(workers: int, argv: Sequence[str], stop: Any = None) -> int:
    """Run ``engine <argv>`` as ``workers`` ranks under mpiexec, wait, and return the job's exit status.

    Each rank runs under ``engine.parallel.supervise`` and mpiexec with ``-disable-auto-cleanup``, so
    a rank killed by a signal does not make Hydra SIGKILL the others (see that module): they stop,
    clean up and save. mpiexec runs in its own session: a terminal's Ctrl-C or hang-up reaches this
    process alone, and ``stop`` (``engine.signals.StopSignals``) passes the first stop signal on to
    every rank through a note in a private launch directory (``DataParallel.agreed_stop`` reads it
    before each step), so the ranks stop together at a step boundary, as one process would; mpiexec
    would have SIGKILLed them.
    """
    reason = mpi_available()
    if reason is not None:
        raise ParallelError(reason)
    command = launch_command(workers, argv)
    folder = tempfile.mkdtemp(prefix="engine-launch-")  # mode 0700
    env = {**os.environ, LAUNCHED_ENV: str(workers), LAUNCH_DIR_ENV: folder}
    # the ranks import ``cli`` by module name: put the directory the running one came from on their
    # path (looked up, not imported: the runtime never imports the command line)
    cli = sys.modules.get("cli")
    if cli is not None and getattr(cli, "__file__", None):
        root = os.path.dirname(os.path.abspath(cli.__file__))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    process = None
    segments = mpich_segments()
    try:
        process = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
        passed_on = False
        while True:
            try:
                return process.wait(timeout=0.1)
            except subprocess.TimeoutExpired:
                pass
            received = getattr(stop, "received", None)
            if received is not None and not passed_on:
                write_note(folder, "stop", received)
                passed_on = True
    finally:
        if process is not None and process.poll() is None:  # this process is failing: do not orphan the job
            process.kill()
            process.wait()
        shutil.rmtree(folder, ignore_errors=True)
        remove_orphaned_segments(segments)


SHM_DIR = "/dev/shm"
SHM_PREFIX = "mpich_shm_"


def mpich_segments(directory: str = SHM_DIR) -> set[str]:
    """The MPICH shared-memory segments (``/dev/shm/mpich_shm_*``) that exist now."""
    try:
        return {name for name in os.listdir(directory) if name.startswith(SHM_PREFIX)}
    except OSError:
        return set()


def _mapped_segments(maps: str) -> set[str]:
    """The MPICH segments (their paths) a process maps, from its ``/proc/PID/maps``; empty if unreadable."""
    try:
        with open(maps, encoding="utf-8", errors="replace") as f:
            return {path for path in (line.rsplit(None, 1)[-1] for line in f if SHM_PREFIX in line)
                    if os.path.basename(path).startswith(SHM_PREFIX)}
    except OSError:
        return set()


def unlink_own_segments(maps: str = "/proc/self/maps") -> list[str]:
    """Unlink the MPICH segments this process maps (before MPI_Abort); return their paths."""
    removed = []
    for path in sorted(_mapped_segments(maps)):
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:
            pass
    return removed


def remove_orphaned_segments(before: set[str], directory: str = SHM_DIR, proc: str = "/proc") -> list[str]:
    """Remove the MPICH segments made since ``before`` that no process maps any more; return their names.

    The ranks' shared memory (2 MiB per rank pair, in RAM: /dev/shm is a tmpfs) is removed by MPICH when
    a job ends normally. A job that ends by MPI_Abort or a killed rank leaves it, and ``-disable-auto-cleanup``
    (``launch_command``) keeps Hydra from sweeping it: 85 segments had piled up in /dev/shm after a few days
    of the test suite's rank-fault runs. Only segments that appeared during this job are candidates, and one
    that a live process still maps (another job started meanwhile) is left alone."""
    made = mpich_segments(directory) - before
    if not made:
        return []
    try:
        pids = [entry for entry in os.listdir(proc) if entry.isdigit()]
    except OSError:
        return []
    mapped = {os.path.basename(path) for pid in pids for path in _mapped_segments(os.path.join(proc, pid, "maps"))}
    removed = []
    for name in sorted(made - mapped):
        try:
            os.unlink(os.path.join(directory, name))
            removed.append(name)
        except OSError:
            pass
    return removed


def start_or_join(workers: int | None, argv: Sequence[str], stop: Any = None) -> tuple[World | None, int | None]:
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
    return None, launch(workers, argv, stop)


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
    except AgreedRefusal as refusal:  # every rank refused together (refuse_together): rank 0 says it
        if world.is_root:
            raise
        raise SystemExit(refusal.exit_code) from None
    except RankLost as lost:
        _exit_after_loss(world, stream, lost)
    except Interrupted as stopped:
        if stopped.signum == AGREED_STOP[0]:  # every rank stopped at the same step (DataParallel.agreed_stop)
            if world.is_root:
                raise  # rank 0 says it (the command line prints the one line), with the exit code
            raise SystemExit(stopped.exit_code) from None
        _report_and_abort(world, stream, str(stopped), stopped.exit_code)
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


class AgreedRefusal(UserError):
    """A refusal every rank reached together (``refuse_together``): rank 0 alone says it, in the one line a
    refusal gets, and every rank exits with its code; nothing is aborted, because no rank is left waiting."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def refuse_together(world: World | None, refusal: str | None) -> None:
    """Raise ``AgreedRefusal`` on every rank when any rank refuses (``refusal``: its message, None: it goes on).

    For checks each rank makes before the first step that should end the job as one process would (the
    memory limit each rank plans against: ``engine train --workers`` under a cgroup). Without it each
    refusing rank reported and aborted on its own: two lines for one problem and MPI_Abort's own line,
    or, where one rank fitted and another did not, a job aborted from one side. One ``allgather`` of a
    short string per rank; the lowest refusing rank's message is the one said."""
    if world is None or world.size == 1:
        return
    said = [text for text in world.comm.allgather(refusal) if text is not None]
    if said:
        raise AgreedRefusal(said[0])


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

    if _PEER_LOST[0]:
        raise _rank_lost(world)
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


# --- a rank that died without a word (SIGKILL, the OOM killer, a crash) -------------------------------

_PEER_LOST = [False]  # set by SIGUSR1: Hydra's notice (with -disable-auto-cleanup) that a rank of the job ended
NOTE_WAIT_SECONDS = 2.0  # how long a rank told of a lost partner waits for its supervisor's note
AGREED_STOP = [0]  # the stop signal every rank agreed on (DataParallel.agreed_stop), 0 while none


class RankLost(Interrupted):
    """Another rank ended in the middle of the run (killed, crashed): this rank stopped too, at the last
    step every rank completed. Exit code 128 + the signal that ended it (1 when it is not known)."""

    def __init__(self, message: str, signum: int | None = None):
        super().__init__(message, signum or 0)
        if not signum:
            self.exit_code = 1
        self.kept = "the last step every rank completed"  # what the checkpoint holds (parameter averaging: less)


def install_peer_loss_handler() -> None:
    """In a rank: SIGUSR1 (Hydra's notice that a rank of the job ended) only sets a flag that
    ``check_peers`` reads while this rank waits on the others (its default action would kill us)."""
    if threading.current_thread() is not threading.main_thread():
        return
    current = signal.getsignal(signal.SIGUSR1)
    if current == signal.SIG_DFL or (current == signal.SIG_IGN and LAUNCH_DIR_ENV in os.environ):
        def lost(signum: int, frame: Any) -> None:
            _PEER_LOST[0] = True

        signal.signal(signal.SIGUSR1, lost)
        # Hydra sends the notice when any rank's PMI socket closes, also at a normal end; Python puts the
        # default action (death) back when it shuts down, so from our exit on the notice is ignored
        atexit.register(signal.signal, signal.SIGUSR1, signal.SIG_IGN)


def lost_ranks(world: World) -> dict[int, int]:
    """{rank: signal} of the ranks whose supervisor reported them ended by a signal (launch notes)."""
    folder = os.environ.get(LAUNCH_DIR_ENV)
    found = {}
    for rank in range(world.size):
        signum = read_note(folder, f"lost-{rank}")
        if signum is not None and rank != world.rank:
            found[rank] = signum
    return found


def _rank_lost(world: World) -> RankLost:
    """The error for a lost rank, after removing the swap directory it left (its lock is free now)."""
    lost = lost_ranks(world)
    deadline = time.monotonic() + NOTE_WAIT_SECONDS
    while not lost and time.monotonic() < deadline:  # Hydra's notice can come before the supervisor's note
        time.sleep(0.01)
        lost = lost_ranks(world)
    _remove_stale_swap()
    if not lost:
        return RankLost(f"another of the {world.size} ranks ended unexpectedly (mpiexec reported it); every rank "
                        "stopped")
    named = ", ".join(f"rank {r} of {world.size} was killed by {signal_name(s)}" for r, s in sorted(lost.items()))
    return RankLost(f"{named}; every rank stopped", next(iter(lost.values())))


def _remove_stale_swap() -> None:
    """Remove the swap directories of dead processes beside ours (a rank killed outright left its own)."""
    storage = sys.modules.get("engine.offload.storage")
    if storage is not None:
        for base in storage.open_bases():
            storage.remove_stale_directories(base)


def writes_for_the_job(world: World) -> bool:
    """Whether this rank writes the checkpoint: rank 0, or after a rank was lost the lowest one left
    (every rank holds the same weights)."""
    lost = lost_ranks(world) if _PEER_LOST[0] else {}
    return world.rank == min(r for r in range(world.size) if r not in lost)


def _exit_after_loss(world: World, stream: Any, lost: RankLost) -> None:
    """A rank left after another died: the writer says it in one line; every one exits at once (no
    MPI_Finalize, which would wait for the dead rank; no MPI_Abort, which has nothing left to end)."""
    _clean_up_local()
    if writes_for_the_job(world):
        print(f"Error: {lost}", file=stream, flush=True)
    for handle in (sys.stdout, sys.stderr, stream):
        try:
            handle.flush()
        except (OSError, ValueError):
            pass
    os._exit(lost.exit_code)

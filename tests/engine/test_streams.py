"""The user's terminal and pipes never decide the fate of a run (engine.streams, issue 31): real pipes,
a real pty whose master is closed, a real full device."""

from __future__ import annotations

import os
import pty
import signal

import pytest

from engine import streams
from engine.signals import StopSignals


def guarded(fd: int) -> streams.GuardedStream:
    return streams.GuardedStream(open(fd, "w", buffering=1, closefd=True), "stdout")


@pytest.fixture
def stops():
    received = []
    streams.on_lost(received.append)
    yield received
    streams.on_lost(None)


def test_a_closed_pipe_loses_the_stream_and_stops_as_sigpipe(stops):
    read, write = os.pipe()
    stream = guarded(write)
    stream.write("first line\n")
    assert os.read(read, 100) == b"first line\n"
    os.close(read)  # `| head -1` exits
    stream.write("second line\n")
    stream.flush()
    assert isinstance(stream.lost, BrokenPipeError) and stops == [signal.SIGPIPE]
    stream.write("never raises\n")
    stream.flush()
    assert stops == [signal.SIGPIPE]  # once
    # its descriptor now points at /dev/null: the interpreter's flush at exit cannot fail either
    assert os.path.samestat(os.fstat(stream.fileno()), os.stat(os.devnull))
    assert not stream.isatty()


def test_a_terminal_whose_master_is_closed_stops_as_sighup(stops):
    master, slave = pty.openpty()
    stream = guarded(slave)
    assert stream.isatty()
    stream.write("progress\n")
    os.close(master)  # the terminal goes away: writes to the slave now fail with EIO
    for _ in range(3):
        stream.write("progress\n")
        stream.flush()
    assert stream.lost is not None and stream.lost.errno in (5, 6)  # EIO (ENXIO on some kernels)
    assert stops == [signal.SIGHUP]


def test_a_full_disk_under_a_redirected_stream_drops_it_and_does_not_stop(stops):
    stream = guarded(os.open("/dev/full", os.O_WRONLY))
    stream.write("x" * 10000)
    stream.flush()
    assert stream.lost is not None and stream.lost.errno == 28 and stops == []  # ENOSPC: training goes on


def test_stop_signals_take_a_lost_streams_stop_and_let_go_of_it_at_restore():
    stop = StopSignals(signals=()).install()
    read, write = os.pipe()
    stream = guarded(write)
    os.close(read)
    stream.write("x\n")
    assert stop.received == signal.SIGPIPE
    stop.restore()
    later = StopSignals(signals=())
    read, write = os.pipe()
    os.close(read)
    guarded(write).write("x\n")
    assert later.received is None  # not installed: nobody is stopped


def test_guard_standard_streams_is_idempotent(monkeypatch):
    import io
    import sys

    monkeypatch.setattr(sys, "stdout", io.StringIO())
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    first = streams.guard_standard_streams()
    assert streams.guard_standard_streams() == first and sys.stdout is first[0]
    print("through the guard")
    assert first[0]._stream.getvalue() == "through the guard\n"

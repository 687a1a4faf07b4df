"""Numba's OpenMP pool starts with its workers sleeping when idle, whichever entry point starts it.

Spinning workers took the second core from the conv shares' pool thread: ResNet-18's training step
ran 20% slower (kernels/cpu/threads.py). OpenMP reads OMP_WAIT_POLICY once, at start, so each test
runs in a fresh process and reads back the runtime's own settings (OMP_DISPLAY_ENV=VERBOSE).
"""

import os
import subprocess
import sys
import time

import pytest

STARTS = {
    "engine.threads.set_threads": "from engine.threads import set_threads; set_threads(1)",
    "import kernels.cpu": "import kernels.cpu",
}


def run(code: str, **env: str) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    environment.update(OMP_DISPLAY_ENV="VERBOSE", **env)
    check = "import os; print('left in environ:', os.environ.get('OMP_WAIT_POLICY'))"
    return subprocess.run([sys.executable, "-c", f"{code}; {check}"], env=environment, capture_output=True,
                          text=True, timeout=120, check=True)


@pytest.mark.parametrize("code", STARTS.values(), ids=STARTS.keys())
def test_the_pool_starts_passive_and_the_environment_is_restored(code):
    result = run(code)
    # GNU OpenMP prints PASSIVE for its default too; the spin count tells them apart (default 300000)
    assert "GOMP_SPINCOUNT = '0'" in result.stderr
    assert "left in environ: None" in result.stdout  # the variable does not outlive the pool's start


def test_a_policy_the_user_set_is_kept():
    result = run(STARTS["engine.threads.set_threads"], OMP_WAIT_POLICY="active")
    assert "OMP_WAIT_POLICY = 'ACTIVE'" in result.stderr
    assert "left in environ: active" in result.stdout


needs_two_cpus = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2, reason="needs Linux and two CPUs"
)


@needs_two_cpus
def test_the_pool_threads_run_off_the_callers_cpu(monkeypatch):
    """With ENGINE_PIN_SHARES=1, a woken share must not queue behind the caller's own share on the
    caller's CPU (threads.py: "Where a woken share runs"): the workers are kept off the CPU the caller
    handed out from."""
    import threading
    import time

    from kernels.cpu import threads

    monkeypatch.setattr(threads, "_pinning", True)
    monkeypatch.setattr(threads, "_kept_off", None)

    seen = {}
    caller = threading.get_native_id()

    def work(t: int) -> None:
        time.sleep(0.005)  # long enough for the pool's thread to take a share (shares go to whoever is free)
        if threading.get_native_id() != caller:
            seen[t] = (os.sched_getaffinity(0), threads._getcpu())

    allowed = os.sched_getaffinity(0)
    threads.run_shares(work, 2)  # a worker that starts during this call is pinned from the next one
    calls_with_a_worker = 0
    for _ in range(20):
        seen.clear()
        threads.run_shares(work, 2)
        assert threads._kept_off is not None
        calls_with_a_worker += bool(seen)
        for affinity, cpu in seen.values():
            assert affinity == allowed - {threads._kept_off}
            assert cpu != threads._kept_off
    assert calls_with_a_worker >= 10  # the pool's thread did run shares, off the caller's CPU
    for tid in threads._worker_ids:  # off again for the other tests: pinning is not the default
        os.sched_setaffinity(tid, allowed)


@needs_two_cpus
def test_a_refused_affinity_call_turns_the_pinning_off_and_the_shares_still_run(monkeypatch):
    from kernels.cpu import threads

    def refuse(*args):
        raise PermissionError("not allowed here")

    threads.run_shares(lambda t: None, 3)  # the pool's two workers started
    deadline = time.monotonic() + 30  # and registered: a worker not yet run has no id to pin, so no refusal came
    while len(threads._worker_ids) < 2 and time.monotonic() < deadline:  # (2026-11-28, a loaded clean-clone run)
        time.sleep(0.01)
    assert len(threads._worker_ids) >= 2
    monkeypatch.setattr(threads, "_kept_off", None)
    monkeypatch.setattr(threads, "_pinning", True)
    monkeypatch.setattr(threads, "_stepping_aside", threads._stepping_aside)  # (a refusal clears it too)
    monkeypatch.setattr(threads.os, "sched_setaffinity", refuse)
    done = []
    threads.run_shares(done.append, 3)
    assert sorted(done) == [0, 1, 2]
    assert threads._pinning is False


def _threads_flag(flag: str, variable: str, value: str | None) -> str:
    """``threads.<flag>`` as a fresh process sees it with ``variable`` set to ``value`` (None: unset):
    these switches are read at import."""
    environment = {k: v for k, v in os.environ.items() if k != variable}
    if value is not None:
        environment[variable] = value
    code = f"from kernels.cpu import threads; print(threads.{flag})"
    result = subprocess.run([sys.executable, "-c", code], env=environment, capture_output=True, text=True, check=True)
    return result.stdout.strip()


def test_pinning_is_off_unless_asked_for():
    assert _threads_flag("_pinning", "ENGINE_PIN_SHARES", None) == "False"
    on = _threads_flag("_pinning", "ENGINE_PIN_SHARES", "1")
    assert on == ("True" if hasattr(os, "sched_setaffinity") else "False")


@needs_two_cpus
def test_a_pool_thread_steps_off_the_callers_cpu_and_may_run_anywhere_after():
    """threads.py, "A woken thread steps aside": a pool thread that finds itself on the CPU the caller
    handed out from moves off it at once, and its affinity is the full set again afterwards."""
    import threading

    from kernels.cpu import threads

    allowed = os.sched_getaffinity(0)
    seen = {}

    def body() -> None:
        for _ in range(20):
            cpu = threads._getcpu()
            threads._step_aside(cpu)
            seen.setdefault("moved", []).append(threads._getcpu() != cpu)
        seen["affinity"] = os.sched_getaffinity(0)

    thread = threading.Thread(target=body)
    thread.start()
    thread.join(30)
    assert sum(seen["moved"]) >= 18  # (a load balancer may move it back in between, rarely)
    assert seen["affinity"] == allowed
    assert threads._stepping_aside  # no refusal turned it off


@pytest.mark.parametrize("name", ["ENGINE_SPIN_US", "ENGINE_WAIT_SPIN_US"])
def test_a_bad_spin_setting_is_one_line_from_the_command_line(name):
    # kernels/cpu/threads.py reads these at import: a typo must not end in a traceback
    code = "from cli import main; main(['train', '--model', 'mlp', '--steps', '1'])"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            env={**os.environ, name: "fast"})
    assert result.returncode == 1
    assert result.stderr.strip().startswith(f"Error: {name}='fast' is not a number of microseconds >= 0: set one")


@pytest.mark.parametrize(("items", "threads", "min_items"), [(10, 2, 1), (10, 3, 4), (5, 2, 100), (0, 2, 1), (7, 3, 1)])
def test_run_ranges_cover_the_items_once_in_fixed_ranges(items, threads, min_items):
    # batch norm, the optimizers, the global pools and the dense bias split their work here: every
    # index exactly once, in ranges that depend on the sizes only (their bits must not depend on timing)
    from kernels.cpu.threads import RANGE_MIN_VALUES, run_ranges

    seen = []
    for _ in range(2):
        ranges: list[tuple[int, int]] = []
        run_ranges(lambda lo, hi, ranges=ranges: ranges.append((lo, hi)), items, threads, RANGE_MIN_VALUES // min_items)
        seen.append(sorted(ranges))
    assert seen[0] == seen[1]
    covered = [i for lo, hi in seen[0] for i in range(lo, hi)]
    assert covered == list(range(items))
    assert len(seen[0]) == max(1, min(threads, items // min_items))
def test_the_caller_yields_once_after_each_hand_out_before_its_own_chunks(monkeypatch):
    """threads.py, "The caller yields after the hand-out": a pool thread queued on the caller's CPU (woken
    there, or waiting awake there) runs, and steps aside, before the caller's first chunk, not after it."""
    from kernels.cpu import spin, threads

    events = []
    monkeypatch.setattr(threads, "yield_after_hand_out", True)
    monkeypatch.setattr(spin, "yield_cpu", lambda: events.append("yield"))
    threads.run_chunks(lambda chunk, slot: events.append((chunk, slot)), 4, 2)
    assert events.count("yield") == 1
    mine = [e for e in events if e != "yield" and e[1] == 0]
    assert mine and events.index("yield") < events.index(mine[0])  # the caller yielded before its first chunk
    assert sorted(e[0] for e in events if e != "yield") == [0, 1, 2, 3]
    events.clear()
    monkeypatch.setattr(threads, "yield_after_hand_out", False)
    threads.run_chunks(lambda chunk, slot: events.append((chunk, slot)), 4, 2)
    assert "yield" not in events and len(events) == 4
    monkeypatch.setattr(threads, "yield_after_hand_out", True)
    threads.run_chunks(lambda chunk, slot: events.append((chunk, slot)), 1, 2)  # one chunk: no hand-out
    assert "yield" not in events


@needs_two_cpus
def test_stepping_aside_runs_through_ctypes_outside_the_gil_and_a_refusal_turns_it_off(monkeypatch):
    """threads.py, ``_step_aside``: the migration (60–80 µs here) runs through libc's sched_setaffinity by
    ctypes, which lets go of the GIL, not ``os.sched_setaffinity``, which holds it while the caller waits."""
    import threading

    from kernels.cpu import threads

    if threads._setaffinity is None:
        pytest.skip("no libc sched_setaffinity")

    def held(*args):
        raise AssertionError("os.sched_setaffinity holds the GIL: _step_aside must not call it")

    monkeypatch.setattr(threads.os, "sched_setaffinity", held)
    monkeypatch.setattr(threads, "_stepping_aside", True)
    allowed, seen = os.sched_getaffinity(0), {}

    def body() -> None:
        moved = []
        for _ in range(20):
            cpu = threads._getcpu()
            threads._step_aside(cpu)
            moved.append(threads._getcpu() != cpu)
        seen["moved"], seen["affinity"] = moved, os.sched_getaffinity(0)

    thread = threading.Thread(target=body)
    thread.start()
    thread.join(30)
    assert sum(seen["moved"]) >= 18 and seen["affinity"] == allowed and threads._stepping_aside
    monkeypatch.setattr(threads, "_setaffinity", lambda pid, size, mask: -1)  # refused (EPERM in a container)
    threads._step_aside(threads._getcpu())
    assert threads._stepping_aside is False


def test_the_hand_out_yield_is_on_unless_switched_off():
    from kernels.cpu import spin

    assert _threads_flag("yield_after_hand_out", "ENGINE_HAND_OUT_YIELD", None) == str(spin.SUPPORTED)
    assert _threads_flag("yield_after_hand_out", "ENGINE_HAND_OUT_YIELD", "0") == "False"
    if spin.SUPPORTED:
        assert spin.yield_cpu() == 0  # sched_yield() returns 0

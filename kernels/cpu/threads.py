"""Work for the conv and depthwise kernels split over threads: the calling thread and a small pool take fixed chunks.

Why not Numba's ``prange``. A ``parallel=True`` function costs 2.5–6 s of compilation on a cold
cache (parfor passes), on top of the serial code it runs: in a cold ``engine train --model resnet18``
the five parallel conv drivers took 31 of the 37 s of compile CPU time, 4.8 s of
``gemm_forward``'s 10.9 s being its one-line ``prange`` wrapper. The per-thread work functions are
serial ``@njit(nogil=True)`` kernels; Python threads run them side by side (the GIL is released
inside), so the drivers need no parfor at all. A call costs a few tens of microseconds of
submission, against conv calls of milliseconds.

Each share (``run_shares``) or chunk (``run_chunks``) is a fixed slice of the work, so results do
not depend on which thread runs it or finishes first; but which thread runs it is not fixed.

**Chunks go to whichever thread is free** (``run_chunks``). The shares used to be fixed per thread:
the caller ran share 0 and then waited for the pool's thread to run share 1. On two cores that
thread is often late: waking it costs ~55–60 µs per call here (a no-op ``run_shares`` round trip,
best of 5,000), and with offload on the IO threads (saver, loader: ~15 ms of CPU each per step for
MobileNetV2 batch 32) take its core, or the caller's, in the middle of a share; the other thread
then sat idle. Now both threads take chunks in order as they get free, the caller does not wait for
a pool thread that found nothing left, and the im2col drivers (``conv.gemm_forward``,
``gemm_backward_data``) cut the batch into up to ``CHUNKS_PER_THREAD`` chunks per thread
(``chunk_count``: a chunk holds at least one column tile, so the GEMMs do not shrink). Each chunk
writes its own images; a chunk uses the scratch slice of the thread that runs it. Measured
(``benchmarks/offload_threads.py``: MobileNetV2 batch 32, configurations alternating their steps in
one process, median of 24 steps, two runs; "shares" = dynamic shares only, the old split): no
offload 334.8 / 326.4 ms (shares) → 337.9 / 319.2 ms (4 chunks per thread), within noise; offload
N=4 480.5 / 423.8 → 462.3 / 406.2 ms (−4%), the executor's load waits 14.3 / 14.9 → 9.2 / 9.7 ms.
The old fixed shares against dynamic shares, no offload, two runs: 301.5 / 283.4 → 293.1 / 281.1 ms.
Batch 128 (8 steps, one run): no offload 1227.6 → 1230.0 ms, N=4 1506.9 → 1513.5 ms (old → 4
chunks per thread): no change; its calls are long enough that a late or interrupted share costs
little of them.
The weight gradient keeps one share per thread (taken dynamically): finer chunks would need a
dw-sized partial sum per chunk, added in chunk order.

Tried and dropped: batch norm's training kernels (``batchnorm.py``, ``prange`` over channels on
Numba's pool, whose halves are fixed) as serial kernels over a range of channels, taken in chunks
here (the same bits: each channel's sums stay in one thread). MobileNetV2 batch 32, 20 steps
alternating with the ``prange`` kernels in one process, three runs: no offload 344.6 -> 321.7,
323.4 -> 315.6, 335.3 -> 342.2 ms; N=4 441.1 -> 416.8, 422.8 -> 437.5, 477.1 -> 481.7 ms. No
consistent gain, so batch norm keeps ``prange`` (it would drop two parfor compilations from a cold
start: not measured).

**Numba's own pool sleeps when idle** (``start_numba_pool``). The other parallel kernels (batch
norm, element-wise, pooling, depthwise) still use ``prange`` on Numba's OpenMP pool, whose workers
spin after every parallel loop (GNU OpenMP: ~300,000 spins, about 5 ms here). On two cores that
spinning worker holds the core the conv share on this module's pool thread needs: ResNet-18's
training step (batch 32, 2 threads, `benchmarks/bench_train.py`) ran at 41–43 images/s with the
default and 51–53 with ``OMP_WAIT_POLICY=PASSIVE`` (GOMP_SPINCOUNT=3000: 52–52.5, within noise of
passive; 30,000: 51–52; the default 300,000: 42). That was the whole "regression" of the
Python-thread drivers: the last all-``prange`` tree ran at 53–58 on the same day, the thread drivers
alone at 42–43. The setting used to sit in ``kernels/cpu/__init__.py`` as an environment default,
but ``engine.threads.set_threads`` starts Numba's pool before that import, after which OpenMP never
reads the variable again; so the pool is now started here, on purpose, with the variable set.

**Where a woken share runs** (``_keep_workers_off_caller``). A pool thread sleeps between calls, and
the kernel's wake-up places it; on this 2-vCPU KVM guest (Linux 6.18) it often placed it on the
*caller's* CPU, where it queued behind share 0 while the other CPU idled, and stayed so for call
after call: the two shares ran one after the other. It set in after anything that kept both CPUs
busy for a moment (a NumPy 1024² sgemm, a PyTorch call: ``engine kernels`` does both between its
records) and lasted until the load balancer happened to move a thread. 1×1 forward 64→384 @8×8,
batch 32, two threads, 20 calls: 0.70 ms with the shares on two CPUs, 1.26 ms right after a NumPy
sgemm with both shares on one CPU in 18 of the 20 calls (``sched_getcpu`` in each share); Numba's
OpenMP pool did the same to the depthwise ``prange`` kernels (576 ch s2 @8×8 forward 0.67 → 1.20 ms).
So before each hand-out the pool's threads are allowed every CPU of the caller's but the one the
caller is on (one ``sched_setaffinity`` per worker, only when the caller has moved). Fresh / after
an sgemm / 20 calls later, ms: 64→384 forward 0.76 / 1.25 / 1.28 → 0.75 / 0.76 / 0.74; the stem's
weight gradient (3→32 @32×32) 2.13 / 1.78 / 1.51 → 1.06 / 1.04 / 1.02. That is also why the
depthwise kernels run their shares here now, not on ``prange``: in ``engine kernels``' conditions
(after a NumPy check and a torch call), median of 5 rounds of best-of-7, ms prange → shares: 576 ch
s2 @8×8 forward 1.17 → 0.67, backward-data 1.35 → 0.73, weight 1.38 → 0.77; 384 ch @8×8 0.68 →
0.41, 0.68 → 0.42, 0.85 → 0.49; where prange was not displaced (960 ch @4×4) the shares cost
~0.015 ms more (0.276 → 0.289). The MobileNetV2 training step did not move (64 steps alternating
in one process: 0.313 s → 0.314 s median).

**So it is off by default** (``ENGINE_PIN_SHARES=1`` turns it on): in fresh processes the training
step was slower with it. ``benchmarks/bench_train.py --models mobilenetv2 --batch-size 32 --steps 8
--threads 2 --runs 3``, engine / torch median step: main 0.63, 0.75, 0.65; this tree pinned 0.70,
0.82, 0.71 (engine 0.353, 0.393, 0.328 s), unpinned 0.66 (0.309 s); the in-process alternation above
did not show it. Not found in the time left: why (one guess: in the step the caller moves between
CPUs often, and each move costs a forced migration of the sleeping worker). So ``engine kernels``
records, taken after NumPy and PyTorch calls, still see the displaced shares now and then; the
training step runs as before.

**Pool threads wait awake; a woken one steps aside; the caller waits awake** (``_Pool``,
``spin.py``; issue 13). What the pinning above fixed, without pinning anything. Why the pool thread
landed on the caller's CPU: a sleeping thread is placed when it is woken, and after anything that
kept both CPUs busy this guest's scheduler put the woken thread beside its waker, on the caller's
CPU, while the other CPU idled (``/proc/stat`` per CPU over 40 back-to-back calls of the 1×1 forward
64→384 @8×8: 0.69 ms a call with both CPUs busy; right after a NumPy sgemm 1.08–1.19 ms, one CPU busy
for all of them and the other idle); the other way round too: a caller that slept until the pool's
last chunk was woken by the pool thread, on that thread's CPU. So threads are woken less, and a
woken one that lands beside the caller moves:

1. After its job a pool thread waits **awake** ``SPIN_MICROSECONDS`` (100 µs) for the next hand-out
   (``spin.wait_for_change``: an atomic load of the hand-out counter outside the GIL, ``sched_yield``
   between polls, so a thread the scheduler puts on its CPU, an OpenMP worker of a batch-norm kernel
   or an IO thread, runs at once) before it sleeps on its own bell (a ``SimpleQueue``). Back-to-back calls (a conv's
   forward then the next layer's, backward-data then the weight gradient, the weight gradient's
   partial-sum pass) find it awake where it was: no wake-up to place, none of the ~45 µs one costs.
2. A woken pool thread that finds itself on the CPU the caller handed out from (``sched_getcpu``,
   read by the caller at the hand-out) **steps aside** (``_step_aside``): ``sched_setaffinity`` to the
   other CPUs, which migrates it at once, then back to all of them, so nothing stays pinned (the
   pinning above kept the mask narrowed and re-pinned whenever the caller moved).
3. The caller, done with its chunks, waits **awake** up to ``WAIT_MICROSECONDS`` (1 ms) for the pool's
   last chunk before it sleeps, so it is not woken onto the pool thread's CPU.

Measured. ``engine kernels --ops conv2d --compare torch --no-versions --repeat 7``, 123 records,
runs alternating with main's tree (each a fresh process under the CPU lock), ratio = the median of
torch's times over the runs compared / ours, geometric mean (records below 0.8): main 0.894 (63),
0.943 (54) → 1.021 (50), 1.066 (44); its 1×1 records 0.758 (41), 0.811 (34) → 0.906 (29), 0.935
(27); each run's own torch time (the issue's ratio): 1.012, 0.887 → 1.072, 1.078. Still bimodal: a
record runs at its kernel's speed or at about twice that. The training step did not move
(``bench_train.py --steps 8 --threads 2 --runs 3 --frameworks engine``, images/s, trees
alternating): ResNet-18 main 59.7, 64.8, 65.5 / this 62.2, 65.8, 65.7; MobileNetV2 105.1, 89.2, 94.2
/ 109.6, 105.4, 105.1; but one run of ``--runs 3`` with torch alternating went the other way
(MobileNetV2 engine / torch 0.61 → 0.64, ResNet-18 0.80 → 0.84); pooled, median images/s over every
run, ResNet-18 62.9 → 63.9, MobileNetV2 99.7 → 104.0: level within the noise. Each part alone, and
a first version that lost ResNet-18's step ~8% (a
``Condition`` shared with the caller): kernels/README.md, "The pool thread on the caller's CPU".
``ENGINE_SPIN_US=0``, ``ENGINE_WAIT_SPIN_US=0``, ``ENGINE_STEP_ASIDE=0`` switch the parts off.

**The caller yields after the hand-out; stepping aside lets go of the GIL** (issue 13). Still bimodal
after the above: traced per call (the CPU and start of each thread's chunks, ``sched_getcpu``), the
1×1 records in ``engine kernels``' conditions (after a NumPy check, torch timed in its own process)
showed two more ways a share waits behind the other on one CPU while the other CPU idles:

1. the pool thread, *awake* (in its 100 µs wait) but on the caller's CPU, sees the hand-out only when
   the caller next gives up its CPU: it took no chunk for the whole call (144→32 @16×16 weight
   gradient 1.1–1.3 ms, the caller ran both shares back to back; 0.55 ms each alone). Stepping aside
   acts only once it runs. So right after each hand-out the caller calls ``sched_yield()`` once
   (``spin.yield_cpu``, outside the GIL): a pool thread queued on its CPU runs at once, steps aside and
   takes its chunk; where none is queued the call returns in about a microsecond.
2. stepping aside through ``os.sched_setaffinity`` held the GIL for the migration (60–80 µs here); the
   caller, back from its yield, slept on the GIL and was woken by the pool thread, on the pool thread's
   new CPU, where it waited for the pool thread's whole run (64→384 @8×8 forward: the pool thread ran
   all 8 chunks, 1.3–1.4 ms, the caller none). ``_step_aside`` calls libc through ctypes, which lets go
   of the GIL.

Measured, 66 1×1 records (22 shapes × 3 directions), batch 32, two threads, one process, before each
timing three NumPy 384² sgemms and ``quiesce``, best of 7, two rounds alternating, main's pool against
this: geometric mean 1.125× faster, sum of the best times 89.5 → 80.9 ms; the weight gradients most
(144→32 @16×16 0.75 → 0.64 ms, 32→192 1.04 → 0.68, 64→384 @8×8 1.16 → 0.73, 960→160 @4×4 1.78 →
1.20), and the two rounds of each record now agree (main's: 1.71 / 1.06 ms for 384→96 forward). In
an earlier run of the same kind, main's against the yield with the step-aside through ctypes: 1.191×;
yielding only when a thread was rung or an awake one last polled on the caller's CPU (published from
its wait loop): 1.085×, so the caller always yields. The training step did not move
(``benchmarks/offload_threads.py``, the configurations' steps alternating in one process, median
step, main's pool / this): MobileNetV2 24 steps 269.2 / 272.9 ms and 255.4 / 256.2 ms, ResNet-18 12
steps 430.2 / 436.2 ms; the step-aside through ctypes without the yield 280.1 ms. (In separate
processes, ``bench_train.py --frameworks engine``, MobileNetV2 ran 88.6–115.8 images/s on main and
87.1–109.8 on this: this machine's noise, ±12%, is larger than either change.)
``ENGINE_HAND_OUT_YIELD=0`` turns the yield off (``yield_after_hand_out``).
"""

from __future__ import annotations

import ctypes
import itertools
import os
import queue
import threading
from collections.abc import Callable

from kernels.cpu import spin
from kernels.errors import SettingError

_lock = threading.Lock()
_pool: _Pool | None = None
_pool_size = 0


def _microseconds(name: str, default: float) -> float:
    """``name``'s value as a number of microseconds ≥ 0 (``default`` when unset); anything else is a
    ``SettingError`` that says what to set, one line on the command line."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 <= value < float("inf"):
        raise SettingError(f"{name}={text!r} is not a number of microseconds >= 0: set one (0 turns that wait "
                           f"off), or unset it for {default:g}")
    return value


SPIN_MICROSECONDS = _microseconds("ENGINE_SPIN_US", 100.0)
"""How long a pool thread waits awake for the next hand-out before it sleeps (module docstring, "Pool
threads wait awake"); ``ENGINE_SPIN_US=0`` makes them sleep at once, as before."""
WAIT_MICROSECONDS = _microseconds("ENGINE_WAIT_SPIN_US", 1000.0)
"""How long the caller waits awake for the pool's last chunk before it sleeps (module docstring);
``ENGINE_WAIT_SPIN_US=0``: it sleeps at once, as before."""
_numba_pool_started = False
_worker_ids: list[int] = []  # the pool's threads (native ids), as they start
_kept_off: int | None = None  # the CPU the workers were last kept off (``_keep_workers_off_caller``)
# off unless ENGINE_PIN_SHARES=1 (module docstring: it cost MobileNetV2's training step ~7%); cleared for
# good at the first refusal
_pinning = hasattr(os, "sched_setaffinity") and os.environ.get("ENGINE_PIN_SHARES", "0").strip() == "1"


def _load_getcpu() -> Callable[[], int] | None:
    try:
        getcpu = ctypes.CDLL(None, use_errno=True).sched_getcpu
    except (OSError, AttributeError):
        return None
    getcpu.restype, getcpu.argtypes = ctypes.c_int, []
    return getcpu


def _load_setaffinity() -> Callable[[int, int, object], int] | None:
    """libc's ``sched_setaffinity`` through ctypes, which lets go of the GIL for the call (``os.sched_setaffinity``
    holds it: see ``_step_aside``)."""
    try:
        setaffinity = ctypes.CDLL(None, use_errno=True).sched_setaffinity
    except (OSError, AttributeError):
        return None
    setaffinity.restype, setaffinity.argtypes = ctypes.c_int, [ctypes.c_int, ctypes.c_size_t, ctypes.c_void_p]
    return setaffinity


_getcpu = _load_getcpu() if hasattr(os, "sched_setaffinity") else None
_setaffinity = _load_setaffinity() if _getcpu is not None else None
_masks: dict[frozenset[int], ctypes.Array] = {}  # cpu_set_t buffers for ``_setaffinity``, by CPU set
_stepping_aside = _getcpu is not None and os.environ.get("ENGINE_STEP_ASIDE", "1").strip() != "0"
yield_after_hand_out = spin.SUPPORTED and os.environ.get("ENGINE_HAND_OUT_YIELD", "1").strip() != "0"
"""The caller yields its CPU once right after each hand-out (module docstring, "The caller yields after the
hand-out"); ``ENGINE_HAND_OUT_YIELD=0`` turns it off. A plain module flag so one process can time both."""


def start_numba_pool() -> None:
    """Start Numba's thread pool with its OpenMP workers sleeping when idle (``OMP_WAIT_POLICY``).

    OpenMP reads the variable once, when Numba's pool loads it, so this must run before anything
    else calls into Numba's threading (``numba.set_num_threads``, a ``prange`` kernel): both
    ``kernels.cpu`` (at import) and ``engine.threads`` call it first. The variable is set only for
    that moment and restored after (a value the user set is left alone), but the runtime it
    configured is the process's only one: a PyTorch imported later in the same process loads no
    ``libgomp.so.1`` of its own (the soname is already loaded) and runs on this passive one, and a
    PyTorch imported *before* this call makes Numba's pool run on torch's spinning runtime. So
    ``engine kernels --compare torch`` times torch in a process of its own
    (``engine.bench.kernels.TorchProcess``, with the figures). Idempotent; does nothing once the
    pool runs.
    """
    global _numba_pool_started
    if _numba_pool_started:
        return
    import numba

    with _lock:
        previous = os.environ.get("OMP_WAIT_POLICY")
        if previous is None:
            os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
        if "NUMBA_THREADING_LAYER" not in os.environ and "NUMBA_THREADING_LAYER_PRIORITY" not in os.environ:
            # OpenMP first: this module's tuning is OpenMP's (the wait policy above), and Numba's
            # default order puts TBB first, which the mkl dependency installs beside it.
            numba.config.THREADING_LAYER_PRIORITY = ["omp", "tbb", "workqueue"]
        try:
            numba.get_num_threads()  # launches the pool: the OpenMP runtime loads and reads the variable
        finally:
            if previous is None:
                del os.environ["OMP_WAIT_POLICY"]
        _numba_pool_started = True


def _register_worker() -> None:
    global _kept_off
    with _lock:
        _worker_ids.append(threading.get_native_id())
        _kept_off = None  # the next call pins this one too


class _Pool:
    """The pool's threads (slots 1 … ``workers``): each runs the latest job handed out (``hand_out``),
    then waits for the next one awake for ``SPIN_MICROSECONDS`` (``spin.wait_for_change``, outside the
    GIL), then asleep on its own bell (a ``SimpleQueue``) until a hand-out rings it.

    No lock is shared by the caller and the pool threads: the hand-out and the going-to-sleep are
    sequenced by the GIL (a flag per thread, set before the counter is read again), so a caller never
    blocks on a pool thread that is about to sleep (a shared ``Condition`` did, and was then woken by
    that thread: a first version lost ResNet-18's training step ~8% to it)."""

    def __init__(self, workers: int, spin_microseconds: float, register: bool = False) -> None:
        self.register = register  # the process's pool: its threads' ids go to ``_worker_ids``
        self.counter = spin.counter()  # hand-outs so far
        self.job: _Chunks | None = None  # the latest hand-out
        self.asleep = [False] * (workers + 1)
        self.bells = [queue.SimpleQueue() for _ in range(workers + 1)]
        self.sleeps = 0  # times a thread fell asleep (the tests read it)
        self.closed = False
        self.ticks = int(spin_microseconds * spin.ticks_per_microsecond()) if spin.SUPPORTED else 0
        self.wait_ticks = int(WAIT_MICROSECONDS * spin.ticks_per_microsecond()) if spin.SUPPORTED else 0
        spin.yield_cpu()  # compiled (or loaded) with the pool, as wait_for_change is: warm-up workers start one too
        self.threads = [
            threading.Thread(target=self._loop, args=(slot,), name=f"conv_{slot}", daemon=True)
            for slot in range(1, workers + 1)
        ]
        for thread in self.threads:
            thread.start()

    def hand_out(self, job: _Chunks) -> None:
        self.job = job
        self.counter[0] += 1
        for slot in range(1, len(self.bells)):
            if self.asleep[slot]:
                self.asleep[slot] = False
                self.bells[slot].put(None)

    def close(self) -> None:
        self.closed = True
        self.counter[0] += 1
        for bell in self.bells[1:]:
            bell.put(None)
        for thread in self.threads:
            thread.join()

    def _loop(self, slot: int) -> None:
        if self.register:
            _register_worker()
        seen = 0
        while True:
            current = spin.wait_for_change(self.counter, seen, self.ticks) if self.ticks > 0 else seen
            while current == seen and not self.closed:
                self.asleep[slot] = True
                if int(self.counter[0]) != seen:  # a hand-out came in between: no bell will ring
                    self.asleep[slot] = False
                else:
                    self.sleeps += 1
                    self.bells[slot].get()  # (a stale ring only costs one more turn of this loop)
                current = int(self.counter[0])
            if self.closed:
                return
            seen, job = current, self.job
            if job is not None and slot < job.slots:
                if _stepping_aside and job.cpu >= 0 and _getcpu is not None and _getcpu() == job.cpu:
                    _step_aside(job.cpu)
                job.run(slot)


def _get_pool(workers: int) -> _Pool:
    global _pool, _pool_size, _kept_off
    with _lock:
        if _pool is None or _pool_size < workers:
            if _pool is not None:
                _pool.close()
                _worker_ids.clear()
            _pool = _Pool(workers, SPIN_MICROSECONDS, register=True)
            _pool_size = workers
            _kept_off = None
        return _pool


def _cpu_mask(cpus: frozenset[int]) -> ctypes.Array:
    mask = _masks.get(cpus)
    if mask is None:
        mask = (ctypes.c_uint64 * (max(cpus) // 64 + 1))()
        for cpu in cpus:
            mask[cpu // 64] |= 1 << (cpu % 64)
        _masks[cpus] = mask
    return mask


def _step_aside(cpu: int) -> None:
    """Move the calling (pool) thread off ``cpu`` now, then let it run anywhere again (module
    docstring, "A woken thread steps aside"): the first ``sched_setaffinity`` migrates it at once, the
    second only widens its mask back. A refusal turns this off for good.

    Through ctypes, outside the GIL (module docstring, "The caller yields after the hand-out"): the
    migration took 60–80 µs here, and ``os.sched_setaffinity`` holds the GIL for it, so the caller,
    back from its yield, slept on the GIL and was woken by this thread, on this thread's new CPU,
    behind its share."""
    global _stepping_aside
    try:
        with _lock:  # not across ``_keep_workers_off_caller``: a pin set between the two calls was undone by the
            # second (a worker that woke late for a call the caller had finished alone stepped aside while the
            # next call pinned it: ENGINE_PIN_SHARES=1's test failed 2 of 16 runs under load, 2026-11-28)
            allowed = frozenset(os.sched_getaffinity(0))
            others = allowed - {cpu}
            if others:
                if _setaffinity is None:  # no libc call to reach: the GIL-holding one
                    os.sched_setaffinity(0, others)
                    os.sched_setaffinity(0, allowed)
                    return
                for cpus in (others, allowed):
                    mask = _cpu_mask(cpus)
                    if _setaffinity(0, ctypes.sizeof(mask), mask) != 0:
                        raise OSError(ctypes.get_errno(), "sched_setaffinity")
    except OSError:
        _stepping_aside = False


def _keep_workers_off_caller() -> None:
    """Let the pool's threads run on any of the caller's CPUs but the one the caller runs on now.

    Why (see the module docstring, "Where a woken share runs"): the wake-up would otherwise often
    queue the share behind the caller's own. A system call only when the caller has moved since
    the last call (or a worker started); a refusal (EPERM, a thread gone) turns this off for good.
    """
    global _kept_off, _pinning
    if _getcpu is None:
        return
    cpu = _getcpu()
    with _lock:
        if cpu == _kept_off or cpu < 0:
            return
        try:
            allowed = os.sched_getaffinity(0)
            others = allowed - {cpu}
            for tid in _worker_ids:
                os.sched_setaffinity(tid, others or allowed)
        except OSError:
            _pinning = False
            return
        _kept_off = cpu


CHUNKS_PER_THREAD = 4
"""At most this many chunks per thread in a call split by ``chunk_count``."""


def chunk_count(items: int, per_chunk: int, threads: int) -> int:
    """How many fixed chunks to cut ``items`` into for ``run_chunks``: about ``per_chunk`` items each
    (a conv's column tile: a smaller chunk would shrink its GEMMs), at least one per thread and at
    most ``CHUNKS_PER_THREAD`` per thread; never more than ``items``. Depends on the shapes and the
    thread count only, so a call's chunks, and its bits, are the same every time."""
    wanted = -(-items // max(1, per_chunk))
    return max(1, min(items, max(threads, min(wanted, CHUNKS_PER_THREAD * threads))))


class _Chunks:
    """One call's chunks: taken in order by whichever thread is free, counted as they finish."""

    def __init__(self, work: Callable[[int, int], object], chunks: int, slots: int) -> None:
        self.work = work
        self.chunks = chunks
        self.slots = slots  # threads 0 … slots - 1 may take chunks (each has its scratch slice)
        self.cpu = _getcpu() if _stepping_aside and _getcpu is not None else -1  # the caller's, at hand-out
        self.take = itertools.count().__next__  # atomic under the GIL: each chunk is taken once
        self.left = chunks
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.finished = spin.counter()  # 1 once every chunk has finished: the caller's awake wait reads it
        self.error: BaseException | None = None

    def run(self, slot: int) -> None:
        while True:
            chunk = self.take()
            if chunk >= self.chunks:
                return
            try:
                self.work(chunk, slot)
            except BaseException as exc:  # raised by the caller once every chunk has finished
                with self.lock:
                    if self.error is None:
                        self.error = exc
            with self.lock:
                self.left -= 1
                if self.left == 0:
                    self.finished[0] = 1
                    self.done.set()


def run_chunks(work: Callable[[int, int], object], chunks: int, threads: int) -> None:
    """``work(chunk, slot)`` for every ``chunk`` in ``range(chunks)``, on up to ``threads`` threads.

    The calling thread (slot 0) and the pool's threads (slots 1 …) take chunks in order, each as
    soon as it is free; ``slot`` says which thread runs a chunk, so a chunk uses that thread's
    scratch. Which thread runs which chunk varies from call to call; what a chunk computes must
    not (each writes its own outputs, or its own partial sum added later in chunk order), so the
    results are the same bits whoever ran them. Returns when every chunk has finished, without
    waiting for a pool thread that woke too late to find one. An exception in any chunk is raised
    here, after every chunk has finished.
    """
    if threads <= 1 or chunks <= 1:
        for chunk in range(chunks):
            work(chunk, 0)
        return
    job = _Chunks(work, chunks, min(threads, chunks))
    pool = _get_pool(threads - 1)
    if _pinning:
        _keep_workers_off_caller()
    pool.hand_out(job)
    if yield_after_hand_out:
        spin.yield_cpu()  # a pool thread queued on this CPU runs now and steps aside (module docstring)
    job.run(0)
    if pool.wait_ticks > 0 and not job.done.is_set():
        spin.wait_for_change(job.finished, 0, pool.wait_ticks)  # awake, outside the GIL: see the module docstring
    job.done.wait()
    if job.error is not None:
        raise job.error


def run_shares(work: Callable[[int], object], threads: int) -> None:
    """``work(t)`` for every ``t`` in ``range(threads)``; returns when all are done.

    Share ``t`` is a fixed slice of the work with scratch slice ``t``, so any thread may run it:
    the shares are taken in order by whichever thread is free (``run_chunks``), and a share the
    pool's thread has not started yet (it is still waking up, or the IO threads hold its core)
    runs on the calling thread instead of being waited for. An exception in any share is raised
    here, after every share has finished."""
    run_chunks(lambda share, slot: work(share), threads, threads)


RANGE_MIN_VALUES = 1 << 16
"""Values a thread's range holds at least in ``run_ranges``; a smaller call runs on the calling thread
(a pool round trip costs tens of microseconds)."""


def run_ranges(work: Callable[[int, int], object], items: int, threads: int, item_values: int = 1) -> None:
    """``work(lo, hi)`` over fixed contiguous ranges of ``[0, items)``: one per thread (``run_shares``)
    when each range holds at least ``RANGE_MIN_VALUES`` values (``item_values`` per item), else fewer,
    and one range on the calling thread when the work is that small. The ranges depend on ``items``,
    ``threads`` and ``item_values`` only.

    The batch-norm, optimizer, global-pool and dense-bias kernels run their shares here rather than
    as ``prange`` loops: a ``parallel=True`` kernel compiles 3–5× longer on a cold cache than the same
    loop as a serial kernel (batch norm's training forward 1.39 → 0.31 s; ``engine/warmup.py`` has
    the figures). The element-wise kernels too, each with a loop for the in-place call
    (``kernels/cpu/elementwise.py`` says why that loop)."""
    min_items = -(-RANGE_MIN_VALUES // max(1, item_values))
    shares = max(1, min(threads, items // min_items))
    if shares == 1:
        work(0, items)
        return
    run_shares(lambda t: work(t * items // shares, (t + 1) * items // shares), shares)

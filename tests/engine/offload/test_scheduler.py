"""OffloadScheduler end to end: the same bits with any window, bounded memory, adaptive N, failures, cleanup."""

import dataclasses
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from engine.backend import get_backend
from engine.offload import OffloadError, OffloadScheduler
from engine.offload.storage import DIR_PREFIX
from engine.optim import SGD
from models import build_model
from tests.scripts import load_script

MLP = dict(input_shape=(3, 8, 8), hidden=32, depth=8)
RESNET = dict(image_size=8)


@pytest.fixture(scope="module")
def cpu():
    return get_backend("cpu")


def batches(steps, batch, shape, seed=1):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        yield (rng.standard_normal((batch, *shape)).astype(np.float32), rng.integers(0, 10, batch).astype(np.int64))


def train(backend, model, window, steps, batch, options, directory, shape, **scheduler_options):
    """Train with SGD+momentum; returns (state dict, scheduler stats or None)."""
    net = build_model(model, num_classes=10, backend=backend, seed=0, **options)
    optimizer = SGD(net.parameters, net.gradients, backend, lr=0.05, momentum=0.9)
    scheduler = None
    if window is not None:
        scheduler = OffloadScheduler(backend, window, directory=str(directory), **scheduler_options).attach(net)
    try:
        for x, y in batches(steps, batch, shape):
            net.forward(backend.to_device(x), training=True)
            net.loss(backend.to_device(y))
            net.backward()
            optimizer.step()
        return net.state_dict(), (list(scheduler.stats) if scheduler else None), scheduler
    finally:
        if scheduler is not None:
            scheduler.close()
        net.close()


_RUNS = {}


def train_once(backend, model, window, steps, batch, options, directory, shape):
    """``train`` without scheduler options, run once per module and shared: the run without offload that
    several tests compare their weights with, and the plain window-1 run their bytes are measured against,
    are deterministic (same seed, same bits), and ResNet-18's took ~1 s each, 11 times."""
    key = (model, window, steps, batch, tuple(sorted(options.items())), shape)
    if key not in _RUNS:
        _RUNS[key] = train(backend, model, window, steps, batch, options, directory, shape)
        assert swap_dirs(directory) == []  # the run removed its directory
    return _RUNS[key]


def assert_bounded(stats):
    for s in stats:
        assert 0 < s.peak_resident_bytes <= s.bound_bytes  # resident offloadable bytes within the window
        assert s.bytes_written == s.bytes_read  # everything written is read back once, nothing more


def swap_dirs(path):
    return [p for p in os.listdir(path) if p.startswith(DIR_PREFIX)]


@pytest.mark.parametrize(
    "model, options, shape, steps",
    [("mlp", MLP, (3, 8, 8), 4), ("resnet18", RESNET, (3, 8, 8), 2)],
    ids=["mlp", "resnet18"],
)
def test_weights_are_bit_identical_with_any_window(cpu, tmp_path, model, options, shape, steps):
    reference, _, _ = train_once(cpu, model, None, steps, 2, options, tmp_path, shape)
    for window in (1, 2, 4, "auto"):
        weights, stats, scheduler = train_once(cpu, model, window, steps, 2, options, tmp_path, shape)
        for key in reference:
            assert np.array_equal(reference[key], weights[key]), f"window {window}: {key} differs"
        assert_bounded(stats)
        assert scheduler.wait_timeouts == 0  # every wait was woken (targeted wake-ups, _wake), none timed out
        plan = scheduler._plan
        assert plan.arena_bytes < plan.total_bytes  # offload really lowers the resident bytes
        if window == 1:
            assert all(s.bytes_written > 0 for s in stats)
    assert swap_dirs(tmp_path) == []  # every run removed its directory


def test_relu_outputs_are_recomputed_not_swapped_with_the_same_bits(cpu, tmp_path):
    """A ReLU after a batch norm is rebuilt from the kept batch-norm output: fewer bytes written, same weights,
    whatever the verify mode."""
    shape = (3, 8, 8)
    reference, _, _ = train_once(cpu, "resnet18", None, 2, 2, RESNET, tmp_path, shape)
    runs = {}
    for recompute, verify in ((False, "full"), (True, "full"), (True, "header"), (True, "off")):
        if (recompute, verify) == (True, "full"):  # the scheduler's defaults: the shared plain window-1 run
            weights, stats, scheduler = train_once(cpu, "resnet18", 1, 2, 2, RESNET, tmp_path, shape)
            assert (scheduler.recompute, scheduler.verify) == (recompute, verify)
        else:
            weights, stats, scheduler = train(cpu, "resnet18", 1, 2, 2, RESNET, tmp_path, shape, recompute=recompute,
                                              verify=verify)
        for key in reference:
            assert np.array_equal(reference[key], weights[key]), f"recompute {recompute}, {verify}: {key} differs"
        assert_bounded(stats)
        runs[recompute, verify] = stats[-1], scheduler._plan
    swapped, plain_plan = runs[False, "full"]
    rebuilt, plan = runs[True, "full"]
    assert swapped.recomputed_bytes == 0 and rebuilt.recomputed_bytes > 0 and rebuilt.recompute_s > 0
    assert {u.decision for u in plan.recomputed} == {"recompute"}
    assert all(u.spec.name.endswith("relu") or ".relu" in u.spec.name for u in plan.recomputed)
    chains = [u.recompute.nodes for u in plan.recomputed]
    assert any(len(c) == 1 for c in chains) and any(len(c) == 2 for c in chains)  # ReLU, and Add then ReLU
    assert rebuilt.bytes_written < 0.75 * swapped.bytes_written
    assert plan.offloaded_bytes < 0.8 * plain_plan.offloaded_bytes  # whole pages: tiny shapes round up


def test_auto_window_grows_when_storage_is_slow(cpu, tmp_path):
    def slow(operation, nbytes):
        if operation == "read":
            time.sleep(0.03)

    _, stats, scheduler = train(cpu, "mlp", "auto", 6, 2, MLP, tmp_path, (3, 8, 8), delay=slow)
    assert stats[0].window == 1
    assert stats[0].load_wait_s > 0  # the executor waited for a load...
    assert scheduler.window > stats[0].window  # ...so the window grew
    assert [s.window for s in stats] == sorted(s.window for s in stats)
    assert_bounded(stats)


def test_auto_predicts_load_times_and_starts_loads_that_far_ahead(cpu, tmp_path):
    """Reads slowed to a known bandwidth: the loader's lead (steps ahead of the need) grows past N to cover
    the predicted load time, the weights stay the same bits and memory stays inside the plan's arena."""
    def slow(operation, nbytes):
        if operation == "read":
            time.sleep(0.02 + nbytes / 20e6)  # ~20 MB/s plus a fixed cost

    reference, _, _ = train(cpu, "mlp", None, 5, 2, MLP, tmp_path, (3, 8, 8))
    weights, stats, scheduler = train(cpu, "mlp", "auto", 5, 2, MLP, tmp_path, (3, 8, 8), delay=slow,
                                      shrink_after=100)
    for key in reference:
        assert np.array_equal(reference[key], weights[key]), key
    assert stats[0].lead_steps == stats[0].window  # nothing measured yet: the lead is N
    assert 0 < scheduler._bandwidth < 1e9 and all(s.read_bandwidth_bps > 0 for s in stats)
    assert any(s.lead_steps > s.window for s in stats[1:])  # a prediction reached further than N
    assert all(lead >= scheduler.window for lead in scheduler._lead.values())
    assert_bounded(stats)


def test_a_fixed_window_predicts_load_times_only_when_asked(cpu, tmp_path):
    """With a fixed N and ``predict_leads=True`` the loader predicts load times (Capuchin's feedback): on
    a slow disk some load starts more than N steps ahead, the window itself stays N, memory stays in the
    plan's arena and the weights keep their bits; by default (DESIGN.md's N+2 at most) every load starts
    exactly N steps ahead."""
    def slow(operation, nbytes):
        if operation == "read":
            time.sleep(0.02 + nbytes / 20e6)

    reference, _, _ = train(cpu, "mlp", None, 4, 2, MLP, tmp_path, (3, 8, 8))
    weights, stats, scheduler = train(cpu, "mlp", 1, 4, 2, MLP, tmp_path, (3, 8, 8), delay=slow, predict_leads=True)
    for key in reference:
        assert np.array_equal(reference[key], weights[key]), key
    assert [s.window for s in stats] == [1, 1, 1, 1]
    assert stats[0].lead_steps == 1  # nothing measured yet
    assert any(s.lead_steps > 1 for s in stats[1:])
    assert_bounded(stats)
    _, plain, _ = train(cpu, "mlp", 1, 4, 2, MLP, tmp_path, (3, 8, 8), delay=slow)
    assert [s.lead_steps for s in plain] == [1, 1, 1, 1]
    # what the earlier loads buy (less stall) is a timing, measured in engine bench and
    # benchmarks/offload_costs.py, not asserted here


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs a RAM-backed directory for instant storage")
def test_auto_window_shrinks_to_its_minimum_when_storage_is_instant(cpu, tmp_path):
    # Layers wide enough that a step outlasts a thread wake-up on a busy machine: "instant" storage
    # must not look slow because the loader thread was scheduled a millisecond late.
    wide = dict(MLP, hidden=512)
    _, stats, scheduler = train(cpu, "mlp", "auto", 30, 64, wide, "/dev/shm", (3, 8, 8), initial_window=4,
                                shrink_after=1)
    windows = [s.window for s in stats] + [scheduler.window]
    assert windows[0] == 4
    assert min(windows) == scheduler.min_window == 1  # shrank all the way (a busy machine may bump it back)
    assert_bounded(stats)


def test_byte_budget_alone_takes_four_layers_and_keeps_units_with_the_rest(cpu, tmp_path):
    net = build_model("mlp", num_classes=10, backend=cpu, seed=0, **MLP)
    with OffloadScheduler(cpu, None, budget_bytes=10**9, directory=str(tmp_path)) as scheduler:
        scheduler.attach(net, batch_size=2)
        assert scheduler.window == 4 < scheduler.max_window
        assert not scheduler.plan_for(2).offloaded  # a huge budget: nothing needs to go to disk
    with OffloadScheduler(cpu, 1, directory=str(tmp_path)) as probe:
        probe.attach(net, batch_size=2)
        one = probe.plan_for(2)
    with OffloadScheduler(cpu, None, budget_bytes=one.arena_bytes, directory=str(tmp_path)) as scheduler:
        scheduler.attach(net, batch_size=2)
        assert scheduler.window == scheduler.max_window < 4  # only a smaller window fits
        assert scheduler.plan_for(2).arena_bytes <= one.arena_bytes
    with OffloadScheduler(cpu, None, budget_bytes=1, directory=str(tmp_path)) as scheduler:
        with pytest.raises(OffloadError, match="budget .* below what the smallest window needs"):
            scheduler.attach(net, batch_size=2)
    with OffloadScheduler(cpu, 4, budget_bytes=one.arena_bytes, directory=str(tmp_path)) as scheduler:
        with pytest.raises(OffloadError, match=r"--offload-n 4 needs .* the budget allows N=[123]$"):
            scheduler.attach(net, batch_size=2)
    net.close()


@pytest.mark.parametrize("window, share", [(1, 0.1), ("auto", 0.1), (1, 0.85)])
def test_a_budget_keeps_units_resident_with_the_same_bits_and_fewer_bytes_written(cpu, tmp_path, window, share):
    """What the window leaves of ``budget_bytes`` keeps swapped units resident, then ReLU outputs instead
    of rebuilding them (``plan.keep_within``): the same weights as without offload, fewer bytes written,
    the arena within the budget."""
    shape = (3, 8, 8)
    reference, _, _ = train_once(cpu, "resnet18", None, 2, 2, RESNET, tmp_path, shape)
    _, plain, plain_scheduler = train_once(cpu, "resnet18", 1, 2, 2, RESNET, tmp_path, shape)
    base = plain_scheduler._plan
    budget = int(base.arena_bytes + share * (base.total_bytes - base.arena_bytes))
    weights, stats, scheduler = train(cpu, "resnet18", window, 2, 2, RESNET, tmp_path, shape, budget_bytes=budget)
    for key in reference:
        assert np.array_equal(reference[key], weights[key]), f"budget {budget}, window {window}: {key} differs"
    assert_bounded(stats)
    assert all(s.bound_bytes <= budget and s.peak_resident_bytes <= budget for s in stats)
    plan = scheduler._plan
    assert any(base.units[key].decision == "swap" for key in plan.kept)
    if share < 0.5:
        assert 0 < stats[-1].bytes_written < 0.8 * plain[-1].bytes_written
    else:  # every swap kept, and ReLU outputs kept instead of rebuilt: fewer rebuilt bytes
        assert stats[-1].bytes_written == 0 and any(base.units[key].decision == "recompute" for key in plan.kept)
        assert stats[-1].recomputed_bytes < plain[-1].recomputed_bytes
    from engine.offload.scheduler import offload_summary

    assert f"{len(scheduler._plan.kept)} kept by the budget" in offload_summary(scheduler._plan)


def test_io_thread_ids_are_the_saver_and_the_loader(cpu, tmp_path):
    """What benchmarks/offload_threads.py uses to tell this scheduler's IO threads from another's."""
    import threading

    with OffloadScheduler(cpu, 2, directory=str(tmp_path)) as scheduler:
        named = {t.native_id for t in threading.enumerate() if t.name.startswith("engine-offload-")}
        assert len(scheduler.io_thread_ids) == 2 and scheduler.io_thread_ids <= named


def test_state_transitions_are_logged(cpu, tmp_path, caplog):
    with caplog.at_level(logging.DEBUG, logger="engine.offload"):
        train(cpu, "mlp", 1, 1, 2, MLP, tmp_path, (3, 8, 8))
    text = caplog.text
    for transition in ("RELEASED -> READY_FOR_EXEC", "READY_FOR_EXEC -> WAIT_FOR_OFF", "WAIT_FOR_OFF -> SWAPPED",
                       "SWAPPED -> WAIT_FOR_EXEC", "WAIT_FOR_EXEC -> READY_FOR_EXEC"):
        assert transition in text
    assert "offload step 0: window 1" in text


def test_a_corrupted_swap_file_stops_training_naming_the_tensor(cpu, tmp_path):
    net = build_model("mlp", num_classes=10, backend=cpu, seed=0, **MLP)
    corrupted = []

    def corrupt_before_first_read(operation, nbytes):
        if operation == "read" and not corrupted:
            with open(scheduler.storage.file_path, "r+b") as f:
                data = bytearray(f.read())
                first = next(i for i, b in enumerate(data) if b)  # a byte that was written
                f.seek(first)
                f.write(bytes([data[first] ^ 0x55]))
            corrupted.append(first)

    scheduler = OffloadScheduler(cpu, 1, directory=str(tmp_path), delay=corrupt_before_first_read).attach(net)
    (x, y), = batches(1, 2, (3, 8, 8))
    with scheduler:
        net.forward(x, training=True)
        net.loss(y)
        with pytest.raises(OffloadError, match=r"checksum mismatch reading layer '\w+', tensor '\w+:\w+'"):
            net.backward()
    assert swap_dirs(tmp_path) == []  # removed after the exception
    net.close()


def test_directory_removed_after_an_exception_in_a_step(cpu, tmp_path):
    net = build_model("mlp", num_classes=10, backend=cpu, seed=0, **MLP)

    seen = []

    class Explode:
        def after_forward(self, step, node):
            if step == 5:
                seen.extend(swap_dirs(tmp_path))
                raise RuntimeError("boom in the middle of a step")

    (x, y), = batches(1, 2, (3, 8, 8))
    with pytest.raises(RuntimeError, match="boom"):
        with OffloadScheduler(cpu, 1, directory=str(tmp_path)).attach(net):
            net.hooks.append(Explode())
            net.forward(x, training=True)
    assert len(seen) == 1  # the swap directory existed during the step...
    assert swap_dirs(tmp_path) == []  # ...and is gone
    net.close()


SIGNAL_SCRIPT = textwrap.dedent(
    """
    import sys
    import numpy as np
    from engine.backend import get_backend
    from engine.offload import OffloadScheduler
    from models import build_model
    backend = get_backend("cpu")
    net = build_model("mlp", num_classes=10, backend=backend, seed=0, input_shape=(3, 8, 8), hidden=32, depth=8)
    scheduler = OffloadScheduler(backend, 1, directory=sys.argv[1]).attach(net, batch_size=2)
    x = np.ones((2, 3, 8, 8), np.float32)
    y = np.zeros(2, np.int64)
    step = 0
    while True:
        net.forward(x, training=True)
        net.loss(y)
        net.backward()
        if step == 0:
            print("READY", scheduler.storage.path, flush=True)
        step += 1
    """
)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_directory_removed_on_signal(tmp_path, signum):
    process = subprocess.Popen([sys.executable, "-c", SIGNAL_SCRIPT, str(tmp_path)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, cwd=os.path.dirname(__file__),
                               preexec_fn=lambda: signal.signal(signum, signal.SIG_DFL))  # not inherited SIG_IGN
    try:
        line = process.stdout.readline()
        assert line.startswith("READY"), process.stderr.read()
        path = line.split()[1]
        assert os.path.isdir(path)
        process.send_signal(signum)
        process.wait(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    if signum == signal.SIGTERM:
        # no handler of ours in a bare process (issue 14: cleanup inside a signal handler could hang and
        # ran even for ignored signals): the default action kills it, its lock dies with it, and the next
        # storage under the same directory removes what it left
        assert process.returncode == -signal.SIGTERM
        from engine.offload.storage import remove_stale_directories

        assert remove_stale_directories(str(tmp_path)) == [path]
    else:
        assert "KeyboardInterrupt" in process.stderr.read()  # unwinds; atexit removes the directory
    assert not os.path.exists(path)
    assert swap_dirs(tmp_path) == []


def test_a_swapped_tensor_cannot_reach_a_kernel(cpu, tmp_path):
    from engine.memory import LeakedWorkspaceError
    from engine.offload import LayerState

    net = build_model("mlp", num_classes=10, backend=cpu, seed=0, **MLP)
    (x, y), = batches(1, 2, (3, 8, 8))
    with OffloadScheduler(cpu, 1, directory=str(tmp_path)).attach(net) as scheduler:
        net.forward(x, training=True)
        net.loss(y)
        kept = net.node("fc2").layer.saved["x"]  # relu1's output, kept for fc2's backward
        unit = scheduler._units[(net.node("relu1").index, "saved")]
        deadline = time.monotonic() + 30
        while unit.state is not LayerState.SWAPPED and time.monotonic() < deadline:
            time.sleep(0.01)
        assert unit.state is LayerState.SWAPPED
        with pytest.raises(LeakedWorkspaceError, match=r"offload:relu1 \(saved\)"):
            kept.check("dense_backward", "x")
        net.backward()  # loaded back in time for its backward: the step completes
    net.close()


def test_a_step_with_another_batch_size_gets_its_own_plan(cpu, tmp_path):
    wide = dict(MLP, hidden=1024, depth=4)  # units larger than a page, so the arena depends on the batch
    net = build_model("mlp", num_classes=10, backend=cpu, seed=0, **wide)
    reference = build_model("mlp", num_classes=10, backend=cpu, seed=0, **wide)
    with OffloadScheduler(cpu, 1, directory=str(tmp_path)).attach(net, batch_size=4) as scheduler:
        for batch in (4, 2, 4, 8):  # a short last batch of an epoch, full batches again, a larger one
            (x, y), = batches(1, batch, (3, 8, 8), seed=batch)
            for model in (net, reference):
                model.forward(x, training=True)
                model.loss(y)
                model.backward()
        bounds = [s.bound_bytes for s in scheduler.stats]
        assert bounds[3] > bounds[0] == bounds[2] > bounds[1]
        assert_bounded(scheduler.stats)
    for key, value in reference.state_dict().items():
        assert np.array_equal(value, net.state_dict()[key])
    net.close()
    reference.close()


def test_a_load_waits_for_the_kernels_that_last_read_its_bytes(cpu, tmp_path, monkeypatch):
    """On a GPU the host marks bytes free when it has *queued* the last kernel reading them, so a load
    into those bytes must make its copy stream wait for the events the executor recorded as it vacated
    them (found on the first real H100 run: without it offload changed ResNet-18's loss). Every load gets
    exactly the events of the earlier occupants the executor vacated; bytes a save vacated need none."""
    import engine.offload.scheduler as scheduler_module
    from engine.offload.staging import HostTransfer

    tokens: list[object] = []
    loads: list[tuple[str, list[object]]] = []

    class RecordingTransfer(HostTransfer):
        def ready_event(self):
            tokens.append(object())
            return tokens[-1]

        def load(self, storage, records, span, file_offset, step=0, after=()):
            loads.append((records[0].layer, list(after)))
            return super().load(storage, records, span, file_offset, step, after)

    monkeypatch.setattr(scheduler_module, "transfer_for", lambda backend, size: RecordingTransfer())
    released: dict[tuple, object] = {}
    original = scheduler_module.OffloadScheduler._release

    def release(self, unit, occupation, event=None):
        if event is not None:
            released[unit.spec.key, occupation] = event
        original(self, unit, occupation, event)

    monkeypatch.setattr(scheduler_module.OffloadScheduler, "_release", release)
    _, stats, scheduler = train(cpu, "resnet18", 1, 1, 2, RESNET, tmp_path, (3, 8, 8))
    plan = scheduler._placed  # the offsets the run used (around the step arena: plan.place_around)
    by_name = {u.spec.name: u for u in plan.units.values()}
    assert loads and any(after for _, after in loads)
    for name, after in loads:
        predecessors = plan.predecessors[by_name[name].spec.key, 1]
        expected = [released[p] for p in predecessors if p in released]
        assert after == expected, name


def vm_flags(address):
    """The VmFlags of the mapping of this process that holds ``address`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux's /proc/self/smaps")
def test_the_cpu_arena_asks_for_huge_pages(cpu, tmp_path):
    """The arena is an anonymous mapping (so freed pages go back to the OS); it asks for 2 MiB pages like
    NumPy's own large blocks, which cut the IO threads' CPU per step by a quarter (scheduler docstring)."""
    net = build_model("mlp", num_classes=10, backend=cpu, seed=0, **MLP)
    with OffloadScheduler(cpu, 1, directory=str(tmp_path)).attach(net) as scheduler:
        x, y = next(batches(1, 2, (3, 8, 8)))
        net.forward(cpu.to_device(x), training=True)
        net.loss(cpu.to_device(y))
        net.backward()
        assert "hg" in vm_flags(scheduler._arena.ctypes.data)  # madvise(MADV_HUGEPAGE)
    net.close()


@pytest.mark.parametrize("model, size, share", [("resnet18", 8, 0.2), ("mobilenetv2", 16, 0.8)])
def test_rebuild_sources_are_checked_by_the_executor_not_hashed_by_the_io_threads(cpu, tmp_path, model, size, share):
    """A ReLU/ReLU6 rebuild's source (a swapped batch-norm output) is summed by the ReLU's forward and again by
    the rebuild's own pass; the storage hashes everything else, and the weights stay the same bits."""
    shape = (3, size, size)
    reference, _, _ = train_once(cpu, model, None, 2, 2, dict(image_size=size), tmp_path, shape)
    weights, stats, scheduler = train_once(cpu, model, 1, 2, 2, dict(image_size=size), tmp_path, shape)
    for key in reference:
        assert np.array_equal(reference[key], weights[key]), key
    checked = stats[-1].executor_checked_bytes
    assert checked > share * stats[-1].bytes_written  # a real share of the bytes (MobileNetV2: most of them)
    assert all(s.executor_checked_bytes == checked for s in stats)
    assert scheduler.swap_report()["executor_checked_bytes"] == checked  # the memory log's line
    storage = scheduler.storage
    assert storage.checked_elsewhere  # file offsets of the records the executor checks
    # every byte written and read is hashed once by the storage, except the executor's
    moved = sum(s.bytes_written + s.bytes_read for s in stats)
    assert storage.bytes_hashed == moved - 2 * sum(s.executor_checked_bytes for s in stats)
    _, header_stats, _ = train(cpu, model, 1, 2, 2, dict(image_size=size), tmp_path, shape, verify="header")
    assert all(s.executor_checked_bytes == 0 for s in header_stats)  # full mode only


def test_a_flipped_byte_in_a_tensor_the_executor_checks_stops_training_naming_it(cpu, tmp_path):
    net = build_model("resnet18", num_classes=10, backend=cpu, seed=0, **RESNET)
    flipped = []

    def corrupt_a_checked_record(operation, nbytes):
        offsets = sorted(scheduler.storage.checked_elsewhere)
        if operation == "read" and not flipped and offsets:
            where = offsets[len(offsets) // 2] + 5  # inside a record only the executor checks
            with open(scheduler.storage.file_path, "r+b") as f:
                f.seek(where)
                byte = f.read(1)
                f.seek(where)
                f.write(bytes([byte[0] ^ 0x04]))
            flipped.append(where)

    scheduler = OffloadScheduler(cpu, 1, directory=str(tmp_path), delay=corrupt_a_checked_record).attach(net)
    (x, y), = batches(1, 2, (3, 8, 8))
    with scheduler:
        net.forward(x, training=True)
        net.loss(y)
        with pytest.raises(OffloadError, match=r"checksum mismatch reading layer '[\w.]+', tensor '[\w.]+:out'"):
            net.backward()
    assert flipped
    assert swap_dirs(tmp_path) == []
    net.close()


@pytest.mark.parametrize("model, options, shape, budget", [
    ("resnet18", RESNET, (3, 8, 8), 200_000), ("mobilenetv2", dict(image_size=16), (3, 16, 16), 2_000_000)])
def test_the_inline_schedule_keeps_the_bits_with_any_window(cpu, tmp_path, monkeypatch, model, options, shape, budget):
    """With the pinned host tier of a GPU run the executor queues every save and load itself, at the step the
    loader thread would have (``_issue_loads``), and nothing may wait (an inline wait raises). The same
    schedule here through the cpu storage: real models, rebuilds, budgets and auto keep the bits, and the
    IO threads get no work."""
    import engine.offload.scheduler as scheduler_module
    from engine.offload.staging import HostTransfer

    class InlineTransfer(HostTransfer):
        def inline(self, storage):
            return True

    monkeypatch.setattr(scheduler_module, "transfer_for", lambda backend, size: InlineTransfer())
    reference, _, _ = train_once(cpu, model, None, 2, 2, options, tmp_path, shape)
    for window, extra in ((1, {}), (2, {}), (4, {}), ("auto", {}), (1, {"budget_bytes": budget})):
        weights, stats, scheduler = train(cpu, model, window, 2, 2, options, tmp_path, shape, **extra)
        for key in reference:
            assert np.array_equal(reference[key], weights[key]), f"window {window} {extra}: {key} differs"
        assert scheduler._inline and all(s.stall_s == 0 and s.bytes_read == s.bytes_written for s in stats)
        assert all(s.offload_s == s.onload_s == 0 for s in stats)  # the IO threads did nothing
        assert_bounded(stats)


def test_units_share_one_region_with_the_step_arena_and_keep_their_bits_on_a_slow_disk(cpu, tmp_path):
    """Without a byte budget the units sit in the bytes the step arena's tensors leave free (``plan.place_around``):
    no unit shares bytes with a step tensor alive at the same moment, the region is smaller than the two arenas
    side by side, and on a disk slow enough that saves lag past their spans (the executor then waits before a step
    tensor moves into their bytes) and loads start early (``predict_leads``: the loader waits until the executor
    has passed the step tensors that held the bytes), the weights keep their bits."""
    from engine.offload.plan import check_plan, place_around
    from engine.offload.scheduler import step_arena_tensors

    shape = (3, 8, 8)
    net = build_model("resnet18", num_classes=10, backend=cpu, seed=0, **RESNET)
    scheduler = OffloadScheduler(cpu, 1, directory=str(tmp_path)).attach(net)
    try:
        tensors, step_bytes = step_arena_tensors(net, 2)
        plan = scheduler.plan_for(2)
        layout = place_around(plan, tensors, step_bytes)
        check_plan(layout.plan)
        assert layout.region_bytes < -(-step_bytes // 4096) * 4096 + plan.arena_bytes
        assert layout.waits and layout.gates
        if layout.step_offsets is not None:  # placed together with the units: the step tensors moved too
            tensors = [dataclasses.replace(t, offset=o) for t, o in zip(tensors, layout.step_offsets)]
        assert max(t.offset + t.nbytes for t in tensors) <= layout.step_bytes <= layout.region_bytes
        for unit in layout.plan.units.values():
            lo, hi = unit.arena_offset, unit.arena_offset + unit.nbytes
            for t in tensors:
                if t.offset < hi and lo < t.offset + t.nbytes:
                    assert all(t.last < o.start or o.end < t.first for o in unit.occupations), unit.spec.label
                    for o in unit.occupations:
                        if t.last < o.start:
                            assert layout.gates[(unit.key, o.index)] >= t.last
                        else:
                            assert (unit.key, o.index) in layout.waits[t.first]
        x, y = next(batches(1, 2, shape))
        net.forward(cpu.to_device(x), training=True)
        net.loss(cpu.to_device(y))
        net.backward()
        base = scheduler._arena.__array_interface__["data"][0]
        assert net.arena._block.__array_interface__["data"][0] == base  # the step arena's block: our region's start
        assert [t.offset for t in net.arena.plan.tensors] == [t.offset for t in tensors]  # where the layout put them
    finally:
        scheduler.close()
        net.close()
    assert net.arena.host is None  # detached: the arena takes a block of its own again

    def slow(operation, nbytes):
        time.sleep(0.004 + nbytes / 40e6)

    reference, _, _ = train_once(cpu, "resnet18", None, 2, 2, RESNET, tmp_path, shape)
    weights, stats, shared = train(cpu, "resnet18", 1, 2, 2, RESNET, tmp_path, shape, delay=slow, predict_leads=True)
    for key in reference:
        assert np.array_equal(reference[key], weights[key]), key
    assert shared._waits and shared._placed.arena_bytes == stats[-1].bound_bytes
    assert any(s.room_wait_s > 0 for s in stats)  # saves lagged: a step tensor (or a unit) waited for their bytes
    # MobileNetV2 on 16×16 planes: its step tensors and its units are placed together (the step arena's own
    # offsets move: PlannedArena.host's step_plan), with the same bits
    small, shape = dict(image_size=16), (3, 16, 16)
    reference, _, _ = train(cpu, "mobilenetv2", None, 2, 4, small, tmp_path, shape)
    weights, stats, together = train(cpu, "mobilenetv2", 1, 2, 4, small, tmp_path, shape,
                                     delay=lambda operation, nbytes: time.sleep(0.002), predict_leads=True)
    for key in reference:
        assert np.array_equal(reference[key], weights[key]), key
    assert [layout.step_offsets is not None for _, layout in together._layouts.values()] == [True]
    _, _, apart = train(cpu, "resnet18", 1, 1, 2, RESNET, tmp_path, (3, 8, 8), share_arena=False)
    assert apart._placed is apart._plan and not apart._waits  # off: the units' own arena, as before
    budgeted = OffloadScheduler(cpu, 1, budget_bytes=1 << 30, directory=str(tmp_path))
    assert not budgeted.attach(build_model("resnet18", num_classes=10, backend=cpu, seed=0, **RESNET)).sharing
    budgeted.close()


def test_shared_region_benchmark_reports_regions_within_their_bounds():
    """``benchmarks/shared_region.py`` (the figures in ``place_around``'s docstring): one region never more than the
    two arenas side by side, never less than the most both hold at one moment."""
    for row in load_script("shared_region").rows(["resnet18", "mobilenetv2"], [2], [1, 2], "recompute", 16):
        assert row["lower_bound_bytes"] <= row["region_bytes"] <= row["apart_bytes"], row
        assert row["extra_bytes"] == max(0, row["region_bytes"] - row["step_arena_bytes"]), row

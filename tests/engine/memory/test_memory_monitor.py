import gc
import json

import numpy as np
import pytest

from engine.backend import get_backend
from engine.memory import ArrayType, ContiguousBlock, GcPolicy, MemoryMonitor, WorkspaceManager

CPU = get_backend("cpu")


def step(mgr: WorkspaceManager, batch: int) -> None:
    with mgr.iteration():
        mgr.leverage_to(ArrayType.INPUT, np.ones((batch, 8), np.float32))
        with mgr.layer(0):
            mgr.create(ArrayType.FF_WORKING_MEM, (batch * 4,))
            mgr.create(ArrayType.ACTIVATIONS, (batch, 16))
            mgr.create(ArrayType.FF_CACHE, (batch, 16))
        with mgr.layer(0):
            mgr.create(ArrayType.ACTIVATION_GRAD, (batch, 16))


def test_json_lines_per_step_and_flat_counters_after_learning(tmp_path):
    mgr = WorkspaceManager(CPU, "training")
    eval_mgr = mgr.sub_manager("inference", name="eval")
    params = ContiguousBlock(CPU, ArrayType.PARAMETERS, [("w", (16, 8)), ("b", (16,))], manager=mgr)
    path = tmp_path / "memory.jsonl"
    with MemoryMonitor(mgr, path) as monitor:
        for i in range(4):
            step(mgr, batch=4)
            monitor.sample(i, loss=1.0 / (i + 1), swap={"written_bytes": 10 * i})
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines == monitor.records and len(lines) == 4
    first, last = lines[0], lines[-1]
    for key in ("step", "rss_bytes", "in_use_bytes", "reserved_bytes", "spilled_bytes", "block_allocations"):
        assert key in first
    assert first["device_pool_used_bytes"] is None and first["device_pool_total_bytes"] is None
    assert first["rss_bytes"] > 0 and last["step"] == 3 and last["loss"] == 0.25
    assert last["swap"] == {"written_bytes": 30}
    assert first["in_use_bytes"] == {
        "INPUT": 128,
        "FF_WORKING_MEM": 64,
        "ACTIVATIONS": 256,
        "FF_CACHE": 256,
        "ACTIVATION_GRAD": 256,
        "PARAMETERS": params.nbytes,
    }
    assert last["in_use_bytes"] == first["in_use_bytes"]
    assert last["reserved_bytes"]["PARAMETERS"] == params.nbytes
    assert sum(last["reserved_bytes"].values()) == params.nbytes + sum(
        ws.capacity for m in (mgr, eval_mgr) for ws in m.workspaces.values()
    )
    assert first["block_allocations"] > 0 and first["spilled_bytes"] > 0
    assert all(r["block_allocations"] == first["block_allocations"] for r in lines)
    assert all(r["spilled_bytes"] == first["spilled_bytes"] for r in lines)
    assert monitor.peak_by_type()["ACTIVATIONS"] == 256
    mgr.close()


def test_swap_defaults_to_an_empty_dict_and_no_file_without_a_path():
    mgr = WorkspaceManager(CPU, "none")
    monitor = MemoryMonitor([mgr])
    record = monitor.sample(0)
    assert record["swap"] == {} and record["in_use_bytes"] == {} and monitor.records == [record]
    mgr.close()


def test_plot_writes_a_png(tmp_path):
    mgr = WorkspaceManager(CPU, "training")
    monitor = MemoryMonitor(mgr)
    with pytest.raises(ValueError, match="no samples"):
        monitor.plot(tmp_path / "empty.png")
    for i in range(3):
        step(mgr, batch=2 + i)
        monitor.sample(i)
    png = monitor.plot(tmp_path / "timeline.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
    mgr.close()


def test_gc_policy_keeps_the_collector_off_during_steps_and_collects_every_k():
    policy = GcPolicy(collect_every=3)
    assert gc.isenabled()
    for _ in range(7):
        with policy.step():
            assert not gc.isenabled()
    assert gc.isenabled()
    assert policy.steps == 7 and policy.collections == 2
    with pytest.raises(ValueError, match=">= 0"):
        GcPolicy(collect_every=-1)

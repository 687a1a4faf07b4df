import threading

import numpy as np
import pytest

from engine.backend import get_backend
from engine.memory import (
    ALIGNMENT,
    DebugMode,
    LearningPolicy,
    ResetPolicy,
    SpillPolicy,
    Workspace,
    WorkspaceClosedError,
    WorkspaceConfig,
    WorkspaceFullError,
    allocation_statistics_for_current_thread,
    destroy_all_workspaces_for_current_thread,
    get_or_create_workspace,
)
from engine.memory.workspace import _address

CPU = get_backend("cpu")


def fixed(size: int, **kw) -> WorkspaceConfig:
    return WorkspaceConfig(initial_size=size, learning=LearningPolicy.NONE, **kw)


def test_offsets_are_exact_and_aligned_to_64_bytes():
    ws = Workspace(CPU, "offsets", fixed(4096))
    with ws:
        a = ws.create((3,), np.float32)  # 12 bytes -> next at 64
        b = ws.create((5, 5), np.float64)  # 200 bytes -> next at 64 + 256
        c = ws.create(1, np.uint8)
        d = ws.create((16,), np.float32)  # exactly 64 bytes
        e = ws.create((2,), np.int32)
    assert [t.offset for t in (a, b, c, d, e)] == [0, 64, 320, 384, 448]
    for t in (a, b, c, d, e):
        assert _address(t.array) % ALIGNMENT == 0
    assert b.shape == (5, 5) and b.dtype == np.float64
    # views into one block: writing one does not touch its neighbours
    with ws:
        a = ws.create((16,), np.float32)
        b = ws.create((16,), np.float32)
        a.array[:] = 1.0
        b.array[:] = 2.0
        assert a.offset == 0 and b.offset == 64
        assert np.all(a.array == 1.0) and np.all(b.array == 2.0)
        assert np.shares_memory(a.array, ws._block) and np.shares_memory(b.array, ws._block)


def test_entering_resets_offset_and_bumps_generation():
    ws = Workspace(CPU, "gen", fixed(1024))
    with ws:
        first = ws.create((4,))
    with ws:
        second = ws.create((4,))
        assert ws.generation == first.generation + 1 == second.generation
    assert first.offset == second.offset == 0


def cycle(ws: Workspace, sizes: list[int]) -> None:
    with ws:
        for n in sizes:
            ws.create((n,), np.float32)


def test_first_loop_learns_then_allocates_nothing_for_100_cycles():
    ws = Workspace(CPU, "learn", WorkspaceConfig(overallocation=0.5))
    sizes = [100, 7, 33, 250]  # float32 elements: 400, 28, 132, 1000 bytes -> 448, 64, 192, 1024 aligned
    need = 448 + 64 + 192 + 1024
    cycle(ws, sizes)
    s = ws.statistics()
    assert s.last_cycle_bytes == need
    assert s.spilled_count == 4 and s.spilled_bytes == 4 * (100 + 7 + 33 + 250)
    assert s.block_allocations == 1
    assert ws.capacity == 2624  # 1728 * 1.5 = 2592, rounded up to a multiple of 64
    for _ in range(100):
        cycle(ws, sizes)
    after = ws.statistics()
    assert after.spilled_count == s.spilled_count and after.spilled_bytes == s.spilled_bytes
    assert after.block_allocations == 1
    assert after.max_cycle_bytes == need and after.cycles == 101


def test_over_time_learns_the_largest_of_its_cycles():
    ws = Workspace(
        CPU, "over-time", WorkspaceConfig(learning=LearningPolicy.OVER_TIME, learning_cycles=3, overallocation=0.0)
    )
    cycle(ws, [16])
    cycle(ws, [64])
    assert ws.capacity == 0 and ws.block_allocations == 0
    cycle(ws, [32])
    assert ws.capacity == 256 and ws.block_allocations == 1
    spilled = ws.spilled_bytes
    cycle(ws, [64])
    assert ws.spilled_bytes == spilled


def test_external_spill_keeps_the_block_and_counts_spills():
    ws = Workspace(CPU, "external", fixed(128))
    with ws:
        inside = ws.create((32,))  # 128 bytes: fills the block
        outside = ws.create((8,))
    assert inside.offset == 0 and outside.offset is None
    assert ws.spilled_bytes == 32 and ws.spilled_count == 1 and ws.capacity == 128


def test_reallocate_grows_the_block_after_a_cycle_that_outgrew_it():
    ws = Workspace(
        CPU,
        "grow",
        WorkspaceConfig(
            initial_size=128, learning=LearningPolicy.NONE, spill=SpillPolicy.REALLOCATE, overallocation=0.0
        ),
    )
    cycle(ws, [32])
    assert ws.block_allocations == 1 and ws.capacity == 128
    cycle(ws, [32, 64])  # needs 128 + 256
    assert ws.block_allocations == 2 and ws.capacity == 384 and ws.spilled_count == 1
    cycle(ws, [32, 64])
    assert ws.block_allocations == 2 and ws.spilled_count == 1


def test_max_size_caps_growth():
    ws = Workspace(CPU, "capped", WorkspaceConfig(max_size=256, spill=SpillPolicy.REALLOCATE, overallocation=0.0))
    cycle(ws, [1000])
    assert ws.capacity == 256


def test_fail_policy_raises_a_clear_error():
    ws = Workspace(CPU, "strict", fixed(256, spill=SpillPolicy.FAIL))
    with ws:
        ws.create((64,))
        with pytest.raises(WorkspaceFullError, match=r"Workspace \[strict\] is full: an allocation of 4 bytes.*FAIL"):
            ws.create((1,))


def test_circular_ring_wraps_and_only_overwritten_tensors_go_stale():
    ws = Workspace(
        CPU, "ring", WorkspaceConfig(initial_size=256, learning=LearningPolicy.NONE, reset=ResetPolicy.CIRCULAR)
    )
    with ws:
        a = ws.create((16,))  # [0, 64)
        b = ws.create((16,))  # [64, 128)
        c = ws.create((32,))  # [128, 256)
        assert (a.offset, b.offset, c.offset) == (0, 64, 128)
        d = ws.create((16,))  # does not fit before the end: wraps to 0, overwrites a
        assert d.offset == 0 and d.generation == a.generation + 1
        assert np.shares_memory(d.array, a.array)
        assert not a.is_valid and b.is_valid and c.is_valid and d.is_valid
        e = ws.create((16,))  # [64, 128): overwrites b
        assert e.offset == 64 and not b.is_valid and c.is_valid
    with ws:  # re-entering a ring does not reset it
        f = ws.create((16,))
        assert f.offset == 128 and not c.is_valid and e.is_valid


def test_circular_needs_a_fixed_size():
    with pytest.raises(ValueError, match="CIRCULAR.*initial_size > 0"):
        WorkspaceConfig(reset=ResetPolicy.CIRCULAR)


def test_spill_everything_never_learns():
    ws = Workspace(CPU, "spill-all", WorkspaceConfig(initial_size=1024, debug=DebugMode.SPILL_EVERYTHING))
    for _ in range(3):
        cycle(ws, [8, 8])
    assert ws.capacity == 0 and ws.block_allocations == 0 and ws.spilled_count == 6


def test_bypass_everything_gives_unmanaged_tensors():
    ws = Workspace(CPU, "bypass", WorkspaceConfig(debug=DebugMode.BYPASS_EVERYTHING))
    with ws:
        t = ws.create((3, 3))
    assert t.workspace is None and t.shape == (3, 3) and ws.block_allocations == 0 and ws.spilled_count == 0


def test_allocating_in_a_closed_workspace_says_how_to_open_it():
    ws = Workspace(CPU, "shut", fixed(64))
    with pytest.raises(WorkspaceClosedError, match=r"\[shut\] is not open"):
        ws.create((1,))


def test_nested_enter_does_not_reset_and_borrow_reopens_without_reset():
    ws = Workspace(CPU, "nest", fixed(1024))
    with ws:
        a = ws.create((4,))
        with ws:
            b = ws.create((4,))
        assert ws.is_open and a.is_valid and b.offset == 64
    assert not a.is_valid
    with ws.borrow():
        assert a.is_valid
        c = ws.create((4,))
        assert c.offset == 128 and c.generation == a.generation
    with ws:
        assert not a.is_valid


def test_reset_starts_a_new_cycle_while_open():
    ws = Workspace(CPU, "reset", fixed(1024))
    with ws:
        a = ws.create((4,))
        ws.reset()
        b = ws.create((4,))
        assert b.offset == 0 and not a.is_valid and b.is_valid


def test_registry_get_or_create_and_destroy_all():
    try:
        ws = get_or_create_workspace(CPU, "registry-ws", fixed(128))
        assert get_or_create_workspace(CPU, "registry-ws") is ws
        assert get_or_create_workspace(CPU, "registry-ws", fixed(128)) is ws
        with pytest.raises(ValueError, match="another configuration"):
            get_or_create_workspace(CPU, "registry-ws", fixed(256))
        assert "registry-ws" in allocation_statistics_for_current_thread()
    finally:
        assert destroy_all_workspaces_for_current_thread() >= 1
    assert ws.is_released
    assert get_or_create_workspace(CPU, "registry-ws") is not ws
    destroy_all_workspaces_for_current_thread()


def test_two_threads_with_the_same_id_get_separate_workspaces():
    found: dict[str, object] = {}

    def worker(label: str) -> None:
        ws = get_or_create_workspace(CPU, "shared-id", fixed(256))
        with ws:
            t = ws.create((4,))
            t.array[:] = float(len(label))
        found[label] = (ws, t)
        destroy_all_workspaces_for_current_thread()

    threads = [threading.Thread(target=worker, args=(name,)) for name in ("one", "three")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    (ws1, t1), (ws3, t3) = found["one"], found["three"]
    assert ws1 is not ws3
    assert not np.shares_memory(t1._array, t3._array)
    assert t1._array[0] == 3.0 and t3._array[0] == 5.0
    assert "shared-id" not in allocation_statistics_for_current_thread()


def test_fail_policy_lets_the_learning_cycle_spill_then_holds_the_learned_size():
    ws = Workspace(CPU, "strict-learner", WorkspaceConfig(spill=SpillPolicy.FAIL, overallocation=0.0))
    cycle(ws, [16, 16])  # learning: spills are how the size is measured
    assert ws.capacity == 128 and ws.spilled_count == 2
    cycle(ws, [16, 16])
    with pytest.raises(WorkspaceFullError, match=r"\[strict-learner\] is full"):
        cycle(ws, [16, 16, 16])

"""The offload plan: spans extended by the window, no shared bytes between live spans, what is never written."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.memory import ArrayType
from engine.offload.plan import (
    TensorUse,
    UnitSpec,
    build_plan,
    check_plan,
    group_units,
    layout_tensors,
    plan_with_chains,
    program_units,
    recompute_candidates,
)
from models import build_model


def chain_units(layers: int, nbytes: int = 4096):
    """A chain: node i's output is read by node i+1's forward and backward, and by its own backward."""
    steps = 2 * layers
    uses = {}
    for i in range(layers):
        forward_end = min(i + 1, layers - 1)
        backward = [steps - 1 - i] + ([steps - 1 - (i + 1)] if i + 1 < layers else [])
        uses[i] = [TensorUse(f"n{i}:out", ArrayType.ACTIVATIONS, (nbytes // 4,), np.dtype(np.float32), forward_end,
                             min(backward), max(backward))]
    units, _ = group_units({i: i for i in range(layers)}, {i: f"n{i}" for i in range(layers)}, uses)
    return units, steps


@pytest.mark.parametrize("window", [1, 2, 4])
def test_chain_keeps_n_plus_two_layers(window):
    units, steps = chain_units(20)
    plan = build_plan(units, window, steps)
    check_plan(plan)
    assert plan.peak_units == window + 2  # N resident, one saving, one loading (nntrainer #789)
    assert plan.arena_bytes == plan.lower_bound_bytes == (window + 2) * 4096
    assert plan.total_bytes == 20 * 4096


def test_spans_include_the_lookahead():
    units, steps = chain_units(20)
    plan = build_plan(units, 3, steps)
    for unit in plan.offloaded:
        forward, backward = unit.occupations
        assert forward.end == unit.spec.forward_end + 3  # the saver may lag 3 steps
        assert backward.start == unit.spec.backward_start - 3  # the loader prefetches 3 steps ahead
    # prefetched bytes never overlap bytes a live span holds (nntrainer #2034)
    for key, unit in plan.units.items():
        for other_key, other in plan.units.items():
            if key == other_key:
                continue
            shares_bytes = unit.arena_offset < other.arena_offset + other.nbytes and \
                other.arena_offset < unit.arena_offset + unit.nbytes
            if shares_bytes:
                assert not any(a.overlaps(b) for a in unit.occupations for b in other.occupations)


def test_last_layers_and_transient_tensors_are_never_written():
    units, steps = chain_units(10)
    plan = build_plan(units, 2, steps)
    written = sorted(u.spec.owner for u in plan.offloaded)
    assert written == list(range(written[-1] + 1)) and written[-1] < 9  # the tail stays resident
    assert all(u.file_offset is None for u in plan.units.values() if not u.offloaded)
    big = build_plan(units, 100, steps)
    assert not big.offloaded and big.arena_bytes == big.total_bytes


def test_resnet18_units_and_transients():
    net = build_model("resnet18", 10, "cpu", image_size=16)
    units, creations, steps = program_units(net.program(2))
    by_name = {(u.name, u.part): u for u in units}
    # batch norm keeps its output (In-Place ABN): its input, the conv's output, is read by forwards only
    assert ("layer1.0.conv1", "transient") in by_name and ("layer1.0.conv1", "saved") not in by_name
    assert by_name[("layer1.0.conv1", "transient")].backward_start is None
    assert by_name[("layer1.0.bn1", "saved")].backward_start is not None
    assert [t.name for t in by_name[("layer1.0.bn1", "saved")].tensors] == ["layer1.0.bn1:out",
                                                                             "layer1.0.bn1:save_invstd"]
    for window in (1, 4):
        plan = build_plan(units, window, steps)
        check_plan(plan)
        assert plan.arena_bytes < plan.total_bytes / 2
    assert sum(len(c) for c in creations.values()) == sum(len(u.tensors) for u in units)


def test_chained_rebuilds_are_taken_only_where_the_arena_does_not_grow():
    """A basic block's ReLU output whose shortcut source is rebuilt itself (chained) is rebuilt after it,
    not swapped, where that holds no more arena bytes; each rebuilt source is rebuilt before its readers
    and is in memory from their backward on."""
    net = build_model("resnet18", 10, "cpu", image_size=32)
    program = net.program(4)
    units, _, steps = program_units(program)
    candidates = recompute_candidates(program, units)
    plan = build_plan(units, 4, steps, candidates)
    check_plan(plan)
    name = {u.key: u.spec.name for u in plan.units.values()}
    rebuilt = {name[u.key]: u for u in plan.recomputed}
    chained = sorted(n for n, u in rebuilt.items() if any(k in plan.units and plan.units[k].recompute is not None
                                                          for k in u.recompute.source_units))
    assert chained == ["layer2.1.relu2", "layer3.1.relu2"]  # layer1.1's chain would need a larger arena
    assert plan.units[next(k for k, n in name.items() if n == "layer1.0.relu2")].decision == "swap"
    position = {u.key: i for i, u in enumerate(plan.recomputed)}
    for u in plan.recomputed:
        for key in u.recompute.source_units:
            source = plan.units[key]
            assert source.load_at <= u.load_at  # in memory (loaded or rebuilt) when the reader is rebuilt
            if source.recompute is not None:
                assert position[key] < position[u.key]
    every, chains = plan_with_chains(units, 4, steps, candidates, frozenset(candidates))
    assert len(chains) == 4 and every.arena_bytes > plan.arena_bytes
    assert sum(u.nbytes for u in plan.offloaded) < sum(u.nbytes for u in plan_with_chains(
        units, 4, steps, candidates, frozenset())[0].offloaded)


def base_chains(plan):
    """The chained rebuilds ``build_plan`` took: recomputed units whose source is rebuilt itself."""
    rebuilt = {u.key for u in plan.recomputed}
    return frozenset(u.key for u in plan.recomputed if set(u.recompute.source_units) & rebuilt)


def test_a_budget_keeps_the_largest_swapped_units_resident_within_it():
    """``build_plan(..., budget_bytes)``: past the window's arena, swapped units stay resident whole,
    largest first, while the arena fits; the window, the rebuilds and the chains stay as without it."""
    net = build_model("mobilenetv2", 10, "cpu", image_size=32)
    program = net.program(4)
    units, _, steps = program_units(program)
    candidates = recompute_candidates(program, units)
    base = build_plan(units, 4, steps, candidates)
    budget = (base.arena_bytes + base.total_bytes) // 4
    plan = build_plan(units, 4, steps, candidates, budget)
    check_plan(plan)
    assert base.arena_bytes < plan.arena_bytes <= budget
    assert plan.offloaded_bytes < 0.75 * base.offloaded_bytes  # what the budget buys: fewer bytes on disk
    kept = {k for k, u in plan.units.items() if u.decision == "keep"} - {
        k for k, u in base.units.items() if u.decision == "keep"}
    assert kept and kept <= {u.key for u in base.offloaded} | {u.key for u in base.recomputed}
    assert plan.kept == kept and not base.kept and plan.kept_bytes == sum(plan.units[k].nbytes for k in kept)
    assert kept & {u.key for u in base.offloaded}  # swapped units first: they save the disk's bytes
    assert {u.key for u in plan.recomputed} <= {u.key for u in base.recomputed}
    for key in kept:
        unit = plan.units[key]
        assert unit.file_offset is None and unit.recompute is None and len(unit.occupations) == 1
        assert (unit.occupations[0].start, unit.occupations[0].end) == (unit.spec.created, unit.spec.backward_end)
    # largest first: the largest swapped unit is tried first, with nothing kept yet; it fits alone, so it is kept
    largest = min(base.offloaded, key=lambda u: (-u.nbytes, u.spec.created, u.key))
    alone, _ = plan_with_chains(units, 4, steps, candidates, base_chains(base), frozenset({largest.key}))
    assert alone.arena_bytes <= budget and largest.key in plan.kept
    smallest = min(base.offloaded, key=lambda u: (u.nbytes, u.spec.created))
    assert smallest.nbytes < largest.nbytes and smallest.key not in plan.kept  # the budget ran out before it
    assert build_plan(units, 4, steps, candidates, base.arena_bytes).offloaded_bytes == base.offloaded_bytes
    everything = build_plan(units, 4, steps, candidates, base.total_bytes)
    assert not everything.offloaded  # a budget that holds every unit writes nothing,
    assert len(everything.recomputed) < len(base.recomputed)  # and keeps ReLU outputs with what is left


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 64), min_size=2, max_size=24),
    reach=st.lists(st.integers(0, 4), min_size=24, max_size=24),
    window=st.integers(1, 6),
)
def test_random_dags_never_share_live_bytes(sizes, reach, window):
    layers = len(sizes)
    steps = 2 * layers
    uses = {}
    for i, size in enumerate(sizes):
        forward_end = min(i + reach[i], layers - 1)
        uses[i] = [TensorUse(f"n{i}:out", ArrayType.ACTIVATIONS, (size * 16,), np.dtype(np.float32), forward_end,
                             steps - 1 - forward_end, steps - 1 - i)]
    units, _ = group_units({i: i for i in range(layers)}, {i: f"n{i}" for i in range(layers)}, uses)
    plan = build_plan(units, window, steps)
    check_plan(plan)
    assert plan.lower_bound_bytes <= plan.arena_bytes <= plan.total_bytes
    for (key, index), before in plan.predecessors.items():
        start = plan.units[key].occupations[index].start
        for other_key, other_index in before:
            assert plan.units[other_key].occupations[other_index].end < start


def test_unit_sizes_are_computed_once(monkeypatch):
    """The scheduler reads ``nbytes``/``footprint`` ~500 times a step from its IO threads and the
    executor: after the first read no ``np.prod`` runs again (they were properties recomputed each time)."""
    specs = layout_tensors([("a:out", ArrayType.ACTIVATIONS, (32, 96, 32, 32), np.float32),
                            ("a:save_invstd", ArrayType.FF_CACHE, (96,), np.float32)])
    unit = UnitSpec(0, "saved", "a", specs, created=0, forward_end=1, backward_start=3, backward_end=3)
    first = (unit.nbytes, unit.footprint, [t.nbytes for t in unit.tensors])
    calls = []
    monkeypatch.setattr(np, "prod", lambda *a, **k: calls.append(a))
    assert (unit.nbytes, unit.footprint, [t.nbytes for t in unit.tensors]) == first
    assert first[0] == 32 * 96 * 32 * 32 * 4 + 96 * 4 and first[1] % 4096 == 0
    assert calls == []

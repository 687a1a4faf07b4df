"""The static planner: no two tensors alive together share bytes, and the plan never beats the lower bound."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.memory.planner import first_fit, greedy_order, lower_bound, plan_offsets

items = st.lists(
    st.tuples(st.integers(0, 5000), st.integers(0, 30), st.integers(0, 10)).map(lambda t: (t[0], (t[1], t[1] + t[2]))),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(items)
def test_tensors_alive_together_never_share_bytes(specs):
    sizes = [s for s, _ in specs]
    spans = [[span] for _, span in specs]
    plan = plan_offsets(sizes, spans)
    for i, (si, (a0, a1)) in enumerate(specs):
        oi = plan.offsets[i]
        assert oi >= 0 and oi + si <= plan.planned_peak
        for j in range(i + 1, len(specs)):
            sj, (b0, b1) = specs[j]
            oj = plan.offsets[j]
            if a0 <= b1 and b0 <= a1 and si and sj:
                assert oi + si <= oj or oj + sj <= oi, (specs[i], specs[j], oi, oj)
    assert plan.planned_peak >= plan.lower_bound
    steps = range(0, 42)
    assert plan.lower_bound == max([sum(s for s, (a, b) in specs if a <= t <= b) for t in steps], default=0)


def test_disjoint_lifespans_share_one_offset_and_a_chain_needs_two_buffers():
    plan = plan_offsets([100, 100, 100], [[(0, 1)], [(1, 2)], [(2, 3)]])
    assert plan.offsets == (0, 100, 0)
    assert plan.planned_peak == plan.lower_bound == 200


def test_long_lived_first_then_largest():
    sizes, spans = [10, 50, 30], [[(0, 1)], [(1, 2)], [(0, 3)]]
    assert greedy_order(sizes, spans) == [2, 1, 0]  # the whole-timeline tensor, then by size


def test_late_items_are_placed_after_the_others_and_fill_their_gaps():
    """Item 0 (one moment) placed by its size takes offset 0 and pushes item 1 (moments 0-2) above item 3: peak 60.
    Placed late it takes the gap the others leave at its moment: peak 50, the lower bound. That is how a widened
    chunked pass's working memory is placed (``Network._widen_chunks``)."""
    sizes, spans = [30, 10, 30, 20], [[(1, 1)], [(0, 2)], [(3, 3)], [(2, 3)]]
    late = [True, False, False, False]
    assert greedy_order(sizes, spans, late) == [2, 3, 1, 0]
    assert plan_offsets(sizes, spans).planned_peak == 60
    placed = plan_offsets(sizes, spans, late)
    assert placed.offsets == (10, 0, 0, 30) and placed.planned_peak == 50 == placed.lower_bound


def test_multi_span_items_keep_one_offset_for_all_spans():
    # item 0 lives at 0..1 and again at 5..6; item 1 at 3..4 may use its bytes, item 2 at 5 may not
    offsets = first_fit([8, 8, 8], [[(0, 1), (5, 6)], [(3, 4)], [(5, 5)]], [0, 1, 2])
    assert offsets == [0, 0, 8]
    assert lower_bound([8, 8, 8], [[(0, 1), (5, 6)], [(3, 4)], [(5, 5)]]) == 16


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="first <= last"):
        plan_offsets([4], [[(3, 1)]])
    with pytest.raises(ValueError, match="permutation"):
        first_fit([4, 4], [[(0, 0)], [(0, 0)]], [0, 0])

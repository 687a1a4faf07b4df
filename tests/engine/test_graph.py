"""Graph: topological order, validation of the wiring, shapes (lifespans: tests/engine/test_program.py)."""

from __future__ import annotations

import pytest

from engine.graph import GRAPH_INPUT, Graph
from engine.layers import Add, BatchNorm2d, Conv2d, Dense, Flatten, MaxPool2d, ReLU

SHARED = ReLU()


def residual_graph() -> Graph:
    """c1 -> bn -> r1 -> c2 -> add(c2, r1) -> pool -> flat -> fc: a skip connection around c2."""
    return Graph(
        [
            ("c1", Conv2d(3, 4, 3, 1, 1, bias=False), ["input"]),
            ("bn", BatchNorm2d(4), ["c1"]),
            ("r1", ReLU(), ["bn"]),
            ("c2", Conv2d(4, 4, 3, 1, 1), ["r1"]),
            ("add", Add(), ["c2", "r1"]),
            ("pool", MaxPool2d(2), ["add"]),
            ("flat", Flatten(), ["pool"]),
            ("fc", Dense(16, 5), ["flat"]),
        ],
        input_shape=(3, 4, 4),
    )


def test_nodes_are_numbered_in_topological_order_with_declaration_order_for_ties():
    graph = Graph(
        [
            ("sum", Add(), ["left", "right"]),
            ("right", ReLU(), ["stem"]),
            ("left", ReLU(), ["stem"]),
            ("stem", ReLU(), ["input"]),
        ],
        input_shape=(3,),
    )
    assert [n.name for n in graph.nodes] == ["stem", "right", "left", "sum"]
    assert [n.index for n in graph.nodes] == [0, 1, 2, 3]
    assert graph.nodes[0].inputs == (GRAPH_INPUT,)
    assert graph.nodes[3].inputs == (2, 1)  # (left, right) as declared
    assert graph.nodes[0].consumers == (1, 2)
    assert graph.output.name == "sum"
    assert graph.nodes[2].layer.name == "left"  # layers learn their node's name (for error messages)


@pytest.mark.parametrize(
    "declarations, message",
    [
        ([("a", ReLU(), ["b"]), ("b", ReLU(), ["a"]), ("c", Add(), ["input", "b"])], "cycle through: a, b"),
        ([("a", ReLU(), ["nowhere"])], r"reads unknown node\(s\) \['nowhere'\]"),
        ([("a", ReLU(), ["input"]), ("b", ReLU(), ["input"]), ("c", ReLU(), ["a"])], r"\['b'\] feed nothing"),
        ([("a", ReLU(), ["input"]), ("a", ReLU(), ["a"])], "duplicate node names: a"),
        ([("a", Add(), ["input"])], "Add takes 2 input"),
        ([("input", ReLU(), ["input"])], "reserved"),
        ([], "at least one node"),
        ([("a", SHARED, ["input"]), ("b", SHARED, ["a"])], "nodes a, b use the same layer object"),
    ],
)
def test_bad_wiring_is_a_clear_error(declarations, message):
    with pytest.raises(ValueError, match=message):
        Graph(declarations, input_shape=(3,))


def test_shapes_follow_the_layers():
    shapes = residual_graph().shapes(batch_size=2)
    assert shapes[GRAPH_INPUT] == (2, 3, 4, 4)
    assert shapes[5] == (2, 4, 2, 2)  # pool
    assert shapes[7] == (2, 5)  # fc

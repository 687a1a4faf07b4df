"""Graph: topological order, validation of the wiring, and every tensor's lifespan in the step order."""

from __future__ import annotations

import numpy as np
import pytest

from engine.graph import GRAPH_INPUT, Graph
from engine.layers import Add, BatchNorm2d, Conv2d, Dense, Flatten, MaxPool2d, ReLU
from engine.memory import ArrayType

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


def test_lifespans_of_a_residual_graph():
    # L = 8 nodes: forward of node i is step i, backward of node i is step 15 - i.
    assert residual_graph().lifespans() == {
        "input": (0, 15),  # c1 keeps its input until its backward
        "c1:out": (0, 1),  # bn keeps its output, not its input (In-Place ABN)
        "bn:out": (1, 14),
        "bn:save_invstd": (1, 14),
        "r1:out": (2, 13),  # read by c2 (kept to step 12) and add; r1's own backward reads it at 13
        "c2:out": (3, 4),
        "add:out": (4, 5),
        "pool:out": (5, 6),
        "pool:argmax": (5, 10),
        "flat:out": (6, 8),  # fc keeps its input until its backward (step 8)
        "fc:out": (7, 7),
        "loss:probs": (7, 8),
        "loss:value": (7, 7),
        "fc:grad": (8, 8),  # made by the loss
        "flat:grad": (8, 9),
        "pool:grad": (9, 10),
        "add:grad": (10, 11),
        "c2:grad": (11, 12),
        "r1:grad": (11, 13),  # fan-out: add's contribution at 11, c2's summed in at 12
        "bn:grad": (13, 14),
        "c1:grad": (14, 15),
    }


def test_tensor_specs_carry_owner_type_shape_and_dtype():
    specs = {t.name: t for t in residual_graph().tensors(batch_size=2)}
    argmax = specs["pool:argmax"]
    assert (argmax.owner, argmax.array_type, argmax.shape, np.dtype(argmax.dtype)) == (
        5,
        ArrayType.FF_CACHE,
        (2, 4, 2, 2),
        np.uint8,  # the place in a 2x2 window: one byte (MaxPool2d.argmax_dtype)
    )
    assert argmax.nbytes == 2 * 4 * 2 * 2
    assert specs["r1:out"].owner == 2 and specs["r1:out"].array_type is ArrayType.ACTIVATIONS
    assert specs["r1:grad"].owner == 4 and specs["r1:grad"].array_type is ArrayType.ACTIVATION_GRAD
    assert specs["fc:grad"].owner is None and specs["input"].array_type is ArrayType.INPUT

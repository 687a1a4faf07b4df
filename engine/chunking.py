"""Which layers of a graph run in chunks of images: the graph rewritten with ``ChunkedConvBN`` nodes.

A network-level step (it reads the graph and builds a new one), beside ``engine.graph``; the layer itself
(``engine.layers.chunked``) knows nothing of graphs. ``Network`` calls ``fuse_chunkable`` when its backend
has the chunk kernels.
"""

from __future__ import annotations

import numpy as np

from engine.graph import INPUT_NAME, Graph, Node
from engine.layers.activation import ReLU, ReLU6
from engine.layers.batchnorm import BatchNorm2d
from engine.layers.chunked import CHUNK_MIN_PIXELS, ChunkedConvBN
from engine.layers.conv import Conv2d
from engine.layers.pool import MaxPool2d


def chunkable_chains(graph: Graph) -> list[list[Node]]:
    """The conv → batch norm → [ReLU | ReLU6] → [MaxPool2d] chains of ``graph`` that ``ChunkedConvBN`` can run:
    each link the only reader of the one before, the conv's output plane at least ``CHUNK_MIN_PIXELS``."""
    shapes = graph.shapes(1)
    nodes = graph.nodes

    def only_reader(node: Node, kinds: tuple[type, ...]) -> Node | None:
        if len(node.consumers) != 1:
            return None
        reader = nodes[node.consumers[0]]
        return reader if type(reader.layer) in kinds else None

    chains = []
    for node in nodes:
        if type(node.layer) is not Conv2d or int(np.prod(shapes[node.index][2:])) < CHUNK_MIN_PIXELS:
            continue
        bn = only_reader(node, (BatchNorm2d,))
        if bn is None:
            continue
        chain = [node, bn]
        act = only_reader(bn, (ReLU, ReLU6))
        if act is not None:
            chain.append(act)
            pool = only_reader(act, (MaxPool2d,))
            if pool is not None:
                chain.append(pool)
        chains.append(chain)
    return chains


def fuse_chunkable(graph: Graph) -> Graph:
    """``graph`` with each of its ``chunkable_chains`` one ``ChunkedConvBN`` node named by its layers
    ("conv1+bn1+relu+maxpool"); the same graph when it has none. The layers are shared, not copied."""
    chains = chunkable_chains(graph)
    if not chains:
        return graph
    head = {chain[0].index: chain for chain in chains}
    member = {node.index: chain for chain in chains for node in chain}
    name_of = {-1: INPUT_NAME}
    for node in graph.nodes:
        chain = member.get(node.index)
        name_of[node.index] = "+".join(n.name for n in chain) if chain else node.name
    declarations = []
    for node in graph.nodes:
        inputs = [name_of[i] for i in node.inputs]
        if node.index in head:
            conv, bn, *rest = (n.layer for n in head[node.index])
            act = rest[0] if rest else None
            pool = rest[1] if len(rest) > 1 else None
            declarations.append((name_of[node.index], ChunkedConvBN(conv, bn, act, pool), inputs))
        elif node.index not in member:
            declarations.append((node.name, node.layer, inputs))
    return Graph(declarations, graph.input_shape)

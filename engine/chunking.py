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
from engine.layers.chunked import CHUNK_MIN_PIXELS, ChunkedConvBN, ChunkedPair
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


def chained_pairs(graph: Graph, chains: list[list[Node]]) -> list[tuple[list[Node], list[Node]]]:
    """Pairs of ``chains`` without a pool where the second is the only reader of the first (``ChunkedPair``),
    the largest tensor between them first, none in two pairs. Largest first, not left to right: MobileNetV2 at
    224 would otherwise pair features.1's projection with features.2's expansion and leave the 147 MiB tensor
    between the expansion and its depthwise conv (batch 32) whole."""
    shapes = graph.shapes(1)
    head = {chain[0].index: chain for chain in chains}
    candidates = []
    for chain in chains:
        last = chain[-1]
        if len(chain) == 4 or len(last.consumers) != 1:  # a pool, or a second reader
            continue
        second = head.get(last.consumers[0])
        if second is not None and len(second) < 4:
            candidates.append((int(np.prod(shapes[last.index])), chain, second))
    taken: set[int] = set()
    pairs = []
    for _, chain, second in sorted(candidates, key=lambda c: -c[0]):
        if chain[0].index in taken or second[0].index in taken:
            continue
        taken |= {chain[0].index, second[0].index}
        pairs.append((chain, second))
    return sorted(pairs, key=lambda pair: pair[0][0].index)


def fuse_chunkable(graph: Graph, pairs: bool = False) -> Graph:
    """``graph`` with each of its ``chunkable_chains`` one ``ChunkedConvBN`` node named by its layers
    ("conv1+bn1+relu+maxpool"); with ``pairs``, each of its ``chained_pairs`` one ``ChunkedPair`` node named by
    both chains' layers. The same graph when it has no chain. The layers are shared, not copied."""
    chains = chunkable_chains(graph)
    if not chains:
        return graph
    paired = chained_pairs(graph, chains) if pairs else []
    second_of = {first[0].index: second for first, second in paired}
    head = {chain[0].index: chain for chain in chains}
    member = {node.index: chain for chain in chains for node in chain}
    for first, second in paired:  # a pair's nodes are one node: its name and its output the second chain's
        for node in (*first, *second):
            member[node.index] = first + second
    name_of = {-1: INPUT_NAME}
    for node in graph.nodes:
        chain = member.get(node.index)
        name_of[node.index] = "+".join(n.name for n in chain) if chain else node.name

    def chunked(chain: list[Node]) -> ChunkedConvBN:
        conv, bn, *rest = (n.layer for n in chain)
        layer = ChunkedConvBN(conv, bn, rest[0] if rest else None, rest[1] if len(rest) > 1 else None)
        layer.name = "+".join(n.name for n in chain)  # a pair's stages keep their chains' names
        return layer

    declarations = []
    for node in graph.nodes:
        inputs = [name_of[i] for i in node.inputs]
        if node.index in second_of:
            layer = ChunkedPair(chunked(head[node.index]), chunked(second_of[node.index]))
            declarations.append((name_of[node.index], layer, inputs))
        elif node.index in head and len(member[node.index]) == len(head[node.index]):
            declarations.append((name_of[node.index], chunked(head[node.index]), inputs))
        elif node.index not in member:
            declarations.append((node.name, node.layer, inputs))
    return Graph(declarations, graph.input_shape)


def has_chained_pairs(graph: Graph) -> bool:
    """Whether ``graph`` (already fused) has two chunked chains without a pool, the second the only reader of the
    first: what ``fuse_chunkable(..., pairs=True)`` would make one ``ChunkedPair`` (``--chunks pairs``)."""
    nodes = graph.nodes
    for node in nodes:
        layer = node.layer
        if type(layer) is ChunkedConvBN and layer.pool is None and len(node.consumers) == 1:
            reader = nodes[node.consumers[0]].layer
            if type(reader) is ChunkedConvBN and reader.pool is None:
                return True
    return False

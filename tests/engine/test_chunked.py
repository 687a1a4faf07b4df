"""ChunkedConvBN (engine/layers/chunked.py): which chains are fused, the same numbers as the separate layers,
and the same bits in both modes, with offload on or off, at any batch size."""

import os

import numpy as np
import pytest

from engine.backend import get_backend
from engine.chunking import chunkable_chains, fuse_chunkable
from engine.data.datasets import synthetic
from engine.graph import Graph
from engine.layers import Add, BatchNorm2d, Conv2d, Dense, GlobalAvgPool, MaxPool2d, ReLU, ReLU6
from engine.layers.chunked import CHUNK_IMAGES, ChunkedConvBN
from engine.memory import ArrayType
from engine.network import PLANNED_TYPES, Network
from engine.offload import OffloadConfig, OffloadSession
from engine.optim import make_optimizer
from engine.program import Op
from engine.train import Trainer
from tests.scripts import load_script

SIZE = 56  # the smallest plane that is chunked (CHUNK_MIN_PIXELS)


def graph(size: int = SIZE) -> Graph:
    """Three chains: on the input (no input gradient) ending in a ReLU read twice, one ending in its batch norm
    (read by an Add), one with ReLU6 and a max-pool; then layers on a plane too small to chunk."""
    return Graph([
        ("c0", Conv2d(3, 8, 3, 1, 1, bias=False), ["input"]),
        ("b0", BatchNorm2d(8), ["c0"]),
        ("r0", ReLU(), ["b0"]),
        ("c1", Conv2d(8, 8, 3, 1, 1, bias=False), ["r0"]),
        ("b1", BatchNorm2d(8), ["c1"]),
        ("add", Add(), ["r0", "b1"]),
        ("r1", ReLU(), ["add"]),
        ("c2", Conv2d(8, 6, 1, bias=True), ["r1"]),
        ("b2", BatchNorm2d(6), ["c2"]),
        ("r2", ReLU6(), ["b2"]),
        ("p2", MaxPool2d(3, 2, 1), ["r2"]),
        ("c3", Conv2d(6, 6, 3, 1, 1, bias=False), ["p2"]),
        ("b3", BatchNorm2d(6), ["c3"]),
        ("r3", ReLU(), ["b3"]),
        ("gap", GlobalAvgPool(), ["r3"]),
        ("fc", Dense(6, 4), ["gap"]),
    ], (3, size, size))


def test_the_chains_on_large_planes_are_fused_and_keep_their_names():
    chains = [[n.name for n in chain] for chain in chunkable_chains(graph())]
    assert chains == [["c0", "b0", "r0"], ["c1", "b1"], ["c2", "b2", "r2", "p2"]]  # c3 is on 28×28
    fused = fuse_chunkable(graph())
    assert [n.name for n in fused.nodes][:4] == ["c0+b0+r0", "c1+b1", "add", "r1"]
    assert fuse_chunkable(g := graph(SIZE // 2)) is g  # a CIFAR-size plane: nothing fused
    net = Network(graph(), get_backend("cpu"), seed=1)
    assert [n.name for n in net.chunked] == ["c0+b0+r0", "c1+b1", "c2+b2+r2+p2"]
    plain = Network(graph(), get_backend("cpu"), seed=1, chunkable=False)
    assert not plain.chunked
    assert set(net.state_dict()) == set(plain.state_dict())  # torchvision's names either way
    for key, value in plain.state_dict().items():
        assert np.array_equal(net.state_dict()[key], value), key  # the same initial values too


def one_step(net, x, labels):
    net.forward(x)
    loss = net.loss(labels)
    net.backward()
    net.end_iteration()
    return loss


@pytest.mark.parametrize("batch", [5, 13])
def test_fused_layers_compute_what_the_separate_ones_do(batch):
    """Another batch-norm arithmetic (one pass, shifted sums) and the weight gradient summed per chunk: the
    difference is float32 rounding, not a different function."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, 3, SIZE, SIZE), dtype=np.float32) * 2 + 1
    labels = np.arange(batch) % 4
    fused = Network(graph(), get_backend("cpu"), seed=1)
    plain = Network(graph(), get_backend("cpu"), seed=1, chunkable=False)
    assert one_step(fused, x, labels) == pytest.approx(one_step(plain, x, labels), rel=1e-6)
    g_fused, g_plain = fused.gradients.flat, plain.gradients.flat
    assert np.abs(g_fused - g_plain).max() <= 1e-5 * np.abs(g_plain).max()
    for key, value in plain.state_dict().items():  # running statistics, num_batches_tracked
        np.testing.assert_allclose(fused.state_dict()[key], value, rtol=1e-5, atol=1e-6, err_msg=key)
    np.testing.assert_allclose(fused.predict(x), plain.predict(x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("batch", [3, CHUNK_IMAGES, 13])
def test_keep_and_recompute_give_the_same_bits(batch):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((batch, 3, SIZE, SIZE), dtype=np.float32)
    labels = np.arange(batch) % 4
    keep = Network(graph(), get_backend("cpu"), seed=2)
    recompute = Network(graph(), get_backend("cpu"), seed=2)
    recompute.set_recomputed([n.name for n in recompute.chunked])
    assert all(isinstance(n.layer, ChunkedConvBN) and n.layer.mode == "recompute" for n in recompute.chunked)
    for _ in range(2):
        assert one_step(keep, x, labels) == one_step(recompute, x, labels)
        assert np.array_equal(keep.gradients.flat, recompute.gradients.flat)
    assert np.array_equal(keep.predict(x), recompute.predict(x))
    # what each keeps: the batch norm's output in keep mode only
    saved = {b.name for b in keep.program(batch).buffers if b.name.startswith("c0+b0+r0:")}
    assert "c0+b0+r0:y" in saved
    assert "c0+b0+r0:y" not in {b.name for b in recompute.program(batch).buffers}
    with pytest.raises(ValueError, match="no chunked layer named c3"):
        keep.set_recomputed(["c3"])


def pointwise_graph() -> Graph:
    """A 3×3 chain on the input, then three 1×1 chains (ReLU6, ReLU, none) and an Add: in recompute mode the 1×1
    ones' outputs can be rebuilt from their inputs (``ChunkedConvBN.output_rebuilt_from``: "x"), c2's from c1's
    rebuilt output (a chain); c3's is read by no backward (the Add's)."""
    return Graph([
        ("c0", Conv2d(3, 8, 3, 1, 1, bias=False), ["input"]),
        ("b0", BatchNorm2d(8), ["c0"]),
        ("r0", ReLU(), ["b0"]),
        ("c1", Conv2d(8, 12, 1, bias=False), ["r0"]),
        ("b1", BatchNorm2d(12), ["c1"]),
        ("r1", ReLU6(), ["b1"]),
        ("c2", Conv2d(12, 8, 1, bias=True), ["r1"]),
        ("b2", BatchNorm2d(8), ["c2"]),
        ("r2", ReLU(), ["b2"]),
        ("c3", Conv2d(8, 8, 1, bias=False), ["r2"]),
        ("b3", BatchNorm2d(8), ["c3"]),
        ("add", Add(), ["r0", "b3"]),
        ("gap", GlobalAvgPool(), ["add"]),
        ("fc", Dense(8, 4), ["gap"]),
    ], (3, SIZE, SIZE))


def widen(net: Network, batch: int, wide: str | None) -> None:
    """Decide the recomputing layers' widened passes (``ChunkedConvBN.wide``) instead of the network: "none", or
    "all" they have (whether the step has room or not: the bits are the same either way); None: the network's."""
    if wide is not None:
        for node in net.chunked:
            node.layer.wide[batch] = frozenset(node.layer.widenable() if wide == "all" else ())


def depthwise_graph() -> Graph:
    """MobileNetV2's inverted residual on a chunked plane: an expand (1×1, ReLU6), a stride-1 depthwise 3×3
    (ReLU6: its conv needs working memory on a chunk), a projection (1×1, no activation); then a pooled head."""
    return Graph([
        ("c0", Conv2d(3, 8, 3, 1, 1, bias=False), ["input"]),
        ("b0", BatchNorm2d(8), ["c0"]),
        ("r0", ReLU6(), ["b0"]),
        ("c1", Conv2d(8, 16, 1, bias=False), ["r0"]),
        ("b1", BatchNorm2d(16), ["c1"]),
        ("r1", ReLU6(), ["b1"]),
        ("dw", Conv2d(16, 16, 3, 1, 1, groups=16, bias=False), ["r1"]),
        ("bd", BatchNorm2d(16), ["dw"]),
        ("rd", ReLU6(), ["bd"]),
        ("c2", Conv2d(16, 8, 1, bias=False), ["rd"]),
        ("b2", BatchNorm2d(8), ["c2"]),
        ("gap", GlobalAvgPool(), ["b2"]),
        ("fc", Dense(8, 4), ["gap"]),
    ], (3, SIZE, SIZE))


def fit(tmp_path, recompute, offload, steps=3, make=None, wide=None, chunkable=True):
    data = synthetic(num_classes=4, seed=0, train=26, test=4, shape=(3, SIZE, SIZE))
    backend = get_backend("cpu")
    net = Network((make or graph)(), backend, seed=3, chunkable=chunkable)
    if recompute:
        net.set_recomputed(recompute)
    widen(net, 13, wide)
    optimizer = make_optimizer("sgd", net, backend, 0.1, momentum=0.9, manager=net.mgr)
    session = OffloadSession(OffloadConfig(window=1, directory=str(tmp_path))) if offload else None
    Trainer(net, optimizer, data, batch_size=13, steps=steps, seed=4, prefetch=1, evaluate_at_end=False,
            offload=session).fit()
    return net.state_dict()


def test_any_mode_with_offload_on_or_off_trains_the_same_weights(tmp_path):
    reference = fit(tmp_path, [], offload=False)
    every = ["c0+b0+r0", "c1+b1", "c2+b2+r2+p2"]
    for recompute, offload, wide in [(["c0+b0+r0", "c2+b2+r2+p2"], False, None), ([], True, None),
                                     (every, True, None), (every, False, "none"), (every, True, "all")]:
        weights = fit(tmp_path, recompute, offload, wide=wide)
        for key, value in reference.items():
            assert np.array_equal(weights[key], value), (recompute, offload, wide, key)
    # a chain that adds its input gradient into the skip's (block_graph), with offload on and off
    reference = fit(tmp_path, [], offload=False, make=block_graph)
    for recompute, offload in [([], True), (["c1+b1+r1", "c2+b2"], True), (["c1+b1+r1"], False)]:
        weights = fit(tmp_path, recompute, offload, make=block_graph)
        for key, value in reference.items():
            assert np.array_equal(weights[key], value), (recompute, offload, key)


def block_graph() -> Graph:
    """ResNet's basic block on a chunked plane: the block's input r0 feeds the first chain (c1+b1+r1) and the skip,
    so that chain's input gradient is the second contribution to a pending one (the Add's dout): the chain adds it
    in (``accumulates_input_gradients``), no buffer of its own and no sum after it."""
    return Graph([
        ("c0", Conv2d(3, 8, 3, 1, 1, bias=False), ["input"]),
        ("b0", BatchNorm2d(8), ["c0"]),
        ("r0", ReLU(), ["b0"]),
        ("c1", Conv2d(8, 8, 3, 1, 1, bias=False), ["r0"]),
        ("b1", BatchNorm2d(8), ["c1"]),
        ("r1", ReLU(), ["b1"]),
        ("c2", Conv2d(8, 8, 3, 1, 1, bias=False), ["r1"]),
        ("b2", BatchNorm2d(8), ["c2"]),
        ("add", Add(), ["b2", "r0"]),
        ("r2", ReLU(), ["add"]),
        ("gap", GlobalAvgPool(), ["r2"]),
        ("fc", Dense(8, 4), ["gap"]),
    ], (3, SIZE, SIZE))


@pytest.mark.parametrize("mode", ["keep", "recompute"])
def test_a_chain_adds_its_input_gradient_into_the_pending_one_with_the_bits_of_a_sum(mode):
    batch = 13  # chunks of 8 and 5
    rng = np.random.default_rng(5)
    x = rng.standard_normal((batch, 3, SIZE, SIZE), dtype=np.float32)
    labels = np.arange(batch) % 4
    nets = [Network(block_graph(), get_backend("cpu"), seed=6) for _ in range(2)]
    for node in nets[1].chunked:  # the other network sums into a new buffer (the GRAD_SUM step)
        node.layer.accumulates_input_gradients = False
    for net in nets:
        net.set_recomputed([n.name for n in net.chunked] if mode == "recompute" else [])
    adding, summing = (net.program(batch) for net in nets)
    into = [s for s in adding.steps if s.accumulate]
    assert [adding.node_names[s.node] for s in into] == ["c1+b1+r1"] and into[0].accumulate == (True,)
    pending = adding.buffers[into[0].results[0]]
    assert pending.name == "r2:grad@gap" and into[0].writes == (pending.id,)  # r2 over it, Add handed it on
    assert not [b for b in into[0].creates if adding.buffers[b].array_type is ArrayType.ACTIVATION_GRAD]
    assert not [s for s in adding.steps if s.op is Op.GRAD_SUM and s.node == into[0].node]
    assert [s for s in summing.steps if s.op is Op.GRAD_SUM]  # the other sums it in a step of its own
    grads = (ArrayType.ACTIVATION_GRAD,)
    worst = [max(p.live_bytes(m, grads) for m in range(p.moments)) for p in (adding, summing)]
    assert worst[0] == worst[1] - batch * 8 * SIZE * SIZE * 4  # one input gradient fewer at the worst moment
    for _ in range(2):
        assert one_step(nets[0], x, labels) == one_step(nets[1], x, labels)
        assert np.array_equal(nets[0].gradients.flat, nets[1].gradients.flat)


def test_offload_rebuilds_a_chunked_layers_output_from_its_y_instead_of_swapping_it():
    """Keep mode with an activation and no pool (c0+b0+r0): the output, activation(y), is a unit of its own that
    the N=1 plan rebuilds from the layer's saved y before the next conv's backward; the pool's chain and the
    chain without an activation keep theirs in their saved unit, and recompute mode has no y to rebuild from.
    The weights with the rebuild are the ones without offload (``test_any_mode_with_offload_on_or_off_trains_
    the_same_weights``); here the plan, the bytes it writes, and the rebuilt output against the forward's, byte for
    byte."""
    from engine.offload.plan import NETWORK_INPUT, build_plan, program_units, recompute_candidates

    batch = 13
    net = Network(graph(), get_backend("cpu"), seed=3)
    index = {node.name: node.index for node in net.graph.nodes}
    chain = index["c0+b0+r0"]
    units, _, steps = program_units(net.program(batch))
    keys = {unit.key for unit in units}
    assert (chain, "output") in keys
    assert (index["c1+b1"], "output") not in keys and (index["c2+b2+r2+p2"], "output") not in keys
    candidates = recompute_candidates(net.program(batch), units)
    rebuild = candidates[(chain, "output")]
    assert rebuild.nodes == (chain,)
    assert [(key, tensor.name) for key, tensor in rebuild.sources] == [((chain, "saved"), "c0+b0+r0:y")]
    plan = build_plan(units, 1, steps, candidates)
    assert plan.units[(chain, "output")].decision == "recompute"
    assert plan.offloaded_bytes < build_plan(units, 1, steps).offloaded_bytes  # its output is never written
    x = np.random.default_rng(0).standard_normal((batch, 3, SIZE, SIZE)).astype(np.float32)
    x[0, 0] = 0.0  # a few planes of exact zeros, so some y are ±0
    net.forward(x, training=True)
    layer, reader = net.graph.nodes[chain].layer, net.graph.nodes[index["c1+b1"]].layer
    made = np.asarray(reader.saved["x"].array)  # the output the forward made, as the next conv keeps it
    rebuilt = np.full(made.shape, np.nan, np.float32)
    layer.recompute_output([layer.saved["y"].array], rebuilt)
    assert rebuilt.tobytes() == made.tobytes()
    recomputing = Network(graph(), get_backend("cpu"), seed=3)
    recomputing.set_recomputed(["c0+b0+r0"])
    program = recomputing.program(batch)
    units, _, _ = program_units(program)
    # recompute mode keeps no y: the output is rebuilt from the layer's input, here the network's (NETWORK_INPUT)
    assert [(key, tensor.name) for key, tensor in recompute_candidates(program, units)[(chain, "output")].sources] == [
        (NETWORK_INPUT, "input"), ((chain, "saved"), "c0+b0+r0:scale_shift")]


def test_offload_rebuilds_a_recomputing_layers_output_from_its_input(tmp_path):
    """Recompute mode keeps no y, so a chunked layer whose conv needs no scratch rebuilds its output from its input
    and its saved scale and shift instead (the forward's pass 2 again: each chunk's conv, then the batch-norm apply
    in place): c1+b1+r1's from c0+b0+r0's output, c2+b2+r2's from c1+b1+r1's rebuilt one (a chain: rebuilt
    first). The same weights as without offload, any window, and the rebuild's bytes are the forward's."""
    from engine.offload.plan import NETWORK_INPUT, build_plan, plan_with_chains, program_units, recompute_candidates

    names = ["c0+b0+r0", "c1+b1+r1", "c2+b2+r2", "c3+b3"]
    reference = fit(tmp_path, [], offload=False, make=pointwise_graph)
    for recompute in (names, names[1:]):
        weights = fit(tmp_path, recompute, offload=True, make=pointwise_graph)
        for key, value in reference.items():
            assert np.array_equal(weights[key], value), (recompute, key)
    batch = 13
    net = Network(pointwise_graph(), get_backend("cpu"), seed=3)
    net.set_recomputed(names)
    index = {node.name: node.index for node in net.graph.nodes}
    program = net.program(batch)
    units, _, steps = program_units(program)
    candidates = recompute_candidates(program, units)
    c0, c1, c2 = index["c0+b0+r0"], index["c1+b1+r1"], index["c2+b2+r2"]
    assert [(key, tensor.name) for key, tensor in candidates[(c1, "output")].sources] == [
        ((c0, "output"), "c0+b0+r0:out"), ((c1, "saved"), "c1+b1+r1:scale_shift")]  # c0's rebuilt: a chain
    assert [(key, tensor.name) for key, tensor in candidates[(c2, "output")].sources] == [
        ((c1, "output"), "c1+b1+r1:out"), ((c2, "saved"), "c2+b2+r2:scale_shift")]
    assert [key for key, _ in candidates[(c0, "output")].sources] == [NETWORK_INPUT, (c0, "saved")]  # on the input
    assert (index["c3+b3"], "output") not in candidates  # read by no backward: never saved
    plan = build_plan(units, 1, steps, candidates)
    assert plan.units[(c1, "output")].decision == "recompute"
    x = np.random.default_rng(0).standard_normal((batch, 3, SIZE, SIZE)).astype(np.float32)
    net.forward(x, training=True)
    for node, reader in ((c1, c2), (c2, index["c3+b3"])):
        layer = net.graph.nodes[node].layer
        made = np.asarray(net.graph.nodes[reader].layer.saved["x"].array)  # the output the next layer keeps
        rebuilt = np.full(made.shape, np.nan, np.float32)
        layer.recompute_output([layer.saved["x"].array, layer.saved["scale_shift"].array], rebuilt)
        assert rebuilt.tobytes() == made.tobytes()
    # c0's output is rebuilt from the network input, c1's from it (a chain), c2's from c1's (a chain that taking
    # c1's made: build_plan tries it then, and takes it as the arena does not grow and less is written)
    assert [plan.units[(n, "output")].decision for n in (c0, c1, c2)] == ["recompute"] * 3
    alone, _ = plan_with_chains(units, 1, steps, candidates, frozenset({(c1, "output")}))
    assert alone.units[(c2, "output")].decision == "swap" and alone.offloaded_bytes > plan.offloaded_bytes


def test_a_depthwise_output_is_rebuilt_with_working_memory_from_the_arenas_tail(tmp_path):
    """A stride-1 depthwise conv needs working memory on a chunk; its rebuild from its input (recompute mode) gets
    it from the offload arena's tail, planned once for the largest rebuild (``OffloadPlan.rebuild_scratch_bytes``):
    the plan's arena grows by it and not otherwise. The rebuilt bytes are the forward's, and offload trains the
    weights it trains without."""
    from engine.offload.plan import build_plan, program_units, recompute_candidates

    names = ["c0+b0+r0", "c1+b1+r1", "dw+bd+rd", "c2+b2"]
    reference = fit(tmp_path, [], offload=False, make=depthwise_graph)
    weights = fit(tmp_path, names, offload=True, make=depthwise_graph)
    for key, value in reference.items():
        assert np.array_equal(weights[key], value), key
    batch = 13
    net = Network(depthwise_graph(), get_backend("cpu"), seed=3)
    net.set_recomputed(names)
    index = {node.name: node.index for node in net.graph.nodes}
    dw, c1 = index["dw+bd+rd"], index["c1+b1+r1"]
    program = net.program(batch)
    units, _, steps = program_units(program)
    candidates = recompute_candidates(program, units)
    layer = net.graph.nodes[dw].layer
    scratch = 4 * layer.rebuild_scratch_elements((batch, 16, SIZE, SIZE))
    assert scratch > 0 and candidates[(dw, "output")].scratch_bytes == scratch
    assert candidates[(c1, "output")].scratch_bytes == 0  # a 1×1 conv works in place
    plan = build_plan(units, 1, steps, candidates)
    assert plan.units[(dw, "output")].decision == "recompute"
    assert plan.rebuild_scratch_bytes >= scratch
    assert plan.rebuild_scratch_offset >= max(u.arena_offset + u.nbytes for u in plan.units.values())
    assert plan.arena_bytes == plan.rebuild_scratch_offset + plan.rebuild_scratch_bytes
    without = build_plan(units, 1, steps, {k: c for k, c in candidates.items() if not c.scratch_bytes})
    assert without.rebuild_scratch_bytes == 0  # only the 1×1 convs' rebuilds: no tail
    x = np.random.default_rng(0).standard_normal((batch, 3, SIZE, SIZE)).astype(np.float32)
    net.forward(x, training=True)
    made = np.asarray(net.graph.nodes[index["c2+b2"]].layer.saved["x"].array)
    rebuilt = np.full(made.shape, np.nan, np.float32)
    layer.recompute_output([layer.saved["x"].array, layer.saved["scale_shift"].array], rebuilt,
                           np.full(scratch // 4, np.nan, np.float32))
    assert rebuilt.tobytes() == made.tobytes()


def test_recompute_holds_less_at_its_worst_moment():
    keep = Network(graph(), get_backend("cpu"), seed=2)
    recompute = Network(graph(), get_backend("cpu"), seed=2)
    recompute.set_recomputed([n.name for n in recompute.chunked])
    batch = 32
    kept = {b.name: b.nbytes for b in keep.program(batch).buffers if b.owner == 0}
    assert kept["c0+b0+r0:y"] == batch * 8 * SIZE * SIZE * 4  # the whole batch's batch-norm output
    # recompute: the layer's own working memory is one chunk's, whatever the batch
    step_keep = keep.program(batch).steps[0].scratch_bytes
    step_recompute = recompute.program(batch).steps[0].scratch_bytes
    assert step_recompute == recompute.program(64).steps[0].scratch_bytes
    assert step_recompute < kept["c0+b0+r0:y"]
    # no pool: keep mode's forward writes the conv's output into y, recompute mode's into the layer's output
    assert step_keep == step_recompute
    # and the step as a whole: the planned peak (what engine memory and the limits read) is lower
    assert recompute.memory_report(batch).planned_peak_bytes < keep.memory_report(batch).planned_peak_bytes


def test_a_chain_on_the_network_input_declares_no_backward_data_workspace():
    """ResNet-18's stem at 224 (its input needs no gradient): the backward's working memory is the weight
    gradient's workspace, not the larger backward-data one (14.1 against 3.2 MiB), and the program plans that."""
    from models import build_model

    net = build_model("resnet18", 10, get_backend("cpu"), variant="imagenet", image_size=224)
    stem = net.chunked[0]
    layer, x = stem.layer, (32, 3, 224, 224)
    data, weight = (4 * layer._conv_workspace(x, d) for d in ("backward_data", "backward_weight"))
    assert data > weight
    assert 4 * (layer.backward_scratch([x]) - layer.backward_scratch([x], (False,))) == data - weight
    program = net.program(32)
    step = next(s for s in program.steps if s.op is Op.BACKWARD and s.node == stem.index)
    assert step.need == (False,) and step.scratch_bytes == 4 * layer.backward_scratch([x], (False,))


def test_the_convs_each_pass_runs_in_each_mode(monkeypatch):
    """How often each chunked layer's conv runs forward in a training step, on a batch of three chunks (8, 8, 3):
    keep mode once per chunk in forward and never in backward. Recompute mode, forward: once per chunk without a
    pool (pass 1 writes into the layer's output, pass 2 normalizes it there); with a pool pass 2 runs it again on
    every chunk but the last, unless the pass is widened (the whole batch's conv output in working memory).
    Backward: pass 1 on every chunk, pass 2 again on every chunk but the last, unless widened (pass 1's ys)."""
    from engine.layers.chunked import ChunkedConvBN

    calls: list[tuple[str, str]] = []
    phase = ["forward"]
    original = ChunkedConvBN._conv_forward
    monkeypatch.setattr(ChunkedConvBN, "_conv_forward",
                        lambda self, x, z, scratch: (calls.append((phase[0], self.name)),
                                                     original(self, x, z, scratch)))
    batch = 19
    x = np.random.default_rng(1).standard_normal((batch, 3, SIZE, SIZE)).astype(np.float32)
    labels = np.arange(batch) % 4
    counts, grads = {}, {}
    for mode, wide in [("keep", None), ("recompute", "none"), ("recompute", "all")]:
        net = Network(graph(), get_backend("cpu"), seed=2)
        if mode == "recompute":
            net.set_recomputed([n.name for n in net.chunked])
        widen(net, batch, wide)
        calls.clear()
        phase[0] = "forward"
        net.forward(x, training=True)
        net.loss(labels)
        phase[0] = "backward"
        net.backward()
        counts[mode, wide] = {(p, n.name): calls.count((p, n.name)) for n in net.chunked
                              for p in ("forward", "backward")}
        grads[mode, wide] = {name: np.array(g) for name, g in net.gradients.views.items()}
    names = ["c0+b0+r0", "c1+b1", "c2+b2+r2+p2"]
    assert counts["keep", None] == {**{("forward", n): 3 for n in names}, **{("backward", n): 0 for n in names}}
    assert counts["recompute", "none"] == {("forward", "c0+b0+r0"): 3, ("forward", "c1+b1"): 3,
                                           ("forward", "c2+b2+r2+p2"): 5, **{("backward", n): 5 for n in names}}
    assert counts["recompute", "all"] == {**{("forward", n): 3 for n in names}, **{("backward", n): 3 for n in names}}
    for key in grads["keep", None]:  # and the same bits
        assert grads["recompute", "none"][key].tobytes() == grads["keep", None][key].tobytes(), key
        assert grads["recompute", "all"][key].tobytes() == grads["keep", None][key].tobytes(), key


def test_recompute_widens_its_passes_only_where_the_step_has_room():
    """``Network.program`` widens a recomputing layer's pass only where the working memory it adds keeps its moment
    within the step's peak (both as sums and as placed): the planned peaks with the widened passes are the
    unwidened ones. The test graph at batch 32 has room for some and not all."""
    batch = 32
    decided = Network(graph(), get_backend("cpu"), seed=2)
    decided.set_recomputed([n.name for n in decided.chunked])
    program = decided.program(batch)
    chosen = {n.name: n.layer.wide[batch] for n in decided.chunked}
    none = Network(graph(), get_backend("cpu"), seed=2)
    none.set_recomputed([n.name for n in none.chunked])
    widen(none, batch, "none")
    assert any(chosen.values())
    assert program.steps != none.program(batch).steps  # some scratch is larger
    assert decided.memory_report(batch).planned_peak_bytes == none.memory_report(batch).planned_peak_bytes
    for types in (None, [t for t in PLANNED_TYPES if t not in (ArrayType.ACTIVATIONS, ArrayType.FF_CACHE)]):
        args = (batch,) if types is None else (batch, types)
        assert decided.arena_plan(*args).planned_peak == none.arena_plan(*args).planned_peak
    everything = Network(graph(), get_backend("cpu"), seed=2)
    everything.set_recomputed([n.name for n in everything.chunked])
    widen(everything, batch, "all")
    assert everything.memory_report(batch).planned_peak_bytes > none.memory_report(batch).planned_peak_bytes


def test_engine_train_says_which_chunked_layers_recompute(tmp_path):
    """``--chunks recompute`` on the cnn at 224 (its two conv + batch norm + ReLU + pool chains are chunked): the
    summary line and the JSON name them; ``keep`` names none; the same final loss either way."""
    import json

    from click.testing import CliRunner

    from cli import main

    losses = {}
    for chunks in ("recompute", "keep"):
        summary = tmp_path / f"{chunks}.json"
        result = CliRunner().invoke(main, ["train", "--model", "cnn", "--data", "synthetic", "--image-size", "224",
                                           "--batch-size", "10", "--steps", "2", "--no-progress", "--threads", "1",
                                           "--chunks", chunks, "--summary-json", str(summary)])
        assert result.exit_code == 0, result.output
        needs = json.loads(summary.read_text())["memory_needs"]
        assert needs["chunked_layers"] == ["conv1+bn1+relu1+pool1", "conv2+bn2+relu2+pool2"]
        assert needs["recomputed_layers"] == (needs["chunked_layers"] if chunks == "recompute" else [])
        said = "chunked layers: 2 of 2 recompute their chunks in backward" in result.output
        assert said == (chunks == "recompute")
        losses[chunks] = json.loads(summary.read_text())["final_loss"]
    assert losses["recompute"] == losses["keep"]


def test_engine_train_prefetches_less_then_recomputes_then_stops_prefetching(monkeypatch, tmp_path):
    """The cnn at 224 under tight limits, --prefetch not given: first 1 batch ahead instead of 2, then chunked
    layers recompute, and no prefetch only when every layer recomputing does not fit; each said in one line. With
    --prefetch 2 given, layers recompute instead; a refusal names --prefetch 0 when that would fit."""
    import json

    from click.testing import CliRunner

    from cli import main
    from engine.memory.limits import MemoryLimit
    from engine.offload import budget

    monkeypatch.setattr(budget.Setup, "measure", classmethod(lambda cls, blocks=(): cls(0, 0, 0)))  # exact limits
    train = ["train", "--model", "cnn", "--image-size", "224", "--batch-size", "10", "--data", "synthetic",
             "--steps", "1", "--no-progress", "--threads", "1"]

    def run(limit, *options, name="run"):
        monkeypatch.setattr(budget, "memory_limit", lambda: MemoryLimit(limit, "test limit"))
        result = CliRunner().invoke(main, [*train, *options, "--summary-json", str(tmp_path / f"{name}.json")])
        needs = json.loads((tmp_path / f"{name}.json").read_text())["memory_needs"] if result.exit_code == 0 else {}
        return result, needs

    _, roomy = run(64 << 30)
    one = roomy["smallest_input_ring_bytes"]  # a ring of one batch
    assert one * 3 == roomy["input_ring_bytes"]
    keep = roomy["needed_no_offload_bytes"]  # keeping every layer, with a ring of one batch
    result, needs = run(keep + one + (1 << 20), name="prefetch1")
    assert result.exit_code == 0, result.output
    assert "prefetch: 1 batch ahead, not 2, to fit the limit" in result.output
    assert needs["recomputed_layers"] == [] and needs["input_ring_bytes"] == 2 * one
    result, needs = run(keep + (1 << 20), name="recompute")  # a layer recomputes before the prefetch stops
    assert result.exit_code == 0, result.output
    assert "prefetch: 1 batch ahead" in result.output and needs["recomputed_layers"]
    _, recomputing = run(64 << 30, "--chunks", "recompute", name="smallest")
    smallest = recomputing["needed_no_offload_bytes"]  # every layer recomputing, a ring of one batch
    result, needs = run(smallest + (1 << 20), name="prefetch0")
    assert result.exit_code == 0, result.output
    assert "prefetch: 0 batches ahead, not 2, to fit the limit" in result.output
    assert needs["input_ring_bytes"] == one
    given, needs = run(keep + one + (1 << 20), "--prefetch", "2", name="given")
    assert given.exit_code == 0, given.output
    assert "prefetch:" not in given.output and "recompute their chunks in backward" in given.output
    assert needs["input_ring_bytes"] == 3 * one and needs["recomputed_layers"]
    refused, _ = run(keep + (1 << 20), "--prefetch", "2", "--chunks", "keep")
    assert refused.exit_code == 1 and "without offload, the limit is" in refused.output
    assert "with --prefetch 0 it fits (--prefetch 2 holds 11.5 MiB more)" in refused.output  # the way out named
    assert "with --chunks auto it fits (1 of 2 chunked layers recompute" in refused.output  # the other way out
    refused, _ = run(keep - (8 << 20), "--prefetch", "2", "--chunks", "keep")
    assert refused.exit_code == 1 and "--prefetch 0 it fits" not in refused.output  # nor would it fit then
    refused, _ = run(smallest - (8 << 20), "--chunks", "keep")
    assert refused.exit_code == 1 and "--chunks auto it fits" not in refused.output  # nothing fits there


def test_a_chain_without_an_activation_keeps_its_output_not_a_copy():
    """Keep mode, no activation, no pool ("c1+b1"): the batch norm's output is the layer's output, kept as that
    (``keeps_output``), not a second time as "y"; recompute keeps neither; the others keep y as before."""
    net = Network(graph(), get_backend("cpu"), seed=1)
    layers = {node.name: node.layer for node in net.chunked}
    shape = (4, 3, SIZE, SIZE)

    def saved(name, x_shape):
        return [spec.name for spec in layers[name].saved_specs([x_shape])]

    assert layers["c1+b1"].keeps_output and "y" not in saved("c1+b1", (4, 8, SIZE, SIZE))
    assert not layers["c0+b0+r0"].keeps_output and "y" in saved("c0+b0+r0", shape)
    assert not layers["c2+b2+r2+p2"].keeps_output
    net.set_recomputed(["c1+b1"])
    assert not layers["c1+b1"].keeps_output and "y" not in saved("c1+b1", (4, 8, SIZE, SIZE))
    net.set_recomputed([])
    net.close()


def test_two_chained_chains_run_as_one_give_their_bits_and_hold_less():
    """benchmarks/pair_study.py (issue 30, studied before building): MobileNetV2's three pairs of chunked chains run
    chunk by chunk as one give the separate chains' bits (every gradient, the running statistics; 21 images: chunks
    of 8, 8 and 5, so that the weight gradients' order of three sums shows), both near PyTorch float64, and hold
    less at their worst moment."""
    study = load_script("pair_study")
    assert study.check(verbose=False) == []
    for spec in study.CASES.values():
        case = study.make_case(spec, 21, 12)
        assert study.pair(*case)["peak"] < study.separate(*case)["peak"]


def pair_graph() -> Graph:
    """An expansion chain whose only reader is a depthwise chain: one ``ChunkedPair`` with ``--chunks pairs``. Its
    input r0 also feeds the skip (the pair adds its input gradient into the pending one); the projection after it
    and the chain on the input stay single."""
    return Graph([
        ("c0", Conv2d(3, 8, 3, 1, 1, bias=False), ["input"]),
        ("b0", BatchNorm2d(8), ["c0"]),
        ("r0", ReLU(), ["b0"]),
        ("c1", Conv2d(8, 16, 1, bias=False), ["r0"]),
        ("b1", BatchNorm2d(16), ["c1"]),
        ("r1", ReLU6(), ["b1"]),
        ("c2", Conv2d(16, 16, 3, 1, 1, groups=16, bias=False), ["r1"]),
        ("b2", BatchNorm2d(16), ["c2"]),
        ("r2", ReLU6(), ["b2"]),
        ("c3", Conv2d(16, 8, 1, bias=False), ["r2"]),
        ("b3", BatchNorm2d(8), ["c3"]),
        ("add", Add(), ["b3", "r0"]),
        ("r4", ReLU(), ["add"]),
        ("gap", GlobalAvgPool(), ["r4"]),
        ("fc", Dense(8, 4), ["gap"]),
    ], (3, SIZE, SIZE))


def input_pair_graph() -> Graph:
    """A pair on the network's input (no input gradient) whose second chain has no activation."""
    return Graph([
        ("c0", Conv2d(3, 8, 3, 1, 1, bias=False), ["input"]),
        ("b0", BatchNorm2d(8), ["c0"]),
        ("r0", ReLU6(), ["b0"]),
        ("c1", Conv2d(8, 4, 1, bias=True), ["r0"]),
        ("b1", BatchNorm2d(4), ["c1"]),
        ("gap", GlobalAvgPool(), ["b1"]),
        ("fc", Dense(4, 4), ["gap"]),
    ], (3, SIZE, SIZE))


@pytest.mark.parametrize("make", [pair_graph, input_pair_graph])
def test_a_pair_of_chains_gives_the_separate_chains_bits_and_holds_less(make):
    from engine import warmup
    from engine.layers.chunked import ChunkedPair

    batch = 21  # chunks of 8, 8 and 5: the weight gradients' order of three sums shows
    rng = np.random.default_rng(7)
    x = rng.standard_normal((batch, 3, SIZE, SIZE), dtype=np.float32)
    labels = np.arange(batch) % 4
    paired = Network(make(), get_backend("cpu"), seed=8, chunkable="pairs")
    pairs = [n for n in paired.chunked if isinstance(n.layer, ChunkedPair)]
    assert len(pairs) == 1 and pairs[0].name.startswith("c1+b1+r1+c2" if make is pair_graph else "c0+b0+r0+c1")
    keep = Network(make(), get_backend("cpu"), seed=8)
    recompute = Network(make(), get_backend("cpu"), seed=8)
    recompute.set_recomputed([n.name for n in recompute.chunked])
    for _ in range(2):
        losses = [one_step(net, x, labels) for net in (paired, keep, recompute)]
        assert losses[0] == losses[1] == losses[2]
        assert np.array_equal(paired.gradients.flat, keep.gradients.flat)
        assert np.array_equal(paired.gradients.flat, recompute.gradients.flat)
    for key, value in keep.state_dict().items():  # running statistics and both batch norms' counters
        assert np.array_equal(paired.state_dict()[key], value), key
    assert np.array_equal(paired.predict(x), keep.predict(x))
    loaded = Network(make(), get_backend("cpu"), seed=9, chunkable="pairs")  # a checkpoint goes either way
    loaded.load_state_dict(keep.state_dict())
    for key, value in keep.state_dict().items():
        assert np.array_equal(loaded.state_dict()[key], value), key
    assert paired.arena_plan(batch).planned_peak < recompute.arena_plan(batch).planned_peak  # never whole
    # the pair's convs run on the separate chains' shapes: the same warm-up jobs, no kernel of its own
    assert set(warmup.model_jobs(paired.graph)) == set(warmup.model_jobs(recompute.graph))
    with pytest.raises(ValueError, match="has no 'keep' mode"):
        pairs[0].layer.mode = "keep"
    paired.set_recomputed([])  # a pair always recomputes
    assert pairs[0].layer.mode == "recompute"


def test_a_pair_trains_the_same_weights_with_offload_on_or_off(tmp_path):
    """``--chunks pairs`` with a window of one layer on disk: the pair's saved scales and its input are units like any
    chunked layer's (its output is swapped, not rebuilt: ``output_rebuilt_from`` is None)."""
    reference = fit(tmp_path, [], offload=False, make=pair_graph)
    for offload in (False, True):
        weights = fit(tmp_path, [], offload=offload, make=pair_graph, chunkable="pairs")
        for key, value in reference.items():
            assert np.array_equal(weights[key], value), (offload, key)


def test_a_refusal_names_chunks_pairs_where_the_graph_has_a_pair(monkeypatch):
    """Under a limit nothing fits, engine train names --chunks pairs where two chunked chains could run as one
    (MobileNetV2 at 112: its stem and first depthwise chain); a graph whose pairs are made already has none left
    to name (``has_chained_pairs``: what engine train asks, so --chunks pairs given names nothing)."""
    from click.testing import CliRunner

    from cli import main
    from engine.chunking import has_chained_pairs
    from engine.memory.limits import MemoryLimit
    from engine.offload import budget

    assert has_chained_pairs(fuse_chunkable(pair_graph())) and not has_chained_pairs(fuse_chunkable(graph()))
    assert not has_chained_pairs(fuse_chunkable(pair_graph(), pairs=True))  # made one already
    monkeypatch.setattr(budget, "memory_limit", lambda: MemoryLimit(1 << 20, "test limit"))
    train = ["train", "--model", "mobilenetv2", "--image-size", "112", "--batch-size", "2", "--data", "synthetic",
             "--steps", "1", "--no-progress", "--offload-n", "1", "--chunks", "recompute"]  # auto searches for seconds
    refused = CliRunner().invoke(main, train)
    assert refused.exit_code == 1 and "--chunks pairs may hold less (engine memory --pairs" in refused.output


def test_auto_takes_pairs_where_nothing_else_fits_and_refuses_after_the_least(monkeypatch, tmp_path):
    """``engine train --offload-n auto`` (``--chunks auto``) under a limit nothing fits: it measures what the run needs
    as asked, then the least it can need, and nothing more (the search before measured up to 46 plans, 24 s, at
    MobileNetV2 224), then the same with the network built again with ``--chunks pairs``; it refuses naming the
    smaller floor of the two. At the pairs' floor (MobileNetV2 224, batch 16: below the separate chains') it trains
    with them, planned from the first network's setup. Where pairs hold more (MobileNetV2 at 112) the refusal names
    the separate chains' floor. ``engine memory`` names the pairs' floor too. The setup is fixed at 0 so the floors
    are the plan's alone."""
    import json

    from click.testing import CliRunner

    from cli import main
    from engine.memory.limits import MemoryLimit
    from engine.offload import budget

    setups = []  # the second network is planned from the first one's setup, not measured again (13 MiB more there)
    monkeypatch.setattr(budget.Setup, "measure", classmethod(lambda cls, blocks=(): setups.append(1) or cls(0, 0, 0)))
    measured = []
    run_needs = budget.run_needs
    monkeypatch.setattr(budget, "run_needs", lambda *a, **k: measured.append(run_needs(*a, **k)) or measured[-1])

    def train(size: int, limit: int):
        measured.clear()
        setups.clear()
        monkeypatch.setattr(budget, "memory_limit", lambda: MemoryLimit(limit, "test limit"))
        return CliRunner().invoke(main, ["train", "--model", "mobilenetv2", "--image-size", str(size), "--batch-size",
                                         "16", "--data", "synthetic", "--steps", "1", "--no-progress", "--offload-dir",
                                         str(tmp_path), "--offload-n", "auto"])

    def floors() -> tuple[int, int]:  # the least of the separate chains and of the pairs, as measured
        assert len(measured) == 4 and [bool(n.paired) for n in measured] == [False, False, True, True]
        return measured[1].needed_min_offload, measured[3].needed_min_offload

    result = train(224, 1 << 20)
    separate, pairs = floors()
    assert pairs < separate and len(setups) == 1
    shown = CliRunner().invoke(main, ["memory", "--model", "mobilenetv2", "--image-size", "224", "--batch-size",
                                      "16,17", "--json"])  # engine memory plans the pairs too, to the byte
    assert shown.exit_code == 0, shown.output
    assert [e["needed_min_offload_bytes"] for e in json.loads(shown.output)["limits"]
            if e["batch_size"] == 16 and e["paired_layers"]] == [pairs]
    assert result.exit_code == 1 and "(with two chained chunked chains run as one, --chunks pairs" in result.output
    assert f"needs a limit of {budget.round_up_mib(pairs) / 2**30:.2f} GiB" in result.output.replace("\n", "")
    assert os.listdir(tmp_path) == []
    result = train(224, pairs)
    assert result.exit_code == 0, result.output
    assert "chunked pairs: 3 pairs of chained chunked layers run as one to fit the limit" in result.output
    assert "chunked layers: the 3 pairs and " in result.output and " of 4 other chunked layers recompute" in \
        result.output  # engine memory's --chunks column counts the same way: "pairs (3) + recompute (4)"
    assert len(setups) == 1 and measured[-1].paired and measured[-1].needed_min_offload == pairs
    result = train(112, 1 << 20)
    separate, pairs = floors()
    assert pairs > separate  # the pairs at 112 hold more: the refusal names the separate chains' floor
    assert result.exit_code == 1 and "--chunks pairs" not in result.output
    assert f"needs a limit of {budget.round_up_mib(separate) / 2**30:.2f} GiB" in result.output.replace("\n", "")

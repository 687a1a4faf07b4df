"""ENGINE_CONV (``kernels.cpu.conv.CONV_MODES``): each mode's paths round as documented, route as documented, and
give the same bits every call.

"float32-GEMM level": relative error against float64 at most ``GEMM_LEVEL`` × that of a float32 im2col GEMM on the
same data (``kernels.reference.conv.gemm32``). F(2×2) measured up to 2.0× (512 channels), F(4×4) 4.0–10.7×
(benchmarks/conv_precision.py; kernels/README.md, "Rounding per path").
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import numpy as np
import pytest

from kernels.cpu import conv
from kernels.reference import conv as ref
from tests.scripts import load_script

GEMM_LEVEL = 2.5

# ResNet-18's 3×3 layers at small batch: (C, K, plane, stride); CIFAR and ImageNet planes
LAYERS = [(64, 64, 32, 1), (128, 128, 16, 1), (256, 256, 8, 1), (512, 512, 4, 1), (256, 256, 14, 1),
          (512, 512, 7, 1), (128, 256, 16, 2)]
IDS = [f"{c}-{k}@{p}s{s}" for c, k, p, s in LAYERS]
WINOGRAD4 = ("winograd4", "winograd4-by-k", "winograd4-weight-by-k")


def _case(c, k, plane, stride, batch=1, seed=0):
    rng = np.random.default_rng(seed)
    x = np.maximum(rng.standard_normal((batch, c, plane, plane)), 0).astype(np.float32)
    w = (rng.standard_normal((k, c, 3, 3)) * np.sqrt(2.0 / (9 * c))).astype(np.float32)
    out = (plane - 1) // stride + 1
    return x, w, rng.standard_normal((batch, k, out, out)).astype(np.float32)


def _run(direction, x, w, dout, stride, paths):
    size = conv.workspace_size(x.shape, w.shape, stride, 1, 1, direction, paths)
    scratch = np.full(max(size, 1), np.nan, np.float32)
    if direction == "forward":
        out = np.empty(dout.shape, np.float32)
        conv.forward(x, w, None, out, stride, 1, 1, scratch, paths)
    elif direction == "data":
        out = np.empty(x.shape, np.float32)
        conv.backward_data(dout, w, out, stride, 1, 1, scratch, paths)
    else:
        out = np.empty(w.shape, np.float32)
        conv.backward_weight(x, dout, out, None, stride, 1, 1, scratch, paths)
    return out


def _errors(direction, x, w, dout, stride, paths):
    """(this path's, a float32 GEMM's) relative error against float64."""
    if direction == "forward":
        want = np.zeros(dout.shape)
        ref.conv2d_forward(x, w, None, want, stride, 1, 1)
        a, b = x, w
    elif direction == "data":
        want = np.zeros(x.shape)
        ref.conv2d_backward_data(dout, w, want, stride, 1, 1)
        a, b = dout, w
    else:
        want = np.zeros(w.shape)
        ref.conv2d_backward_weight(x, dout, want, None, stride, 1, 1)
        a, b = x, dout

    def rel(got):
        return np.linalg.norm(got.astype(np.float64) - want) / np.linalg.norm(want)

    gemm = ref.gemm32(direction, x.shape, w.shape, stride, 1, a, b)
    return rel(_run(direction, x, w, dout, stride, paths)), rel(gemm)


@pytest.mark.parametrize("layer", LAYERS, ids=IDS)
def test_float32_paths_round_like_a_float32_gemm(layer):
    c, k, plane, stride = layer
    x, w, dout = _case(c, k, plane, stride)
    for direction in ("forward", "data", "weight"):
        for mode in ("auto", "exact") if direction == "forward" else ("exact",):
            paths = conv.paths_for(mode)
            ours, gemm = _errors(direction, x, w, dout, stride, paths)
            kind = conv.path(x.shape, w.shape, stride, 1, 1, direction, paths)
            assert ours <= GEMM_LEVEL * gemm, f"{mode} {direction} on {kind}: {ours:.2e} > {GEMM_LEVEL} × {gemm:.2e}"


@pytest.mark.parametrize("layer", [LAYERS[1], LAYERS[3]], ids=[IDS[1], IDS[3]])
def test_the_fast_forward_rounds_more_than_a_gemm(layer):
    # the measure above tells F(4×4) apart: were it on the float32 paths, that test would fail
    c, k, plane, stride = layer
    x, w, dout = _case(c, k, plane, stride)
    paths = conv.paths_for("fast")
    assert conv.path(x.shape, w.shape, stride, 1, 1, "forward", paths) in WINOGRAD4
    ours, gemm = _errors("forward", x, w, dout, stride, paths)
    assert ours > GEMM_LEVEL * gemm


def _resnet_shapes():
    for c, k, plane, stride in LAYERS + [(64, 64, 56, 1), (128, 128, 28, 1)]:
        yield (32, c, plane, plane), (k, c, 3, 3), stride


def test_modes_route_as_documented():
    auto, exact, fast = (conv.paths_for(m) for m in ("auto", "exact", "fast"))
    fast_forward_f4 = 0
    for x_shape, w_shape, stride in _resnet_shapes():
        for direction in ("forward", "data", "weight"):
            kinds = {m: conv.path(x_shape, w_shape, stride, 1, 1, direction, p)
                     for m, p in (("auto", auto), ("exact", exact), ("fast", fast))}
            assert kinds["exact"] not in WINOGRAD4
            if direction == "forward":
                assert kinds["auto"] not in WINOGRAD4
                fast_forward_f4 += kinds["fast"] in WINOGRAD4
            elif direction == "data" and x_shape[2] * x_shape[3] > 32 * 32:  # v41: 56×56 data F(2×2) but in fast
                assert kinds["fast"] in WINOGRAD4 and kinds["auto"] == "winograd"
            else:  # backward decides no mask: auto keeps fast's paths
                assert kinds["auto"] == kinds["fast"]
    assert fast_forward_f4 >= 5  # fast is today's F(4×4) forward
    assert conv.paths_for("auto") == conv.Paths()
    with pytest.raises(ValueError, match="not one of"):
        conv.paths_for("quick")


def _in_a_process(mode: str | None, code: str):
    env = {k: v for k, v in os.environ.items() if k != "ENGINE_CONV"}
    if mode is not None:
        env["ENGINE_CONV"] = mode
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_engine_conv_sets_the_table_paths_and_a_wrong_value_is_one_line(monkeypatch):
    # the reading itself (conv_mode: the one place it is read) in this process, every value
    from kernels.errors import SettingError

    for mode, want in (("", "auto"), ("exact", "exact"), (" FAST ", "fast"), ("auto", "auto")):
        monkeypatch.setenv("ENGINE_CONV", mode)
        assert conv.conv_mode() == want
    monkeypatch.delenv("ENGINE_CONV")
    assert conv.conv_mode() == "auto"
    monkeypatch.setenv("ENGINE_CONV", "quick")
    with pytest.raises(SettingError, match="ENGINE_CONV='quick' is not one of auto, exact, fast"):
        conv.conv_mode()
    # what the import makes of it (a process each: the table is chosen once, at import): unset, and a value that
    # needs its spaces and case dropped; the wrong value's import is the engine info process below
    code = "from kernels.cpu import conv; print(conv.MODE, conv.EXPORTED == conv.paths_for(conv.MODE))"
    for mode, want in ((None, "auto"), (" FAST ", "fast")):
        done = _in_a_process(mode, code)
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == [want, "True"]
    # on the command line: one line, no traceback, a non-zero exit; engine info names the mode in use
    done = _in_a_process("quick", "import sys, cli; sys.argv = ['engine', 'info']; cli.main()")
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("Error: ENGINE_CONV='quick' is not one of")
    done = _in_a_process("exact", "import sys, cli; sys.argv = ['engine', 'info']; cli.main()")
    assert done.returncode == 0 and "exact (float32-GEMM-level in every direction" in done.stdout


@pytest.mark.parametrize("mode", ["auto", "exact"])
def test_float32_paths_give_the_same_bits_every_call(mode):
    paths = conv.paths_for(mode)
    for c, k, plane, stride in (LAYERS[1], LAYERS[3]):
        x, w, dout = _case(c, k, plane, stride, batch=2)
        for direction in ("forward", "data", "weight"):
            first = _run(direction, x, w, dout, stride, paths)
            assert np.array_equal(first, _run(direction, x, w, dout, stride, paths))


def test_the_large_plane_rule_matches_reference():
    # v41 (conv.WINOGRAD_LARGE_MAX_PIXELS): planes above 32×32 up to 56×56 take F(2×2) forward and backward-data and
    # F(4×4) weight gradient; fast's backward-data F(4×4) too. The kernels are blocked by tile rows: any plane is theirs
    x, w, dout = _case(64, 64, 40, 1)
    if conv.path(x.shape, w.shape, 1, 1, 1, "weight") != "winograd4":
        pytest.skip("F(4×4) is OpenBLAS's only")
    fast = conv.paths_for("fast")
    assert conv.path(x.shape, w.shape, 1, 1, 1, "forward") == "winograd"
    assert conv.path(x.shape, w.shape, 1, 1, 1, "data") == "winograd"
    assert conv.path(x.shape, w.shape, 1, 1, 1, "data", fast) == "winograd4"
    assert conv.path(x.shape, w.shape, 1, 1, 1, "data", conv.Paths(winograd_large_planes=False)) == "shifted"
    for paths in (conv.EXPORTED, fast):
        for direction in ("forward", "data", "weight"):
            ours, gemm = _errors(direction, x, w, dout, 1, paths)
            level = GEMM_LEVEL if conv.path(x.shape, w.shape, 1, 1, 1, direction, paths) == "winograd" else 20
            assert ours <= level * gemm, (direction, ours, gemm)


def test_use_paths_is_what_the_table_runs():
    # benchmarks compare mixes of paths in one process (conv_precision --gradients, bench_train --conv-paths)
    x, w, dout = _case(128, 128, 16, 1)
    exact, before = conv.paths_for("exact"), conv.EXPORTED
    if conv.path(x.shape, w.shape, 1, 1, 1, "data", before) not in WINOGRAD4:
        pytest.skip("F(4×4) is OpenBLAS's only, or ENGINE_CONV=exact")
    try:
        conv.use_paths(exact)
        size = conv.conv2d_backward_data_workspace_size(x.shape, w.shape, 1, 1, 1)
        assert size == conv.workspace_size(x.shape, w.shape, 1, 1, 1, "data", exact)
        dx = np.empty(x.shape, np.float32)
        conv.conv2d_backward_data(dout, w, dx, 1, 1, 1, np.empty(size, np.float32))
    finally:
        conv.use_paths(before)
    assert np.array_equal(dx, _run("data", x, w, dout, 1, exact))
    assert not np.array_equal(dx, _run("data", x, w, dout, 1, before))  # F(4×4)'s bits differ: the table moved


def _benchmark():
    return load_script("conv_precision")


def test_the_benchmark_mixes_route_as_named():
    bench = _benchmark()
    auto = conv.paths_for("auto")
    weight4, data4 = bench.mix_paths("weight4"), bench.mix_paths("data4")
    kept = {"weight4": 0, "data4": 0}
    for x_shape, w_shape, stride in _resnet_shapes():
        kinds = {d: {name: conv.path(x_shape, w_shape, stride, 1, 1, d, p)
                     for name, p in (("auto", auto), ("weight4", weight4), ("data4", data4))}
                 for d in ("forward", "data", "weight")}
        assert kinds["forward"]["weight4"] == kinds["forward"]["data4"] == kinds["forward"]["auto"]
        assert kinds["data"]["weight4"] not in WINOGRAD4 and kinds["data"]["data4"] == kinds["data"]["auto"]
        assert kinds["weight"]["data4"] not in WINOGRAD4 and kinds["weight"]["weight4"] == kinds["weight"]["auto"]
        kept["weight4"] += kinds["weight"]["weight4"] in WINOGRAD4
        kept["data4"] += kinds["data"]["data4"] in WINOGRAD4
    if conv.path((32, 128, 16, 16), (128, 128, 3, 3), 1, 1, 1, "data", auto) in WINOGRAD4:  # OpenBLAS
        assert kept["weight4"] >= 5 and kept["data4"] >= 5
    assert bench.mix_paths("weight4:winograd4_weight=0") == dataclasses.replace(weight4, winograd4_weight=False)
    assert bench.mix_paths("exact") == conv.paths_for("exact")
    for wrong in ("weight5", "auto:no_such_flag=0"):
        with pytest.raises(SystemExit, match="is no|is not a conv.Paths flag|none of"):
            bench.mix_paths(wrong)


@pytest.mark.parametrize("image_size", [32, 224])
def test_the_gradient_benchmark_finds_every_relu_of_its_twin(image_size):
    # conv_precision --gradients gives the PyTorch twin the engine's ReLU outputs by module name; at 224 the chunked
    # layers once held the stem's and layer1's ReLUs inside them and the benchmark stopped at a KeyError
    import torch  # noqa: F401  the twin's modules

    from models import build_model

    bench = _benchmark()
    twin = bench.resnet_twin("imagenet" if image_size > 64 else "cifar")  # puts tests/models on the path
    from torch_models import ReLU

    from engine.backend import get_backend

    net = bench.engine_network(get_backend("cpu"), image_size)  # what gradient_errors runs
    relus = {node.name for node in net.graph.nodes if type(node.layer).__name__ == "ReLU"}
    assert relus == {name for name, module in twin.named_modules() if isinstance(module, ReLU)}
    chunked = build_model("resnet18", num_classes=10, backend="cpu", seed=0, image_size=image_size)
    assert ({node.name for node in chunked.graph.nodes if type(node.layer).__name__ == "ReLU"} < relus) == (
        image_size == 224)
    net.close()
    chunked.close()


def test_the_twin_max_pool_takes_the_engines_winners():
    # at 224 the stem's max pool decides a winner per window as a ReLU decides a side: the gradient benchmark gives
    # the float64 twin the engine's winners (window places r·3 + s, kernels/cpu/pool.py), else a tie within float32
    # rounding sends the stem's gradient elsewhere (one seed read 174× PyTorch's error for two such windows)
    import torch

    from kernels.cpu import TABLE

    bench = _benchmark()
    bench.resnet_twin("cifar")  # puts tests/models on the path
    from torch_models import MaxPool

    x = np.random.default_rng(0).standard_normal((2, 3, 9, 10)).astype(np.float32)
    out, argmax = np.empty((2, 3, 5, 5), np.float32), np.empty((2, 3, 5, 5), np.uint8)
    TABLE["maxpool2d_forward"](x, out, argmax, 3, 2, 1)
    pool = MaxPool(3, 2, 1)
    xt = torch.from_numpy(x).double().requires_grad_()
    assert np.array_equal(pool.winners(xt.detach()).numpy(), argmax)  # the engine's places are the twin's encoding
    pool.decided = torch.from_numpy(argmax.astype(np.int64))
    assert np.array_equal(pool(xt).detach().numpy(), out.astype(np.float64))
    moved = argmax.copy()
    moved[0, 0, 2, 2] = (moved[0, 0, 2, 2] + 1) % 9  # another place of an inner window: its gradient goes there
    pool.decided = torch.from_numpy(moved.astype(np.int64))
    pool(xt).sum().backward()
    expected = np.zeros(x.shape)  # each window's gradient (1) on the input its decided place names
    for (n, c, oh, ow), place in np.ndenumerate(moved):
        r, s = divmod(int(place), 3)
        expected[n, c, 2 * oh - 1 + r, 2 * ow - 1 + s] += 1
    assert np.array_equal(xt.grad.numpy(), expected)


def _points_benchmark():
    return load_script("winograd_points")


@pytest.mark.parametrize("tile", [2, 3, 4])
def test_the_winograd_points_simulation_builds_right_matrices_and_ranks_the_tiles(tile):
    # kernels/README.md's "other interpolation points" and "a smaller tile" figures come from this script: every
    # point set's exact matrices compute the correlation, and F(2×2) rounds less than any point set of F(4×4)
    points = _points_benchmark()
    for name, finite in points.POINT_SETS[tile].items():
        at, g, bt = points.matrices(finite)
        assert at.shape == (tile, tile + 2), name
        assert points.check(at, g, bt) < 1e-12, name
    ratio = {m: (lambda e: e[0] / e[1])(points.errors(*points.matrices(next(iter(points.POINT_SETS[m].values()))),
                                                       channels=16, tiles=200)) for m in (2, tile)}
    assert ratio[2] <= ratio[tile]
    if tile == 4:
        assert ratio[4] > 2.0 > ratio[2]  # Lavin's F(4×4) past float32's level, F(2×2) at it

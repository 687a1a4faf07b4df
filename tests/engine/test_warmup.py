"""The first-run warm-up: the jobs cover what training compiles, the cache marker, the progress line."""

import importlib
import io
import os
import pkgutil

import pytest
from numba.core import config
from numba.core.registry import CPUDispatcher as Dispatcher

from engine import warmup
from engine.backend import get_backend
from engine.data.datasets import synthetic
from engine.info import collect_info
from engine.optim import make_optimizer
from engine.train import Trainer
from models import build_network


def _signatures() -> dict[str, int]:
    """Signatures each Numba kernel of kernels/cpu holds in this process (compiled or loaded from the
    cache: a cache load fires no compile event, so the dispatchers themselves are asked)."""
    import kernels.cpu as package

    counts = {}
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"kernels.cpu.{info.name}")
        for name, value in vars(module).items():
            if isinstance(value, Dispatcher):
                counts[f"{info.name}.{name}"] = len(value.signatures)
    return counts


@pytest.mark.parametrize(("model", "optimizer"), [("resnet18", "sgd"), ("mobilenetv2", "adam"), ("cnn", "sgd")])
def test_a_training_step_after_the_models_jobs_compiles_nothing(model, optimizer):
    # the jobs' tiny calls must ask for exactly the kernels and signatures a step (and its
    # evaluation) asks for: anything they miss is compiled in the training process, the cost the
    # warm-up exists to move out of it
    backend = get_backend("cpu")
    data = synthetic(num_classes=10, seed=0, train=4, test=2)
    net = build_network(model, data, backend, seed=0)
    jobs = warmup.model_jobs(net.graph, optimizer)
    for job in jobs:
        warmup.run_job(job)
    opt = make_optimizer(optimizer, net, backend, 0.01, manager=net.mgr)
    trainer = Trainer(net, opt, data, batch_size=2, steps=1, evaluate_at_end=True)
    before = _signatures()
    trainer.fit()
    after = _signatures()
    assert {name: count for name, count in after.items() if count != before.get(name, 0)} == {}


@pytest.mark.parametrize("recompute", [False, True])
def test_a_chunked_step_after_the_models_jobs_compiles_nothing(recompute):
    # the cnn at 224 runs ChunkedConvBN layers (with a pool): keep mode writes y over the conv's output and recompute
    # mode dx over y, kernels of their own (warmup.WRITTEN_OVER) that the chunk jobs must compile too
    backend = get_backend("cpu")
    data = synthetic(num_classes=10, seed=0, train=4, test=2, shape=(3, 224, 224))
    net = build_network("cnn", data, backend, seed=0)
    assert len(net.chunked) == 2
    net.set_recomputed([node.name for node in net.chunked] if recompute else [])
    for job in warmup.model_jobs(net.graph, "sgd"):
        warmup.run_job(job)
    opt = make_optimizer("sgd", net, backend, 0.01, manager=net.mgr)
    trainer = Trainer(net, opt, data, batch_size=2, steps=1, evaluate_at_end=True)
    before = _signatures()
    trainer.fit()
    after = _signatures()
    assert {name: count for name, count in after.items() if count != before.get(name, 0)} == {}
    net.close()


def test_a_training_step_with_offload_after_the_models_jobs_compiles_nothing(tmp_path):
    # offload's ReLU forward and rebuild run fused twins of the ReLU kernels (they also sum their
    # input, engine.offload.scheduler._FusedCheck): the ReLU jobs compile those too
    from engine.offload import OffloadScheduler

    backend = get_backend("cpu")
    data = synthetic(num_classes=10, seed=0, train=4, test=2)
    net = build_network("mobilenetv2", data, backend, seed=0)
    for job in warmup.model_jobs(net.graph, "sgd"):
        warmup.run_job(job)
    opt = make_optimizer("sgd", net, backend, 0.01, manager=net.mgr)
    with OffloadScheduler(backend, 1, directory=str(tmp_path)).attach(net) as scheduler:
        trainer = Trainer(net, opt, data, batch_size=2, steps=1)
        before = _signatures()
        trainer.fit()
        after = _signatures()
        assert scheduler.stats[-1].executor_checked_bytes > 0  # the fused kernels ran
    assert {name: count for name, count in after.items() if count != before.get(name, 0)} == {}


def test_paths_that_run_backward_data_on_the_forward_kernel_share_its_job():
    # conv.FLIPPED_FORWARD dispatches backward-data to the forward kernel flipped: the warm-up must compile both
    # calls in one job (SHARED_FORWARD_KERNEL), or two workers compile the same kernel at once
    from kernels.cpu import conv as cpu_conv

    assert set(cpu_conv.FLIPPED_FORWARD) <= set(warmup.SHARED_FORWARD_KERNEL)


def test_model_jobs_hold_one_conv_job_per_path_and_direction():
    data = synthetic(num_classes=10, seed=0, train=4, test=2)
    net = build_network("resnet18", data, get_backend("cpu"), seed=0)
    jobs = warmup.model_jobs(net.graph, "sgd")
    keys = [job.key for job in jobs]
    assert len(keys) == len(set(keys))
    conv = {job.key for job in jobs if job.conv is not None}
    # ResNet-18: 3×3 stride 1 with ≥ 64 channels takes Winograd (forward, backward-data, and the weight
    # gradient on planes ≤ 16×16), the 64-channel 32×32 weight gradient the shifted GEMMs, the rest im2col
    gemm = {f"{op}/gemm/bias=False/v=None" for op in warmup.CONV_OPS.values()}
    # backward-data on the Winograd and shifted paths runs the forward kernel: no job of its own
    shifted = {f"conv2d_{d}/shifted/bias=False/v=None" for d in ("forward", "backward_weight")}
    # v23: forward and backward-data on 4×4 planes (512 channels) split by Winograd position
    winograd = {"conv2d_forward/winograd-by-xi/bias=False/v=None", "conv2d_backward_weight/winograd/bias=False/v=None"}
    # with OpenBLAS, the 64- to 256-channel layers on 16×16 and 32×32 take F(4×4) in every direction,
    # and the stem is on im2col (v17): nothing is left on the shifted GEMMs, whose job a cold start
    # then does not compile
    from kernels.cpu import blas
    from kernels.cpu.conv import conv_mode

    winograd4 = set()
    if blas.select_sgemm() == blas.OPENBLAS:
        winograd4 = {f"conv2d_{d}/winograd4/bias=False/v=None" for d in ("forward", "backward_weight")}
        shifted = set()
        # v28: the three 3×3 stride-2 forwards take the polyphase Winograd (the stem and the 1×1 stride-2
        # forwards keep the im2col job)
        winograd4.add("conv2d_forward/winograd-s2/bias=False/v=None")
        # v34: forward and backward-data on 4×4 and 8×8 planes by output channel in F(4×4) (no by-ξ job)
        winograd4.add("conv2d_forward/winograd4-by-k/bias=False/v=None")
        winograd.discard("conv2d_forward/winograd-by-xi/bias=False/v=None")
        # v35: so does the weight gradient (512 @4×4 took F(2×2), the only "winograd" job left)
        winograd4.add("conv2d_backward_weight/winograd4-weight-by-k/bias=False/v=None")
        winograd.discard("conv2d_backward_weight/winograd/bias=False/v=None")
        # v32: their backward-data, and the weight gradient of 64->128 and 128->256 (v37: 256->512 @8x8 too)
        winograd4 |= {f"conv2d_{d}/winograd-s2/bias=False/v=None" for d in ("backward_data", "backward_weight")}
        # ... so with the shortcuts on their kept pixels (v33) and the stem on its own path (v36) nothing is
        # left on im2col: the stem's backward-data is never called (the network's input has no gradient)
        gemm = set()
        # v38 (ENGINE_CONV=auto): the forwards F(4×4) took run F(2×2) (4×4 planes too, in tiles), backward-data
        # keeps F(4×4): its flipped forward kernel is a job of its own now
        if conv_mode() == "auto":
            winograd4 -= {"conv2d_forward/winograd4/bias=False/v=None",
                          "conv2d_forward/winograd4-by-k/bias=False/v=None"}
            winograd4 |= {"conv2d_backward_data/winograd4/bias=False/v=None",
                          "conv2d_backward_data/winograd4-by-k/bias=False/v=None"}
            # v43: the 512-channel 4×4 forward by ξ (its job compiles only what the tiles' job does not: one family)
            winograd = {"conv2d_forward/winograd/bias=False/v=None", "conv2d_forward/winograd-by-xi/bias=False/v=None"}
    # v36: the stem's forward and weight gradient on conv_stem (whatever the sgemm)
    stem = {f"conv2d_{d}/stem/bias=False/v=None" for d in ("forward", "backward_weight")}
    # v33: the 1×1 stride-2 shortcuts on their kept pixels; backward-data shares the forward's job
    strided = {f"conv2d_{d}/pointwise-strided/bias=False/v=None" for d in ("forward", "backward_weight")}
    assert conv == gemm | shifted | winograd | winograd4 | strided | stem
    assert "sgd_update" in keys and "adam_update" not in keys and "relu6_forward" not in keys


def test_progress_line_piped_prints_the_first_and_last_count_only():
    out = io.StringIO()
    line = warmup.ProgressLine(out)
    for done in range(4):
        line(done, 3)
    assert out.getvalue() == "compiling kernels, first run only: 0/3\ncompiling kernels, first run only: 3/3\n"


def test_progress_line_on_a_terminal_rewrites_one_line():
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    out = Terminal()
    line = warmup.ProgressLine(out)
    for done in range(3):
        line(done, 2)
    prefix = "\rcompiling kernels, first run only: "
    assert out.getvalue() == f"{prefix}0/2{prefix}1/2{prefix}2/2\n"


def test_workers_fill_the_cache_and_leave_a_marker(tmp_path, monkeypatch):
    # a fresh cache directory: the worker processes compile into it (they inherit the variable)
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(config, "CACHE_DIR", str(tmp_path))
    jobs = [warmup.Job("sgd_update")]  # a quick compile: 0.7 s of CPU (relu_forward 1.4 s)
    assert not warmup.is_warm(jobs) and warmup.warm_labels() == []
    assert collect_info()["kernel_cache"] == {"dir": str(tmp_path), "warm": False, "warm_for": []}

    failing = warmup.ensure_compiled([*jobs, warmup.Job("no_such_kernel")], "broken", workers=1)
    assert failing is not None and len(failing.failed) == 1 and "no_such_kernel" in failing.failed[0]
    assert not warmup.is_warm(jobs)  # no marker after a failure

    result = warmup.ensure_compiled(jobs, "tiny", workers=1)
    assert result is not None and result.jobs == 1 and result.failed == []
    assert any(p.name.endswith(".nbi") for p in tmp_path.rglob("*"))  # Numba's index, written by the worker
    assert warmup.is_warm(jobs) and warmup.warm_labels() == ["tiny"]
    assert collect_info()["kernel_cache"] == {"dir": str(tmp_path), "warm": True, "warm_for": ["tiny"]}  # engine info
    assert warmup.ensure_compiled(jobs, "tiny") is None  # warm: no workers
    assert not warmup.is_warm([warmup.Job("relu6_forward")])  # a marker covers its own jobs only


def test_warmup_jobs_reach_every_conv_path_a_shape_can_take():
    """``engine kernels --warmup`` (``all_jobs``) compiles every conv path in every direction: each (direction, path)
    that ``conv.path`` returns on a grid of shapes (channels, planes, kernels, strides, depthwise or not, batch 2 and
    32) has a job, or shares the forward's (``SHARED_FORWARD_KERNEL``). v36 once took the im2col and shifted shapes
    of this list onto the stem path, and four paths had gone without a job."""
    import itertools

    from kernels.cpu import conv as cpu_conv

    reached = {}
    grid = itertools.product((2, 32), (3, 4, 5, 8, 64, 128, 512), (3, 4, 5, 8, 16, 24, 32, 64), (1, 3, 5), (1, 2))
    for n, c, h, r, stride in grid:
        for depthwise in (False, True) if r > 1 else (False,):
            for k in (c,) if depthwise else (c, 2 * c):
                x_shape, w_shape = (n, c, h, h), (k, 1 if depthwise else c, r, r)
                for direction in warmup.CONV_OPS:
                    kind = cpu_conv.path(x_shape, w_shape, stride, r // 2, c if depthwise else 1, direction)
                    reached.setdefault((direction, kind), (x_shape, w_shape, stride))
    ops = {op: direction for direction, op in warmup.CONV_OPS.items()}
    jobs = {(ops[job.op], job.path) for job in warmup.all_jobs(versions=False) if job.op in ops}
    shared = warmup.SHARED_FORWARD_KERNEL
    jobs |= {("data", kind) for direction, kind in jobs if direction == "forward" and kind in shared}
    assert {key: shape for key, shape in reached.items() if key not in jobs} == {}


def test_tiny_args_cover_every_non_conv_table_op():
    # engine kernels --warmup (all_jobs) and the fallback for unknown layer types use TINY_ARGS
    from kernels.cpu import TABLE

    table_ops = {op for op in TABLE if not op.startswith("conv2d") and not op.endswith("_workspace_size")}
    assert table_ops - set(warmup.TINY_ARGS) == set()
    assert all(ops and set(ops) <= table_ops for ops in warmup.LAYER_OPS.values() if ops)


_COLD_JOBS = """
import json, sys
from engine import warmup
from engine.backend import get_backend
from engine.data.datasets import synthetic
from models import build_network
data = synthetic(num_classes=10, seed=0, train=4, test=2)
for model, optimizer in (("resnet18", "sgd"), ("mobilenetv2", "adam"), ("cnn", "sgd")):
    for job in warmup.model_jobs(build_network(model, data, get_backend("cpu"), seed=0).graph, optimizer):
        warmup.run_job(job)
sys.path.insert(0, sys.argv[1])
from test_warmup import _signatures
print(json.dumps({name: count for name, count in _signatures().items() if count > 1}))
"""


def test_the_models_jobs_compile_one_signature_per_kernel_on_a_cold_cache(tmp_path):
    # A second signature is a second compile of the same code on every first run: a literal argument
    # from a jitted caller (Literal[int](0), not int64: 2 s for Winograd's input transform), an omitted
    # default, a prange index (int64 while Numba types the loop, uint64 in its gufunc: batch norm's
    # sum helpers). Only a cold cache shows it (a cached caller loads without compiling its callees),
    # and other tests compile study versions with other layouts, so the jobs run in a fresh process
    # with an empty cache.
    import json
    import subprocess
    import sys
    from pathlib import Path

    # NUMBA_OPT=0: LLVM's optimisation level does not touch Numba's typing, which makes the signatures, and halves
    # the compile (47 -> 25 s of CPU); checked by passing a literal 0 to batchnorm._channel_sum from its caller:
    # {"batchnorm._channel_sum": 2} at level 0 as at 3
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path), "NUMBA_OPT": "0"}
    here = str(Path(__file__).resolve().parent)
    out = subprocess.run([sys.executable, "-c", _COLD_JOBS, here], env=env, capture_output=True, text=True,
                         timeout=600, cwd=str(Path(here).parent.parent))
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {}


def test_jitted_callers_pass_no_literal_numbers_to_compiled_kernels():
    # A number literal from a jitted caller types as Literal[int](0), not int64: Numba compiles the
    # callee a second time for it (Winograd's input transform: +2 s of the first run, depthwise's
    # flat filter and upsample likewise). The check above sees it only on a cold cache, when the
    # caller is compiled rather than loaded; this one reads the sources. Inlined callees compile into
    # their caller and are exempt.
    import ast

    import kernels.cpu as package

    found = []
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"kernels.cpu.{info.name}")
        kernels = {n: v for n, v in vars(module).items() if isinstance(v, Dispatcher)}
        compiled = {n for n, v in kernels.items() if v.targetoptions.get("inline", "never") != "always"}
        with open(module.__file__, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for fn in ast.walk(tree):
            if not (isinstance(fn, ast.FunctionDef) and fn.name in kernels):
                continue
            for call in ast.walk(fn):
                if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in compiled:
                    for arg in call.args:
                        value = arg.operand if isinstance(arg, ast.UnaryOp) else arg
                        if isinstance(value, ast.Constant) and isinstance(value.value, (int, float)):
                            found.append(f"{info.name}.{fn.name} line {call.lineno}: {call.func.id}({value.value})")
    assert found == []



def test_early_workers_fill_the_cache_and_only_for_a_cold_one(tmp_path, monkeypatch):
    # engine train starts the warm-up's workers at its top (start_workers), so their imports and
    # Numba's set-up overlap its own; they must then do the warm-up's work, and not start at all
    # where a marker says the cache is warm
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(config, "CACHE_DIR", str(tmp_path))
    jobs = [warmup.Job("sgd_update")]
    pool = warmup.start_workers("tiny")
    assert pool is not None
    pids = {pool.submit(os.getpid).result() for _ in range(4)}
    assert os.getpid() not in pids and 1 <= len(pids) <= len(os.sched_getaffinity(0))
    result = warmup.ensure_compiled(jobs, "tiny", pool=pool)
    assert result is not None and result.failed == [] and warmup.is_warm(jobs)
    with pytest.raises(RuntimeError):  # handed over: shut down after its jobs
        pool.submit(os.getpid)
    assert warmup.start_workers("tiny") is None  # a marker for the label: nothing started


def test_a_pool_handed_over_for_a_warm_cache_is_shut_down(tmp_path, monkeypatch):
    # warm already: the early workers are not used, and not left running
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(config, "CACHE_DIR", str(tmp_path))
    jobs = [warmup.Job("sgd_update")]
    assert warmup.ensure_compiled(jobs, "tiny", workers=1) is not None

    class Pool:
        closed = False

        def shutdown(self, wait: bool = True) -> None:
            Pool.closed = True

    assert warmup.ensure_compiled(jobs, "tiny", pool=Pool()) is None and Pool.closed


def test_early_workers_started_for_a_cache_warm_under_another_label_leave_a_marker(tmp_path, monkeypatch):
    # the early start goes by the label's marker; where the jobs turn out warm under another label
    # (another model with the same kernels), the label gets its marker, so the next run starts none
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(config, "CACHE_DIR", str(tmp_path))
    data = synthetic(num_classes=10, seed=0, train=4, test=2)
    graph = build_network("mlp", data, get_backend("cpu"), seed=0).graph  # the smallest job list: no conv
    assert warmup.ensure_compiled(warmup.model_jobs(graph, "sgd"), "first", workers=1) is not None
    pool = warmup.start_workers("second")
    assert pool is not None
    assert warmup.warm_for_training(graph, "sgd", "second", stream=io.StringIO(), pool=pool) is None
    assert sorted(warmup.warm_labels()) == ["first", "second"]
    assert warmup.start_workers("second") is None


def test_a_conv_on_the_network_input_gets_no_backward_data_job():
    """The input has no gradient, so the stem's backward-data is never called: no job compiles it
    (MobileNetV2's stem was the only conv on im2col's backward-data, 2.3 s of cold CPU)."""
    stem = ((2, 3, 32, 32), (32, 3, 3, 3), 1, 1, 1, False)
    ops = {job.op for job in warmup.conv_jobs([(*stem, False)])}
    assert ops == {"conv2d_forward", "conv2d_backward_weight"}
    assert "conv2d_backward_data" in {job.op for job in warmup.conv_jobs([stem])}  # unknown: compiled
    assert "conv2d_backward_data" in {job.op for job in warmup.conv_jobs([(*stem, True)])}


@pytest.mark.parametrize("model", ["resnet18", "mobilenetv2"])
def test_the_224_warm_up_compiles_what_the_layers_route_to(model):
    # issue 32: the ImageNet first run (engine train --variant imagenet --image-size 224) compiles what its layers
    # run at a training batch, nothing else. v39 and v40 had taken every 224 layer off im2col; v42 put back the
    # directions where im2col measured faster (conv.STEM_STRIDED_MIN_KERNEL): forward and weight gradient only, never
    # backward-data
    from engine.graph import GRAPH_INPUT
    from engine.layers.chunked import CHUNK_IMAGES
    from kernels.cpu import conv as cpu_conv
    from models import build_model

    net = build_model(model, num_classes=10, backend=get_backend("cpu"), seed=0, variant="imagenet", image_size=224)
    shapes = net.graph.shapes(32)
    routed = set()
    for node in net.graph.nodes:
        # a chunked layer's conv (engine/layers/chunked.py) runs on chunks of CHUNK_IMAGES images
        layer = getattr(node.layer, "conv", node.layer)
        if type(layer).__name__ != "Conv2d":
            continue
        r = layer.kernel_size
        w_shape = (layer.out_channels, layer.in_channels // layer.groups, r, r)
        x_shape = tuple(shapes[node.inputs[0]])
        if layer is not node.layer:
            x_shape = (CHUNK_IMAGES, *x_shape[1:])
        for direction in warmup.CONV_OPS:
            if direction == "data" and node.inputs[0] == GRAPH_INPUT:
                continue  # the network's input has no gradient
            kind = cpu_conv.path(x_shape, w_shape, layer.stride, layer.padding, layer.groups, direction)
            routed.add((kind, direction))
    direction_of = {op: direction for direction, op in warmup.CONV_OPS.items()}
    jobs = [job for job in warmup.model_jobs(net.graph, "sgd") if job.conv is not None]
    compiled = {(job.path, direction_of[job.op]) for job in jobs}
    shared = {(job.path, "data") for job in jobs
              if job.op == "conv2d_forward" and job.path in warmup.SHARED_FORWARD_KERNEL}
    assert compiled <= routed  # no job for a path no layer takes
    assert routed <= compiled | shared  # every path a layer takes has its job
    assert {(kind, d) for kind, d in routed if kind == "gemm"} <= {("gemm", "forward"), ("gemm", "weight")}, routed
    net.close()


def test_jobs_that_share_compiled_pieces_run_in_one_family_largest_first():
    # the F(4×4) paths share their transforms, the polyphase ones theirs: each family is one worker's task, so two
    # workers never compile the same transform at once; table ops are families of their own
    data = synthetic(num_classes=10, seed=0, train=4, test=2)
    jobs = warmup.model_jobs(build_network("resnet18", data, get_backend("cpu"), seed=0).graph, "sgd")
    groups = warmup.families(jobs)
    assert sorted(job.key for group in groups for job in group) == sorted(job.key for job in jobs)  # each job once
    assert [len(g) for g in groups] == sorted((len(g) for g in groups), reverse=True)
    by_family = {warmup.family(group[0]): group for group in groups}
    assert all(warmup.family(job) == warmup.family(group[0]) for group in groups for job in group)
    assert {job.path for job in by_family["winograd4"]} >= {"winograd4", "winograd4-by-k"}
    assert {job.path for job in by_family["winograd-s2"]} == {"winograd-s2"} and len(by_family["winograd-s2"]) == 3
    assert warmup.family(warmup.Job("relu_forward")) == "relu_forward"
    # but the two dropout ops are one compiled kernel (warmup.OP_FAMILIES)
    assert warmup.family(warmup.Job("dropout_forward")) == warmup.family(warmup.Job("dropout_backward"))
    assert warmup.run_jobs([warmup.Job("sgd_update"), warmup.Job("no_such_kernel"), warmup.Job("add_forward")]) == [
        "no_such_kernel: KeyError: 'no_such_kernel'"]  # a failure does not stop the family


def test_the_warm_up_starts_the_workers_a_memory_limit_leaves_room_for(monkeypatch):
    # issue 30: the workers run in the training process's cgroup; under 510 MiB two of them got OOM-killed beside
    # ResNet-18 at 224 on a cold cache. One worker per core where the limit allows, at least one
    monkeypatch.setattr(warmup, "_cores", lambda: 2)
    mib = 1 << 20
    assert warmup.workers_that_fit(510 * mib) == warmup.workers_that_fit(610 * mib) == 1
    assert warmup.workers_that_fit(300 * mib) == 1
    assert warmup.workers_that_fit(warmup.TRAINING_SETUP_BYTES + 2 * warmup.WORKER_BYTES) == 2
    assert warmup.workers_that_fit(64 << 30) == 2
    monkeypatch.setattr(warmup, "_cores", lambda: 1)  # one core under a limit with room for none: tight all the same
    assert warmup.workers_that_fit(300 * mib) == 1 and warmup._room_for_workers(300 * mib) < 1
    monkeypatch.setattr(warmup, "_cores", lambda: 8)
    assert warmup.workers_that_fit(1 << 30) == (1024 - 288) // 224


@pytest.mark.parametrize(("fit", "wait"), [(1, True), (2, False), (0, True)])
def test_under_a_tight_limit_the_workers_are_gone_before_training(monkeypatch, fit, wait):
    # a worker still exiting held its memory while the first step planned for all of it (OOM kills under 510 MiB);
    # without a tight limit its exit runs beside training
    monkeypatch.setattr(warmup, "_cores", lambda: 2)
    monkeypatch.setattr(warmup, "_room_for_workers", lambda limit_bytes=None: fit)

    class Pool:
        waited = None

        def shutdown(self, wait):
            Pool.waited = wait

    monkeypatch.setattr(warmup, "is_warm", lambda jobs: True)
    assert warmup.ensure_compiled([warmup.Job("sgd_update")], "tiny", pool=Pool()) is None
    assert Pool.waited is wait


@pytest.mark.parametrize(("weight", "x_shape", "w_shape"), [
    (True, (32, 256, 14, 14), (512, 256, 3, 3)),  # ResNet-18's 256→512 stride-2 weight gradient at 224, batch 32
    (False, (32, 8, 16, 16), (16, 8, 3, 3)),  # an im2col forward whose tiles hold several images
], ids=["weight", "forward"])
def test_im2col_jobs_compile_the_tile_copies_of_the_real_calls(weight, x_shape, w_shape, monkeypatch):
    # im2col's tiles of several images gather dout (weight gradient) or scatter the result (forward); the job's
    # two-image shape makes one-image tiles, so the job compiles the copy itself, with the types the real call passes
    import numpy as np
    from numba import typeof

    from kernels.cpu import conv as cpu_conv

    name = "gather_tile" if weight else "scatter_tile"
    original, seen = getattr(cpu_conv, name), []

    def recorded(*args):
        seen.append(tuple(typeof(a) for a in args))
        return original(*args)

    monkeypatch.setattr(cpu_conv, name, recorded)
    direction = "weight" if weight else "forward"
    assert cpu_conv.path(x_shape, w_shape, 2, 1, 1, direction) == "gemm"
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal(x_shape, dtype=np.float32), rng.standard_normal(w_shape, dtype=np.float32)
    out = rng.standard_normal((x_shape[0], w_shape[0], (x_shape[2] + 1) // 2, (x_shape[3] + 1) // 2), np.float32)
    op = "conv2d_backward_weight" if weight else "conv2d_forward"
    scratch = np.empty(getattr(cpu_conv, f"{op}_workspace_size")(x_shape, w_shape, 2, 1, 1), np.float32)
    if weight:
        cpu_conv.conv2d_backward_weight(x, out, np.empty_like(w), None, 2, 1, 1, scratch)
    else:
        cpu_conv.conv2d_forward(x, w, None, out, 2, 1, 1, scratch)
    real = set(seen)
    assert real, f"the real call made no {name}: the shape no longer tests the tiles"
    seen.clear()
    warmup._im2col_tile_copies(weight)
    assert set(seen) == real

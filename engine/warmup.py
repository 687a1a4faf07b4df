"""The first run: compile the kernels a model uses, in parallel worker processes, before training.

Why. Numba compiles each kernel on its first call and keeps the machine code in its on-disk cache
(``cache=True``). A newcomer's first ``engine train --model resnet18 --offload-n 4`` used to spend
its first step compiling, one kernel after another, with nothing on screen: 21 kernels, 37 s of
compile CPU time measured with an empty ``NUMBA_CACHE_DIR`` (31 s of it the five conv drivers,
mostly Numba's parfor passes, since replaced by Python threads: ``kernels/cpu/threads.py``).

What happens now. ``model_jobs`` reads the network's graph and lists one tiny call per kernel
the model will run: one conv job per (path, direction, bias) that its convolutions take (the same
shapes' path choice as training, at batch 2), and the table ops of its layer types, its loss and
its optimizer. ``ensure_compiled`` runs those calls in worker processes (one per core), a family of jobs that share
compiled pieces per task (``families``), which write Numba's on-disk cache; the training process then loads every
kernel from the cache. A progress
line says what is happening ("compiling kernels, first run only: 12/31"). When it is done it leaves
a marker in the cache directory, keyed by the kernels' sources and versions, so later runs skip
the workers entirely; ``engine info`` reads the markers to say whether the cache is warm.

Where the first run's time goes (ResNet-18, ``engine train --model resnet18 --offload-n 4``, empty
``NUMBA_CACHE_DIR``, two cores): cold − warm wall is the pool's wall, and the pool is CPU-bound on both
workers (24 s of job CPU, the last jobs ending 0.3 s apart), so only less compile work shortens it.
Batch norm's three kernels, SGD, the global pools and the dense bias compiled as ``prange`` kernels
in 6.7 s of job CPU (one process, serially); as serial kernels over ``threads.run_ranges`` 2.5 s
(the element-wise kernels followed once each had a loop for its in-place call: ``kernels/cpu/elementwise.py``). The
pool is not waited for at the end (``ensure_compiled``). Cold − warm, b6105db / after, alternating
in one sitting: 13.57, 13.44 / 11.76, 12.76 s. Since the kernels' block loops are Python loops over compiled
pieces and the jobs run in families (2026-11-28), 9.39–10.93 s against 14.43–15.07 s in four sittings
(kernels/README.md, "The first run, 2026-11-28"). Tried and dropped: the im2col weight-gradient driver
without the branches ResNet-18 never takes (v16's 1×1 in place, the 1×1 gather): 2.65 → 2.3 s of
compile CPU, too little for a second driver to keep in step with the first.

Each job calls the kernel table's own entry with arrays of the dtypes, ranks and layouts training
passes, so the cached signature is the one training asks for (tests/engine/test_warmup.py checks
that a training step after the warm-up compiles nothing).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any

import numpy as np

BATCH = 2
"""Images per warm-up call: the path a conv takes does not depend on the batch size."""

MARKER_PREFIX = "engine-warm-"


@dataclass(frozen=True)
class Job:
    """One kernel call that compiles (or loads) what a model needs: picklable, run in a worker."""

    op: str  # a kernel-table name
    conv: tuple | None = None  # (x_shape, w_shape, stride, pad, groups, bias) for conv ops
    version: int | None = None  # a conv_study version instead of the table's entry
    path: str | None = None  # the conv path the call takes (conv.path)

    @property
    def key(self) -> str:
        """What the job compiles: the op, and for conv its path, bias and version (not its shape)."""
        if self.conv is None:
            return self.op
        return f"{self.op}/{self.path}/bias={self.conv[5]}/v={self.version}"

    @property
    def label(self) -> str:
        if self.conv is None:
            return self.op
        x_shape, w_shape, stride, pad, groups, _ = self.conv
        suffix = f" v{self.version}" if self.version else ""
        shape = f"{w_shape[1] * groups}->{w_shape[0]} {w_shape[2]}x{w_shape[3]} s{stride} @{x_shape[2]}"
        return f"{self.op} {shape}{suffix}"


# ----------------------------------------------------------------------------------------------
# Which jobs a model needs
# ----------------------------------------------------------------------------------------------

LAYER_OPS: dict[str, tuple[str, ...]] = {
    "BatchNorm2d": ("batchnorm_forward_train", "batchnorm_backward_from_output", "batchnorm_forward_infer"),
    "ReLU": ("relu_forward", "relu_backward"),
    "ReLU6": ("relu6_forward", "relu6_backward"),
    "LeakyReLU": ("leaky_relu_forward", "leaky_relu_backward"),
    "Add": ("add_forward",),
    "Dense": ("dense_forward", "dense_backward"),
    "Dropout": ("dropout_forward", "dropout_backward"),
    "MaxPool2d": ("maxpool2d_forward", "maxpool2d_backward"),
    "AvgPool2d": ("avgpool2d_forward", "avgpool2d_backward"),
    "GlobalAvgPool": ("global_avgpool_forward", "global_avgpool_backward"),
    "Flatten": (),
    # its conv, activation and pool are listed as theirs (model_jobs walks a layer's parts)
    "ChunkedConvBN": ("batchnorm_chunk_statistics", "batchnorm_chunk_finish", "batchnorm_chunk_apply",
                      "batchnorm_chunk_gradient_sums", "batchnorm_chunk_dx", "batchnorm_forward_infer"),
    "ChunkedPair": ("batchnorm_chunk_statistics", "batchnorm_chunk_finish", "batchnorm_chunk_apply",
                    "batchnorm_chunk_gradient_sums", "batchnorm_chunk_dx", "batchnorm_forward_infer"),
}
"""Table ops each layer type calls (conv is listed per shape by ``conv_jobs``). A layer type not
listed here makes ``model_jobs`` warm every non-conv op: slower, never wrong."""

WITH_CHECKSUM = {"relu_forward": "relu_forward_checksum", "relu6_forward": "relu6_forward_checksum"}
"""Table ops whose fused twin (the same bits plus a checksum of the input) offload calls."""

WRITTEN_OVER = ("batchnorm_chunk_apply", "batchnorm_chunk_dx")
"""Table ops that run a kernel of their own when their output is one of their inputs (``_chunk_apply_over``,
``_chunk_dx_over`` in kernels/cpu/batchnorm.py say why): their job calls them that way too (``over_args``)."""

ALWAYS = ("add_forward", "softmax_xent_forward", "softmax_xent_backward")
"""The network's gradient fan-in sum and the loss head."""

OPTIMIZER_OPS = {"sgd": "sgd_update", "adam": "adam_update"}

CONV_OPS = {"forward": "conv2d_forward", "data": "conv2d_backward_data", "weight": "conv2d_backward_weight"}

SHARED_FORWARD_KERNEL = ("winograd4", "winograd4-by-k", "winograd", "winograd-by-xi", "shifted", "depthwise-flat",
                         "depthwise-planes", "depthwise-registers", "pointwise", "pointwise-strided")
"""Paths whose backward-data calls the forward kernel (``conv_winograd4.forward(..., flipped=True)``,
``conv_winograd4.forward_by_k(..., flipped=True)``,
``conv_winograd.forward(..., flipped=True)``, ``conv_winograd.forward_by_xi(..., flipped=True)``,
``conv_shifted.forward(..., flipped=True)``, ``conv_depthwise.flat_forward(..., mirrored=True)``,
``conv_depthwise.plane_forward(..., mirrored=True)``, ``conv_depthwise_regs.filter_share(..., data=True)``,
``conv_pointwise.images(..., transposed=True)``, also at stride 2 for "pointwise-strided")
with the same argument types: their backward-data shares the forward's job, which makes both calls
(``run_job``), so the two workers never compile the same kernel at once."""


def conv_jobs(convs: Iterable[tuple]) -> list[Job]:
    """One job per distinct (path, direction, bias) among ``(x_shape, w_shape, stride, pad, groups, bias)``,
    each with an optional seventh element: whether its backward-data is ever called (False for a conv
    on the network's input, which has no input gradient)."""
    from kernels.cpu import conv as cpu_conv

    seen: dict[tuple, Job] = {}
    for x_shape, w_shape, stride, pad, groups, bias, *data in convs:
        x_shape = (BATCH, *tuple(x_shape)[1:])
        for direction, op in CONV_OPS.items():
            if direction == "data" and data and not data[0]:
                continue  # a conv on the network's input: no input gradient, never called
            kind = cpu_conv.path(x_shape, tuple(w_shape), stride, pad, groups, direction)
            # backward-data runs forward's kernel (a flag flips the filter) on these two paths:
            # one job compiles both, and two workers never compile the same kernel at once
            kernel = "forward" if direction == "data" and kind in SHARED_FORWARD_KERNEL else direction
            key = (kind, kernel, bool(bias) and direction != "data")
            if key not in seen:
                seen[key] = Job(op, (x_shape, tuple(w_shape), stride, pad, groups, bool(bias)), path=kind)
    return list(seen.values())


def model_jobs(graph: Any, optimizer: str = "sgd") -> list[Job]:
    """The jobs one training run of ``graph`` (an ``engine.graph.Graph``) with ``optimizer`` needs."""
    from engine.graph import GRAPH_INPUT

    shapes = graph.shapes(BATCH)
    convs, ops = [], list(ALWAYS)
    if optimizer in OPTIMIZER_OPS:
        ops.append(OPTIMIZER_OPS[optimizer])
    else:
        ops += list(OPTIMIZER_OPS.values())
    for node, layer in ((n, part) for n in graph.nodes for part in (n.layer, *getattr(n.layer, "parts", ()))):
        kind = type(layer).__name__
        if kind == "BatchNorm2d" and layer is not node.layer:
            continue  # a part of a ChunkedConvBN: its batch norm runs the chunk kernels, listed as the node's
        if kind == "Conv2d":
            k, r = layer.out_channels, layer.kernel_size
            w_shape = (k, layer.in_channels // layer.groups, r, r)
            x_shape, on_input = shapes[node.inputs[0]], node.inputs[0] == GRAPH_INPUT
            if layer is not node.layer and hasattr(node.layer, "part_input_shape"):  # a ChunkedPair's second conv
                on_input = on_input and layer in node.layer.stages[0].parts
                x_shape = node.layer.part_input_shape(layer, x_shape)
            convs.append((x_shape, w_shape, layer.stride, layer.padding, layer.groups, layer.has_bias, not on_input))
        elif kind in LAYER_OPS:
            ops += LAYER_OPS[kind]
        else:
            ops += [op for op in TINY_ARGS if op not in ops]
    table_jobs = [Job(op) for op in dict.fromkeys(ops)]
    return sorted(conv_jobs(convs), key=lambda j: j.op) + table_jobs  # the slow ones first


def all_jobs(versions: bool = True) -> list[Job]:
    """Every table kernel and conv path (with ``versions``, every conv_study version too): for
    ``engine kernels --warmup``."""
    from kernels.cpu import conv_study

    shapes = [
        ((BATCH, 5, 5, 5), (4, 5, 3, 3), 1, 1, 1),  # 3×3 on a small plane, > 4 channels (not a stem): im2col
        ((BATCH, 8, 8, 8), (4, 8, 3, 3), 1, 1, 1),  # 3×3 stride 1, ≥ 8 channels on ≥ 64 pixels: shifted GEMMs
        ((BATCH, 64, 4, 4), (64, 64, 3, 3), 1, 1, 1),  # 3×3 stride 1, ≥ 64 channels: Winograd (weight: im2col)
        ((BATCH, 64, 3, 3), (64, 64, 3, 3), 1, 1, 1),  # ... on < 16 pixels: F(2×2) by ξ (4×4 to 8×8: F(4×4) by k, v34)
        ((BATCH, 4, 5, 5), (4, 4, 1, 1), 1, 0, 1),  # plain 1×1
        ((BATCH, 4, 5, 5), (4, 1, 3, 3), 2, 1, 4),  # depthwise, flat
        ((BATCH, 4, 24, 24), (4, 1, 3, 3), 1, 1, 4),  # depthwise plane by plane; weight gradient by groups
        ((BATCH, 4, 32, 32), (4, 1, 3, 3), 2, 1, 4),  # depthwise 4×4 to 32×32 planes: in registers (v25)
        ((BATCH, 64, 16, 16), (64, 64, 3, 3), 1, 1, 1),  # 3×3 stride 1, ≥ 64 channels, 16×16: F(4×4) with OpenBLAS
        ((BATCH, 4, 16, 16), (4, 4, 1, 1), 1, 0, 1),  # plain 1×1 on ≥ 16×16: the weight gradient split over dW (v27)
        ((BATCH, 64, 16, 16), (64, 64, 3, 3), 2, 1, 1),  # 3×3 stride 2, ≥ 64 channels: polyphase Winograd (v28, v32)
        ((BATCH, 4, 5, 5), (4, 4, 1, 1), 2, 0, 1),  # 1×1 stride 2: its kept pixels (v33)
        ((BATCH, 3, 8, 8), (4, 3, 3, 3), 1, 1, 1),  # a 3-channel stem: its own columns (v36)
        ((BATCH, 3, 16, 16), (4, 3, 7, 7), 2, 3, 1),  # an ImageNet stem (stride 2): its columns by output rows (v39)
        ((BATCH, 264, 16, 16), (264, 264, 3, 3), 1, 1, 1),  # > 256 channels on 16×16: F(2×2) tiles
        ((BATCH, 4, 5, 5), (4, 1, 5, 5), 1, 2, 4),  # depthwise 5×5: the direct loops
    ]
    jobs = conv_jobs([(*s, bias) for s in shapes for bias in (False, True)])
    if versions:
        for x_shape, w_shape, stride, pad, groups in shapes[:5]:
            for direction, op in CONV_OPS.items():
                for v in conv_study.VERSIONS[direction]:
                    jobs.append(Job(op, (x_shape, w_shape, stride, pad, groups, False), v, path=f"v{v}"))
    return jobs + [Job(op) for op in TINY_ARGS]


# ----------------------------------------------------------------------------------------------
# Running a job (in a worker process)
# ----------------------------------------------------------------------------------------------


def _f32(*shape: int) -> np.ndarray:
    return np.random.default_rng(0).standard_normal(shape, dtype=np.float32)


_X = (2, 3, 4, 4)
_C = 3
TINY_ARGS: dict[str, Callable[[], tuple]] = {
    "relu_forward": lambda: (_f32(*_X), np.empty(_X, np.float32)),
    "relu_backward": lambda: (np.abs(_f32(*_X)), _f32(*_X), np.empty(_X, np.float32)),
    "relu6_forward": lambda: (_f32(*_X), np.empty(_X, np.float32)),
    "relu6_backward": lambda: (np.abs(_f32(*_X)), _f32(*_X), np.empty(_X, np.float32)),
    "leaky_relu_forward": lambda: (_f32(*_X), np.empty(_X, np.float32), 0.01),
    "leaky_relu_backward": lambda: (np.abs(_f32(*_X)), _f32(*_X), np.empty(_X, np.float32), 0.01),
    "add_forward": lambda: (_f32(*_X), _f32(*_X), np.empty(_X, np.float32)),
    "dropout_forward": lambda: (_f32(*_X), np.ones(_X, np.uint8), 2.0, np.empty(_X, np.float32)),
    "dropout_backward": lambda: (_f32(*_X), np.ones(_X, np.uint8), 2.0, np.empty(_X, np.float32)),
    "dense_forward": lambda: (_f32(2, 5), _f32(3, 5), _f32(3), np.empty((2, 3), np.float32)),
    "dense_backward": lambda: (
        _f32(2, 5),
        _f32(3, 5),
        _f32(2, 3),
        np.empty((2, 5), np.float32),
        np.empty((3, 5), np.float32),
        np.empty(3, np.float32),
    ),
    "maxpool2d_forward": lambda: (
        _f32(*_X),
        np.empty((2, 3, 2, 2), np.float32),
        np.empty((2, 3, 2, 2), np.uint8),  # MaxPool2d keeps a uint8 argmax for windows up to 16x16
        2,
        2,
        0,
    ),
    "maxpool2d_backward": lambda: (_f32(2, 3, 2, 2), np.zeros((2, 3, 2, 2), np.uint8), np.empty(_X, np.float32), 2, 2,
                                   0),
    "avgpool2d_forward": lambda: (_f32(*_X), np.empty((2, 3, 2, 2), np.float32), 2, 2, 0),
    "avgpool2d_backward": lambda: (_f32(2, 3, 2, 2), np.empty(_X, np.float32), 2, 2, 0),
    "global_avgpool_forward": lambda: (_f32(*_X), np.empty((2, 3), np.float32)),
    "global_avgpool_backward": lambda: (_f32(2, 3), np.empty(_X, np.float32)),
    "batchnorm_forward_train": lambda: (
        _f32(*_X),
        np.ones(_C, np.float32),
        np.zeros(_C, np.float32),
        np.zeros(_C, np.float32),
        np.ones(_C, np.float32),
        np.empty(_X, np.float32),
        np.empty(_C, np.float32),
        np.empty(_C, np.float32),
        0.1,
        1e-5,
    ),
    "batchnorm_forward_infer": lambda: (
        _f32(*_X),
        np.ones(_C, np.float32),
        np.zeros(_C, np.float32),
        np.zeros(_C, np.float32),
        np.ones(_C, np.float32),
        np.empty(_X, np.float32),
        1e-5,
    ),
    "batchnorm_backward_from_output": lambda: (
        _f32(*_X),
        _f32(*_X),
        np.ones(_C, np.float32),
        np.zeros(_C, np.float32),
        np.ones(_C, np.float32),
        np.empty(_X, np.float32),
        np.empty(_C, np.float32),
        np.empty(_C, np.float32),
    ),
    "batchnorm_chunk_statistics": lambda: (_f32(*_X), np.zeros((_C, 3)), True),
    "batchnorm_chunk_finish": lambda: (
        np.ones((_C, 3)), 32, np.ones(_C, np.float32), np.zeros(_C, np.float32), np.zeros(_C, np.float32),
        np.ones(_C, np.float32), np.empty((_C, 2)), np.empty(_C, np.float32), 0.1, 1e-5,
    ),
    "batchnorm_chunk_apply": lambda: (_f32(*_X), np.ones((_C, 2)), "relu", np.empty(_X, np.float32),
                                      np.empty(_X, np.float32)),
    "batchnorm_chunk_gradient_sums": lambda: (_f32(*_X), _f32(*_X), np.ones(_C, np.float32),
                                              np.zeros(_C, np.float32), np.zeros((_C, 2)), True, "relu"),
    "batchnorm_chunk_dx": lambda: (_f32(*_X), _f32(*_X), np.ones(_C, np.float32), np.zeros(_C, np.float32),
                                   np.ones(_C, np.float32), np.zeros((_C, 2)), 32, np.empty(_X, np.float32), "relu"),
    "softmax_xent_forward": lambda: (
        np.zeros((2, 3), np.float32),
        np.zeros(2, np.int64),
        np.empty((2, 3), np.float32),
        np.empty(1, np.float32),
    ),
    "softmax_xent_backward": lambda: (
        np.full((2, 3), 1 / 3, np.float32),
        np.zeros(2, np.int64),
        np.empty((2, 3), np.float32),
    ),
    "sgd_update": lambda: (
        np.ones(8, np.float32),
        np.ones(8, np.float32),
        np.zeros(8, np.float32),
        0.1,
        0.9,
        1e-4,
        False,
    ),
    "adam_update": lambda: (
        np.ones(8, np.float32),
        np.ones(8, np.float32),
        np.zeros(8, np.float32),
        np.zeros(8, np.float32),
        1e-3,
        0.9,
        0.999,
        1e-8,
        0.0,
        1,
    ),
}
"""Tiny arguments for every non-conv table op, of the dtypes and ranks the layers pass."""


def _conv_args(job: Job, direction: str | None = None) -> tuple:
    from kernels.cpu import TABLE

    x_shape, w_shape, stride, pad, groups, bias = job.conv
    k = w_shape[0]
    oh = (x_shape[2] + 2 * pad - w_shape[2]) // stride + 1
    ow = (x_shape[3] + 2 * pad - w_shape[3]) // stride + 1
    out_shape = (x_shape[0], k, oh, ow)
    direction = direction or next(d for d, op in CONV_OPS.items() if op == job.op)
    if job.version is None:
        size = TABLE[CONV_OPS[direction] + "_workspace_size"](x_shape, w_shape, stride, pad, groups)
    else:
        from kernels.cpu import conv_study

        size = conv_study.conv2d_version_workspace_size(job.version, direction, x_shape, w_shape, stride, pad, groups)
    scratch = np.empty(max(1, size), np.float32)
    x, w, dout = _f32(*x_shape), _f32(*w_shape), _f32(*out_shape)
    b = _f32(k) if bias else None
    if direction == "forward":
        return x, w, b, np.empty(out_shape, np.float32), stride, pad, groups, scratch
    if direction == "data":
        return dout, w, np.empty(x_shape, np.float32), stride, pad, groups, scratch
    return x, dout, np.empty(w_shape, np.float32), b, stride, pad, groups, scratch


def over_args(op: str) -> tuple:
    """``TINY_ARGS[op]`` with the output written over the first input (``WRITTEN_OVER``)."""
    args = list(TINY_ARGS[op]())
    args[3 if op == "batchnorm_chunk_apply" else 7] = args[0]  # apply's y, dx's dx
    return tuple(args)


FAMILIES = (("winograd4", "winograd4"), ("winograd-s2", "winograd-s2"), ("winograd", "winograd"), ("stem", "stem"),
            ("pointwise", "pointwise"), ("depthwise", "depthwise"), ("gemm", "gemm"), ("shifted", "shifted"))
"""(path prefix, family): conv jobs whose paths share compiled pieces (a module's transforms, its gathers) run one after
another in one worker (``families``). "winograd4" before "winograd": the first prefix that matches decides."""

OP_FAMILIES = {"dropout_forward": "dropout", "dropout_backward": "dropout"}
"""Table ops whose kernels are one compiled function (``elementwise._dropout`` with the same argument types): one
family, so two workers do not compile it at once (MobileNetV2's warm-up compiled it in both, 0.12 + 0.23 s)."""


def family(job: Job) -> str:
    """The family of ``job`` (``FAMILIES``): its conv path's module, or the job itself (a table op, a study version)."""
    if job.path is not None and job.version is None:
        for prefix, name in FAMILIES:
            if job.path.startswith(prefix):
                return name
    if job.conv is None and job.version is None and job.op in OP_FAMILIES:
        return OP_FAMILIES[job.op]
    return job.key


def families(jobs: list[Job]) -> list[list[Job]]:
    """``jobs`` grouped by ``family``, the group with the most jobs first (then in the jobs' order).

    Why. Two workers that take jobs one at a time compile a transform twice when two jobs that need it run at
    once (ResNet-18's F(4×4) backward-data, its weight gradient and its by-k paths all need ``_input_transform``,
    1.6 s): the CIFAR warm-up's 25 jobs took 21.3 s of CPU in two workers against 19.0 s one after another in one
    process. A family in one worker compiles each piece once and loads it from the cache for the next job. The most
    jobs first is the longest-processing-time rule with jobs as the measure of time (the conv families, the long
    ones, have the most)."""
    groups: dict[str, list[Job]] = {}
    for job in jobs:
        groups.setdefault(family(job), []).append(job)
    return sorted(groups.values(), key=len, reverse=True)


def run_jobs(jobs: list[Job]) -> list[str]:
    """``run_job`` for each of ``jobs`` in order, in this process (one family: ``families``); one line per job that
    failed (the others still run)."""
    failed = []
    for job in jobs:
        try:
            run_job(job)
        except Exception as exc:  # noqa: BLE001  reported, and the kernel compiles on first use instead
            failed.append(f"{job.label}: {type(exc).__name__}: {exc}")
    return failed


def _im2col_tile_copies(weight: bool) -> None:
    """Compile the copy that im2col's tiles of several images add (``conv.gather_tile`` for the weight gradient's
    dout, ``conv.scatter_tile`` for the forward's result) with the argument types of those calls. The job's
    two-image shape gives one image a tile, so without this the training thread compiled it at its first step:
    ResNet-18's 256→512 stride-2 weight gradient at 224, batch 32, compiled ``gather_tile`` there, 0.40 s on
    the first run's wall after the warm-up."""
    import numpy as np

    from kernels.cpu import conv as cpu_conv

    a, tile = np.zeros((2, 1, 1, 2), np.float32), np.zeros(4, np.float32).reshape(1, 4)
    if weight:
        cpu_conv.gather_tile(a, 0, 2, 0, tile)
    else:
        cpu_conv.scatter_tile(tile, 0, 2, 0, a)


def run_job(job: Job) -> float:
    """Call the job's kernel once (compiling it, or loading it from the cache); seconds taken."""
    start = time.perf_counter()
    from kernels.cpu import TABLE

    if job.conv is None:
        TABLE[job.op](*TINY_ARGS[job.op]())
        if job.op in WRITTEN_OVER:
            TABLE[job.op](*over_args(job.op))
        if job.op in WITH_CHECKSUM:
            # offload's ReLU forward and rebuild that also sum their input (engine.offload.scheduler's
            # _FusedCheck): not table ops, the same arguments, compiled in the same worker
            from kernels.cpu import elementwise

            getattr(elementwise, WITH_CHECKSUM[job.op])(*TINY_ARGS[job.op]())
    elif job.version is None:
        TABLE[job.op](*_conv_args(job))
        if job.op == CONV_OPS["forward"] and job.path in SHARED_FORWARD_KERNEL:
            # backward-data's own pieces on these paths (Winograd's flipped filter transform since v13),
            # in the same worker as the forward kernel they share
            from kernels.cpu import conv as cpu_conv

            x_shape, w_shape, stride, pad, groups, _ = job.conv
            if cpu_conv.path(x_shape, w_shape, stride, pad, groups, "data") == job.path:
                TABLE[CONV_OPS["data"]](*_conv_args(job, "data"))
        if job.path == "gemm" and job.op in (CONV_OPS["forward"], CONV_OPS["weight"]):
            _im2col_tile_copies(job.op == CONV_OPS["weight"])
    else:
        from kernels.cpu import conv_study

        direction = next(d for d, op in CONV_OPS.items() if op == job.op)
        conv_study.conv2d_version(job.version, direction)(*_conv_args(job))
    return time.perf_counter() - start


# ----------------------------------------------------------------------------------------------
# The cache: where it is, whether it is warm, and filling it in parallel
# ----------------------------------------------------------------------------------------------


def cache_dir() -> str:
    """Where Numba really keeps the kernels' cache: ``NUMBA_CACHE_DIR`` when it can be written, else
    where Numba fell back to (``__pycache__`` beside the kernels, the user's cache directory, or a
    temporary directory: ``kernels.cpu.cache.where()``, which also says why)."""
    import kernels.cpu  # noqa: F401  decides the location (kernels.cpu.cache.guard) before any kernel exists
    from kernels.cpu.cache import where

    return where().directory


def source_stamp() -> str:
    """What Numba's cache depends on here: the kernels' source files (modification time and size,
    as Numba checks them), Numba's and Python's versions and the CPU it compiles for."""
    import numba
    from numba.core import config

    import kernels.cpu

    folder = os.path.dirname(os.path.abspath(kernels.cpu.__file__))
    parts = [numba.__version__, sys.version, str(config.CPU_NAME or ""), str(config.CPU_FEATURES or "")]
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py"):
            st = os.stat(os.path.join(folder, name))
            parts.append(f"{name}:{st.st_mtime_ns}:{st.st_size}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _markers() -> list[dict]:
    """The markers left by warm-ups with the current kernel sources: {"label", "keys", ...} each."""
    folder, stamp = cache_dir(), source_stamp()
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return []
    markers = []
    for name in names:
        if name.startswith(f"{MARKER_PREFIX}{stamp}-") and name.endswith(".json"):
            try:
                with open(os.path.join(folder, name), encoding="utf-8") as f:
                    marker = json.load(f)
                markers.append({"label": str(marker["label"]), "keys": set(marker["keys"])})
            except (OSError, ValueError, KeyError, TypeError):
                continue
    return markers


def warm_labels() -> list[str]:
    """The labels (model names, or "engine kernels --warmup") the cache is warm for."""
    return [marker["label"] for marker in _markers()]


def is_warm(jobs: list[Job]) -> bool:
    """Whether one earlier warm-up, with the current sources, compiled everything ``jobs`` compile."""
    wanted = {job.key for job in jobs}
    return any(wanted <= marker["keys"] for marker in _markers())


@dataclass
class WarmupResult:
    jobs: int
    seconds: float
    workers: int
    failed: list[str]


WORKER_BYTES = 224 << 20
"""What one warm-up worker adds to its cgroup's memory at its peak (its own heap and LLVM's, NumPy's and Numba's
modules; their code is shared with the training process). Measured 2026-11-28: a worker's peak RSS 260–275 MiB
compiling ResNet-18's CIFAR and 224 jobs; ``benchmarks/first_run.py --jobs`` (a parent that built the network, two
workers) peaked its cgroup at 485 and 528 MiB, the parent alone with the kernels imported at 68 MiB."""

TRAINING_SETUP_BYTES = 288 << 20
"""What the training process holds while the workers compile, at most: ResNet-18 and MobileNetV2 at 224, batch 32,
their data, network, parameters and optimizer state before the first step (``engine memory``'s setup, parameters and
optimizer rows: 170–200 MiB), with room to spare."""


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def workers_that_fit(limit_bytes: int | None = None) -> int:
    """Warm-up workers to start: one per core, as many as the memory limit leaves room for beside the training
    process's set-up (``WORKER_BYTES`` each after ``TRAINING_SETUP_BYTES``), at least one.

    Why (issue 30, "never OOM-killed"). The workers run in the training process's cgroup. Under 510 MiB, ResNet-18
    at 224 on a cold cache with two workers got one of them OOM-killed in two runs of two, and the training process
    itself in another run (its kernels then compile on first use, in the training process); the smallest limits
    ``engine memory`` predicts are for a warm cache. One worker compiles the same jobs in about twice the wall time."""
    return max(1, min(_cores(), _room_for_workers(limit_bytes)))


def _room_for_workers(limit_bytes: int | None = None) -> int:
    """Workers the memory limit (default: this process's, ``memory_limit``) leaves room for beside the training
    set-up, unclamped: 0 or less when not even one does."""
    if limit_bytes is None:
        from engine.memory.limits import memory_limit

        limit_bytes = memory_limit().bytes
    return (limit_bytes - TRAINING_SETUP_BYTES) // WORKER_BYTES


def _limit_is_tight() -> bool:
    """Whether the memory limit leaves room for fewer workers than cores: then the workers are waited for when they
    exit, so that none still holds its memory when the first step allocates (``ensure_compiled``). By the room, not
    by the workers started: on one core, under a limit that leaves room for none, the one worker is waited for too."""
    return _room_for_workers() < _cores()


def _prepare_worker() -> None:
    """A worker's start (its pool's initializer): what every job needs, before the first job arrives."""
    import kernels.cpu  # noqa: F401  NumPy, Numba, SciPy's BLAS and the kernel table

    _start_numba()


def _ready() -> int:
    return os.getpid()


def start_workers(label: str) -> ProcessPoolExecutor | None:
    """Start the warm-up's worker processes now, early, if the cache looks cold for ``label`` (no
    marker for it, nor for ``engine kernels --warmup``); None otherwise. Hand the pool to
    ``warm_for_training`` / ``ensure_compiled``, which uses it or shuts it down.

    Why. A worker imports NumPy, Numba, SciPy and the kernels and sets up Numba's compiler (~0.8 s of
    CPU and 1.3 s of wall, plus ~0.6 s for Numba's typing and target contexts) before its first job.
    Started when the warm-up begins, that is all inside the first run's wall time; started here, at
    the top of ``engine train``, it overlaps the parent's own loading of the data and building of the
    network. Spawned, not forked: by then the parent has imported ``kernels.cpu``, whose import
    starts Numba's OpenMP pool, and Numba aborts a forked child that uses it. Figures: kernels/README.md,
    "The records and the first run with v27–v30"."""
    labels = warm_labels()
    if label in labels or any("--warmup" in name for name in labels):
        return None  # likely warm: if not, ensure_compiled spawns its workers as before
    import multiprocessing

    workers = workers_that_fit()
    pool = ProcessPoolExecutor(
        max_workers=workers, mp_context=multiprocessing.get_context("spawn"), initializer=_prepare_worker
    )
    pool.workers = workers  # what ensure_compiled reports
    for _ in range(workers):  # a spawn pool starts a worker per submit while none is idle: all of them, now
        pool.submit(_ready)
    return pool


def _start_numba() -> None:
    """Numba's typing and target contexts (~0.6 s) are set up on a process's first compile: here, with a
    throwaway function outside the kernel table and the cache, before the first job."""
    from numba import njit

    njit(lambda value: value + 1)(1)


def ensure_compiled(
    jobs: list[Job],
    label: str,
    progress: Callable[[int, int], None] | None = None,
    workers: int | None = None,
    force: bool = False,
    pool: ProcessPoolExecutor | None = None,
) -> WarmupResult | None:
    """Run ``jobs`` in worker processes unless the cache is already warm for them (then None).

    ``progress(done, total)`` is called as jobs finish. A job that fails is named in the result and
    left to compile on its first real call: training does not depend on the warm-up. ``pool``: workers
    started early (``start_workers``), used instead of spawning new ones, and shut down either way."""
    if not jobs or (is_warm(jobs) and not force):
        if pool is not None:
            pool.shutdown(wait=_limit_is_tight())  # as below: under a tight limit, gone before training
        return None
    import multiprocessing

    if pool is None:
        workers = max(1, min(workers or workers_that_fit(), len(jobs)))
        pool = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"))
    else:
        workers = getattr(pool, "workers", _cores())  # what start_workers started
    start = time.perf_counter()
    failed: list[str] = []
    if progress:
        progress(0, len(jobs))
    try:
        futures = {pool.submit(run_jobs, group): group for group in families(jobs)}  # one task per family
        done = 0
        for future in as_completed(futures):
            group = futures[future]
            try:
                failed += future.result()
            except Exception as exc:  # noqa: BLE001  a worker that died: its family compiles on first use instead
                failed.append(f"{', '.join(job.label for job in group)}: {type(exc).__name__}: {exc}")
            done += len(group)
            if progress:
                progress(done, len(jobs))
    finally:
        # Every job has returned, so its kernels are in the cache: the workers' exit (a Python
        # interpreter with Numba and LLVM loaded tearing down, 0.57 s of ResNet-18's 13.2 s pool
        # measured from the last result to the end of a waiting shutdown) runs beside training
        # instead of before it. The executor joins them in the background, and at exit. Not under a
        # memory limit that leaves room for fewer workers than cores (``_limit_is_tight``): there a
        # worker still exiting held its memory while the first step planned for all of it (ResNet-18
        # at 224 under 510 MiB on a cold cache, one worker: OOM kills in two runs of two).
        pool.shutdown(wait=_limit_is_tight())
    seconds = time.perf_counter() - start
    if not failed:
        _write_marker(jobs, label, seconds)
    return WarmupResult(len(jobs), seconds, workers, failed)


def _write_marker(jobs: list[Job], label: str, seconds: float) -> None:
    keys = sorted({job.key for job in jobs})
    digest = hashlib.sha256("\n".join([label, *keys]).encode()).hexdigest()[:12]  # one marker per label and job set
    path = os.path.join(cache_dir(), f"{MARKER_PREFIX}{source_stamp()}-{digest}.json")
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        temporary = f"{path}.{os.getpid()}.tmp"
        with open(temporary, "w", encoding="utf-8") as f:
            json.dump({"label": label, "keys": keys, "seconds": round(seconds, 1)}, f)
        os.replace(temporary, path)
    except OSError:
        pass  # a read-only cache directory: the next run checks again (the workers then load, not compile)


class ProgressLine:
    """ "compiling kernels, first run only: 12/31" on one line, rewritten in place on a terminal;
    piped, only the first and the last count are printed (no carriage returns in a log file)."""

    def __init__(self, stream=None, prefix: str = "compiling kernels, first run only") -> None:
        self.stream = stream if stream is not None else sys.stdout
        self.prefix = prefix
        self.terminal = hasattr(self.stream, "isatty") and self.stream.isatty()

    def __call__(self, done: int, total: int) -> None:
        text = f"{self.prefix}: {done}/{total}"
        if self.terminal:
            self.stream.write("\r" + text + ("\n" if done == total else ""))
        elif done in (0, total):
            self.stream.write(text + "\n")
        self.stream.flush()


def warm_for_training(
    graph: Any, optimizer: str, label: str, stream=None, pool: ProcessPoolExecutor | None = None
) -> WarmupResult | None:
    """Before a CPU training run: fill the cache for this model in worker processes, with a
    progress line, unless it is warm already (then nothing is printed and None returned). ``pool``:
    workers ``start_workers`` started early (used, or shut down when the cache is warm)."""
    from kernels.cpu.cache import where

    location = where()
    out = stream if stream is not None else sys.stdout
    if location.problem:  # said on every run, warm or not: the cache is not where the user asked
        out.write(f"note: {location.problem}\n")
        out.flush()
    jobs = model_jobs(graph, optimizer)
    if is_warm(jobs):
        if pool is not None:  # started for nothing: warm under another label, so say so for this one
            pool.shutdown(wait=_limit_is_tight())  # under a tight limit, gone before training
            _write_marker(jobs, label, 0.0)
        return None
    line = ProgressLine(stream)
    result = ensure_compiled(jobs, label, line, pool=pool)
    if result is not None:
        out = line.stream
        kept = (f"cached in {location.directory}, later runs start at once" if location.persistent
                else "not kept: the next run compiles them again (see the note above)")
        out.write(
            f"compiled the kernels of {result.jobs} warm-up jobs in {result.seconds:.1f} s with {result.workers} "
            f"worker process{'' if result.workers == 1 else 'es'}; "
            f"{kept}\n"
        )
        for failure in result.failed:
            out.write(f"warning: warm-up of {failure} (it compiles on first use instead)\n")
        out.flush()
    return result

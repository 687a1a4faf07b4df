"""`engine kernels`: every kernel timed on the real model shapes, next to NumPy's sgemm and torch.

One row per (op, shape): milliseconds, GFLOP/s (GB/s for memory-bound ops), the percentage of
NumPy's float32 GEMM throughput measured in the same run (the ceiling for any fp32 kernel on this
machine), the largest absolute difference from the NumPy reference, and with ``--compare torch``
torch's time for the same op on the same arrays. Convolution also shows its numbered versions
(rows with version ``v1`` onwards, ``conv_study.VERSIONS`` in ``kernels/cpu/conv_study.py``; ``table`` is the kernel the
layers call), so the table says what each optimization bought.

Times are the best of ``repeat`` calls after one warm-up call: on a shared machine the best run
is the closest estimate of what the kernel can do; torch and sgemm are timed the same way. With
``--compare torch`` each case runs ``rounds`` rounds (``engine kernels --rounds``, 3 by default
there, else 1), ours then torch's, and each side keeps its best round: with one round, a moment of
host-level slowness during one side's block of calls decided a record by itself (issue 13's "no
record below 0.8" read one to three records below 0.8 per run, a different one each time, while
the same loop alternating both sides showed them moving together: kernels/README.md, "The records,
the step and the first run with v31–v35"). Before
each timed block the process waits until its other threads are idle (``quiesce``): OpenBLAS's
workers spin ~0.1 s after the NumPy reference check of the previous row and took a core from the
next kernel. Even so, rows of a few milliseconds vary 10-20% from run to run here. The
error is measured on the first ``CHECK_IMAGES`` images (the reference is slow NumPy), running
the kernel again on that slice.

``warm_up`` calls every kernel of the CPU table (and every conv path and version) once on tiny
arrays, in worker processes for ``engine kernels --warmup`` (``engine/warmup.py``), so Numba
compiles them into its on-disk cache; later processes load them instead of compiling.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine.report import Table, render_table

CHECK_IMAGES = 4


@dataclass(frozen=True)
class ConvShape:
    """One convolution of a model: input and weight shapes plus stride, padding and groups."""

    model: str
    x_shape: tuple[int, int, int, int]
    w_shape: tuple[int, int, int, int]
    stride: int
    pad: int
    groups: int = 1

    @property
    def out_shape(self) -> tuple[int, int, int, int]:
        n, _, h, w = self.x_shape
        k, _, r, _ = self.w_shape
        size = lambda s: (s + 2 * self.pad - r) // self.stride + 1  # noqa: E731
        return (n, k, size(h), size(w))

    @property
    def flops(self) -> float:
        n, k, oh, ow = self.out_shape
        return 2.0 * n * k * oh * ow * self.w_shape[1] * self.w_shape[2] * self.w_shape[3]

    @property
    def label(self) -> str:
        n, c, h, w = self.x_shape
        k, _, r, _ = self.w_shape
        kind = "dw " if self.groups > 1 and self.groups == c else ""
        return f"{kind}{c}->{k} {r}x{r} s{self.stride} @{h}x{w} n{n}"


def resnet18_convs(batch: int) -> list[ConvShape]:
    """The distinct convolutions of ResNet-18 for 32×32 inputs (3×3 stem, no max-pool)."""
    shapes = [ConvShape("resnet18", (batch, 3, 32, 32), (64, 3, 3, 3), 1, 1)]
    size, channels = 32, 64
    for out_channels, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        if stride == 2:
            shapes.append(ConvShape("resnet18", (batch, channels, size, size), (out_channels, channels, 3, 3), 2, 1))
            shapes.append(ConvShape("resnet18", (batch, channels, size, size), (out_channels, channels, 1, 1), 2, 0))
            size //= 2
        shapes.append(
            ConvShape("resnet18", (batch, out_channels, size, size), (out_channels, out_channels, 3, 3), 1, 1)
        )
        channels = out_channels
    return shapes


def mobilenetv2_convs(batch: int) -> list[ConvShape]:
    """The distinct convolutions of MobileNetV2 for 32×32 inputs (the CIFAR variant the engine trains):
    1×1 expand, 3×3 depthwise, 1×1 project, in the model's order, read from its graph (``graph_convs``)."""
    return graph_convs("mobilenetv2", batch, 32)


def graph_convs(model: str, batch: int, image_size: int) -> list[ConvShape]:
    """The distinct convolutions of ``model`` at ``image_size`` (the variant ``engine train`` picks for that size:
    the ImageNet ones above 32×32), read from the model's graph in the model's order (issue 32: the 224 shapes)."""
    from models import GRAPHS, resolve_variant

    options = {"variant": resolve_variant(model, None, image_size)}
    graph = GRAPHS[model](num_classes=10, image_size=image_size, **options)
    inputs = graph.shapes(batch)
    shapes = []
    for node in graph.nodes:
        layer = node.layer
        if type(layer).__name__ == "Conv2d":
            r = layer.kernel_size
            w_shape = (layer.out_channels, layer.in_channels // layer.groups, r, r)
            shapes.append(ConvShape(model, tuple(inputs[node.inputs[0]]), w_shape, layer.stride, layer.padding,
                                    layer.groups))
    return list(dict.fromkeys(shapes))


TINY_CONVS = (
    ConvShape("tiny", (2, 4, 5, 5), (4, 4, 3, 3), 1, 1),  # 3×3
    ConvShape("tiny", (2, 4, 5, 5), (4, 4, 1, 1), 1, 0),  # plain 1×1: no im2col
    ConvShape("tiny", (2, 4, 5, 5), (4, 1, 3, 3), 2, 1, 4),  # depthwise
)



@dataclass
class Case:
    """One row: how to call the kernel and the reference on fresh arrays, and how much work it is."""

    op: str
    version: str
    shape: str
    run: Callable[[], Any]  # the kernel on the full-size arrays
    check: Callable[[], float]  # max |kernel - reference| on a small slice
    flops: float = 0.0  # floating-point operations (compute-bound ops)
    bytes_moved: float = 0.0  # bytes read and written (memory-bound ops)
    torch_run: Callable[[], Any] | None = None


@dataclass
class Record:
    op: str
    backend: str
    version: str
    shape: str
    ms: float
    gflops: float | None
    gbps: float | None
    pct_sgemm: float | None
    max_abs_err: float | None
    torch_ms: float | None = None
    error: str | None = None
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        record = {k: v for k, v in self.__dict__.items() if k != "extra"}
        record.update(self.extra)
        return record


def best_ms(function: Callable[[], Any], repeat: int) -> float:
    """Best of ``repeat`` timed calls after one untimed warm-up call, in milliseconds."""
    function()
    best = float("inf")
    for _ in range(max(1, repeat)):
        start = time.perf_counter()
        function()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def sgemm_gflops(repeat: int, size: int = 1024) -> float:
    """NumPy's float32 matmul (its own OpenBLAS, all threads) on size³: the fp32 ceiling here."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((size, size), dtype=np.float32)
    b = rng.standard_normal((size, size), dtype=np.float32)
    out = np.empty((size, size), np.float32)
    ms = best_ms(lambda: np.matmul(a, b, out=out), repeat)
    return 2.0 * size**3 / ms / 1e6


# ----------------------------------------------------------------------------------------------
# Cases
# ----------------------------------------------------------------------------------------------


def _max_err(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.max(np.abs(got.astype(np.float64) - want.astype(np.float64)))) if got.size else 0.0


def _conv_arrays(shape: ConvShape, batch: int | None = None, seed: int = 0):
    n = shape.x_shape[0] if batch is None else batch
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, *shape.x_shape[1:]), dtype=np.float32)
    w = rng.standard_normal(shape.w_shape, dtype=np.float32) * np.float32(1 / np.sqrt(np.prod(shape.w_shape[1:])))
    dout = rng.standard_normal((n, *shape.out_shape[1:]), dtype=np.float32)
    return x, w, dout


def conv_cases(shape: ConvShape, table: dict, reference: dict, versions: bool, backend: str) -> list[Case]:
    """Forward, backward-data and backward-weight of one convolution, with the numbered CPU versions."""
    from kernels.cpu import conv_study

    x, w, dout = _conv_arrays(shape)
    xs, ws, ds = _conv_arrays(shape, batch=min(CHECK_IMAGES, shape.x_shape[0]))
    kernels = {
        "forward": ("conv2d_forward", table.get("conv2d_forward"), table.get("conv2d_forward_workspace_size")),
        "data": (
            "conv2d_backward_data",
            table.get("conv2d_backward_data"),
            table.get("conv2d_backward_data_workspace_size"),
        ),
        "weight": (
            "conv2d_backward_weight",
            table.get("conv2d_backward_weight"),
            table.get("conv2d_backward_weight_workspace_size"),
        ),
    }
    cases = []
    for direction, (op, kernel, size_of) in kernels.items():
        if kernel is None:
            continue
        variants = [("table", kernel, size_of)]
        if versions and backend == "cpu":
            for v in conv_study.VERSIONS[direction]:
                variants.append(
                    (
                        f"v{v}",
                        conv_study.conv2d_version(v, direction),
                        _version_size_function(v, direction),
                    )
                )
        for version, fn, size_fn in variants:
            if version == "v1" and shape.flops > 1e9:
                continue  # the direct loops take seconds here; the smaller shapes show the point
            cases.append(_conv_case(op, direction, version, shape, fn, size_fn, reference[op], x, w, dout, xs, ws, ds))
    return cases


def _version_size_function(version: int, direction: str) -> Callable[..., int]:
    from kernels.cpu import conv_study

    return lambda *shapes: conv_study.conv2d_version_workspace_size(version, direction, *shapes)


def _conv_case(op, direction, version, shape, fn, size_fn, ref_fn, x, w, dout, xs, ws, ds) -> Case:
    st, pad, groups = shape.stride, shape.pad, shape.groups
    scratch = np.empty(max(1, size_fn(x.shape, w.shape, st, pad, groups)), np.float32)
    small_scratch = np.empty(max(1, size_fn(xs.shape, ws.shape, st, pad, groups)), np.float32)
    if direction == "forward":
        out = np.empty(dout.shape, np.float32)
        run = lambda: fn(x, w, None, out, st, pad, groups, scratch)  # noqa: E731

        def check() -> float:
            got, want = np.empty(ds.shape, np.float32), np.empty(ds.shape, np.float32)
            fn(xs, ws, None, got, st, pad, groups, small_scratch)
            ref_fn(xs, ws, None, want, st, pad, groups, None)
            return _max_err(got, want)

        def torch_run_factory():
            import torch

            xt, wt = torch.from_numpy(x), torch.from_numpy(w)
            return lambda: torch.nn.functional.conv2d(xt, wt, None, st, pad, 1, groups)

    elif direction == "data":
        dx = np.empty(x.shape, np.float32)
        run = lambda: fn(dout, w, dx, st, pad, groups, scratch)  # noqa: E731

        def check() -> float:
            got, want = np.empty(xs.shape, np.float32), np.empty(xs.shape, np.float32)
            fn(ds, ws, got, st, pad, groups, small_scratch)
            ref_fn(ds, ws, want, st, pad, groups, None)
            return _max_err(got, want)

        def torch_run_factory():
            return _torch_conv_backward(x, w, dout, st, pad, groups, (True, False, False))

    else:
        dw = np.empty(w.shape, np.float32)
        run = lambda: fn(x, dout, dw, None, st, pad, groups, scratch)  # noqa: E731

        def check() -> float:
            got, want = np.empty(ws.shape, np.float32), np.empty(ws.shape, np.float32)
            fn(xs, ds, got, None, st, pad, groups, small_scratch)
            ref_fn(xs, ds, want, None, st, pad, groups, None)
            return _max_err(got, want)

        def torch_run_factory():
            return _torch_conv_backward(x, w, dout, st, pad, groups, (False, True, False))

    case = Case(op, version, shape.label, run, check, flops=shape.flops)
    case.torch_run = torch_run_factory  # built lazily: torch is imported only with --compare torch
    return case


def _torch_conv_backward(x, w, dout, stride, pad, groups, mask):
    """torch's autograd conv backward (aten.convolution_backward) for just the asked-for gradient."""
    import torch

    xt, wt, dt = torch.from_numpy(x), torch.from_numpy(w), torch.from_numpy(dout)
    return lambda: torch.ops.aten.convolution_backward(
        dt, xt, wt, None, [stride, stride], [pad, pad], [1, 1], False, [0, 0], groups, list(mask)
    )


def _elementwise_case(op, table, reference, shape, make_args, bytes_moved, torch_factory=None) -> Case:
    """A memory-bound op: time it on full-size arrays, check every array it wrote against the reference."""
    args = make_args(shape)
    small_shape = (min(CHECK_IMAGES, shape[0]), *shape[1:])
    fn, ref_fn = table[op], reference[op]

    def check() -> float:
        got = make_args(small_shape)
        want = [a.copy() for a in got]
        fn(*got)
        ref_fn(*want)
        return max(_max_err(g, r) for g, r in zip(got, want))

    case = Case(op, "table", "x".join(map(str, shape)), lambda: fn(*args), check, bytes_moved=bytes_moved(shape))
    case.torch_run = (lambda: torch_factory(args)) if torch_factory else None
    return case


def other_cases(table: dict, reference: dict, batch: int) -> list[Case]:
    """Dense (the classifier heads) and the element-wise ops, on ResNet-18's largest activation."""
    cases: list[Case] = []
    rng = np.random.default_rng(0)
    f32 = lambda *s: rng.standard_normal(s, dtype=np.float32)  # noqa: E731
    for inputs, outputs in ((512, 10), (1280, 10), (1024, 1024)):
        if "dense_forward" in table:
            x, w, b = f32(batch, inputs), f32(outputs, inputs), f32(outputs)
            out, want = np.empty((batch, outputs), np.float32), np.empty((batch, outputs), np.float32)

            def check(x=x, w=w, b=b, out=out, want=want):
                table["dense_forward"](x, w, b, out)
                reference["dense_forward"](x, w, b, want)
                return _max_err(out, want)

            case = Case(
                "dense_forward",
                "table",
                f"{batch}x{inputs}->{outputs}",
                (lambda x=x, w=w, b=b, out=out: table["dense_forward"](x, w, b, out)),
                check,
                flops=2.0 * batch * inputs * outputs,
            )

            def torch_dense(x=x, w=w, b=b):
                import torch

                xt, wt, bt = (torch.from_numpy(a) for a in (x, w, b))
                return lambda: torch.nn.functional.linear(xt, wt, bt)

            case.torch_run = torch_dense
            cases.append(case)
        if "dense_backward" in table:
            x, w, d = f32(batch, inputs), f32(outputs, inputs), f32(batch, outputs)
            got = [
                np.empty((batch, inputs), np.float32),
                np.empty((outputs, inputs), np.float32),
                np.empty(outputs, np.float32),
            ]
            want = [np.empty_like(a) for a in got]

            def check_b(x=x, w=w, d=d, got=got, want=want):
                table["dense_backward"](x, w, d, *got)
                reference["dense_backward"](x, w, d, *want)
                return max(_max_err(g, r) for g, r in zip(got, want))

            case = Case(
                "dense_backward",
                "table",
                f"{batch}x{inputs}->{outputs}",
                (lambda x=x, w=w, d=d, got=got: table["dense_backward"](x, w, d, *got)),
                check_b,
                flops=4.0 * batch * inputs * outputs,
            )

            def torch_dense_b(x=x, w=w, d=d):
                import torch

                xt, wt, dt = (torch.from_numpy(a) for a in (x, w, d))
                return lambda: (dt @ wt, dt.t() @ xt, dt.sum(0))

            case.torch_run = torch_dense_b
            cases.append(case)

    shape = (batch, 64, 32, 32)
    nbytes = lambda arrays: lambda s: arrays * 4.0 * np.prod(s)  # noqa: E731

    def torch_unary(name):
        def factory(args):
            import torch

            xt = torch.from_numpy(args[0])
            return {"relu": lambda: torch.relu(xt), "relu6": lambda: torch.nn.functional.relu6(xt)}[name]

        return factory

    specs = [
        ("relu_forward", lambda s: [f32(*s), np.empty(s, np.float32)], nbytes(2), torch_unary("relu")),
        ("relu_backward", lambda s: [np.abs(f32(*s)) - 0.5, f32(*s), np.empty(s, np.float32)], nbytes(3), None),
        ("relu6_forward", lambda s: [f32(*s) * 4, np.empty(s, np.float32)], nbytes(2), torch_unary("relu6")),
        ("relu6_backward", lambda s: [f32(*s) * 4, f32(*s), np.empty(s, np.float32)], nbytes(3), None),
        ("add_forward", lambda s: [f32(*s), f32(*s), np.empty(s, np.float32)], nbytes(3), None),
    ]
    for op, make_args, moved, torch_factory in specs:
        if op in table and op in reference:
            cases.append(_elementwise_case(op, table, reference, shape, make_args, moved, torch_factory))
    return cases


# ----------------------------------------------------------------------------------------------
# Running the table
# ----------------------------------------------------------------------------------------------


def build_cases(backend: str, ops: list[str] | None, batch: int, versions: bool, models=("resnet18", "mobilenetv2"),
                image_size: int = 32):
    """Every case the command measures, filtered by op family (``conv2d``, ``dense``, ``relu``...); conv shapes of
    ``models`` at ``image_size`` (32: the CIFAR variants' as always; larger: ``graph_convs``)."""
    table, reference = load_tables(backend)
    wanted = lambda op: not ops or any(op.startswith(prefix) for prefix in ops)  # noqa: E731
    cases: list[Case] = []
    if backend == "cudasim":  # the simulator runs ~3,000 threads/s: tiny convolutions only
        for shape in TINY_CONVS:
            cases += [c for c in conv_cases(shape, table, reference, False, backend) if wanted(c.op)]
        return cases, []
    # "conv2d" asks for every conv op, "conv2d_forward" for one of them
    if not ops or any(prefix.startswith("conv2d") or "conv2d".startswith(prefix) for prefix in ops):
        shapes = []
        if image_size != 32:
            shapes = [shape for model in models for shape in graph_convs(model, batch, image_size)]
        if "resnet18" in models and image_size == 32:
            shapes += resnet18_convs(batch)
        if "mobilenetv2" in models and image_size == 32:
            shapes += mobilenetv2_convs(batch)
        for shape in shapes:
            cases += [c for c in conv_cases(shape, table, reference, versions, backend) if wanted(c.op)]
    cases += [c for c in other_cases(table, reference, batch) if wanted(c.op)]
    missing = sorted({name for name in reference if name not in table and wanted(name)})
    return cases, missing


def load_tables(backend: str) -> tuple[dict, dict]:
    """The backend's kernel table and the reference table (whatever the kernel packages export now)."""
    from kernels.reference import TABLE as reference

    if backend == "cpu":
        from kernels.cpu import TABLE as table
    else:
        from kernels.cuda import TABLE as table
    return dict(table), dict(reference)


class TorchProcess:
    """torch's side of ``--compare torch``, timed in a process of its own, one case at a time.

    Why not in this process: GNU OpenMP is loaded once per process, by soname, and reads its
    settings when it loads; torch ships its own ``libgomp.so.1``, Numba's pool links the system's.
    Whichever comes first serves both, so one of the two always ran on the other's runtime:
    - torch imported first (what ``engine kernels`` did): Numba's ``prange`` kernels ran on
      torch's runtime with its default spin-waiting workers, not the sleeping ones the engine
      starts (``kernels.cpu.threads.start_numba_pool``): dense 1024→1024 with bias 0.74 → 7.9 ms, and
      every depthwise, batch-norm and element-wise row slower than it is in training;
    - Numba first: torch ran on the system runtime with passive waits, slower than in a torch
      program (depthwise 192 s2 @16×16 forward 0.25–0.39 → 0.47 ms, 1×1 64→384 @8×8 0.56–0.60 →
      0.72–0.75).
    So each side runs as it does in its own program: this process never imports torch; the child
    (``_TORCH_WORKER``) imports it before anything else, builds the
    same cases from the same arguments (the same order, checked by key), and times case ``i`` when
    asked, right after this process timed its own: the two still alternate, row by row, and never
    overlap.
    """

    def __init__(self, ops: list[str] | None, batch: int, versions: bool, models, repeat: int,
                 image_size: int = 32) -> None:
        import json
        import subprocess
        import sys

        spec = {"ops": ops, "batch": batch, "versions": versions, "models": list(models), "repeat": repeat,
                "image_size": image_size}
        self._child = subprocess.Popen(
            [sys.executable, "-c", _TORCH_WORKER, json.dumps(spec)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
        )  # fmt: skip
        self.pid = self._child.pid
        self._read("ready")

    def _read(self, expect: str) -> str:
        line = self._child.stdout.readline() if self._child.stdout else ""
        if not line.startswith(expect):
            self.close()
            raise RuntimeError(
                f"the torch timing process stopped ({line.strip() or 'no output'}); its error is printed above:"
                " fix that, or run without --compare torch"
            )
        return line[len(expect) :].strip()

    def time_ms(self, index: int, case: Case) -> float:
        """torch's best-of-``repeat`` milliseconds for case ``index`` (the same case in the child)."""
        assert self._child.stdin is not None
        self._child.stdin.write(f"{index}\t{case.op}\t{case.version}\t{case.shape}\n")
        return float(self._read("ms"))

    def close(self) -> None:
        if self._child.poll() is None:
            if self._child.stdin:
                self._child.stdin.close()
            self._child.wait(timeout=30)

    def __enter__(self) -> TorchProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_TORCH_WORKER = "import torch, sys; from engine.bench.kernels import _torch_worker; _torch_worker(sys.argv[1])"
"""The child's program: torch imported before anything that could start Numba's OpenMP pool."""


def _torch_worker(spec_json: str) -> None:
    """The child of ``TorchProcess``: torch first, then the cases; one line in, one line out."""
    import json
    import os
    import sys

    import torch  # already imported by _TORCH_WORKER, before Numba's pool: torch's own OpenMP runtime

    torch.set_num_threads(2 if _cpu_count() >= 2 else 1)
    spec = json.loads(spec_json)
    cases, _ = build_cases("cpu", spec["ops"], spec["batch"], spec["versions"], tuple(spec["models"]),
                           spec.get("image_size", 32))
    print("ready", flush=True)
    for line in sys.stdin:
        index, op, version, shape = line.rstrip("\n").split("\t")
        case = cases[int(index)] if 0 <= int(index) < len(cases) else None
        if case is None or (case.op, case.version, case.shape) != (op, version, shape) or case.torch_run is None:
            mine = "missing" if case is None else f"{case.op} {case.version} {case.shape}"
            print(f"error: case {index} is {mine} here, not {op} {version} {shape}", flush=True)
            return
        run = case.torch_run()
        quiesce(other_pids=(os.getppid(),))
        print(f"ms {best_ms(run, spec['repeat'])!r}", flush=True)


def measure(
    cases: list[Case], backend: str, repeat: int, sgemm: float, progress=None,
    torch_process: TorchProcess | None = None, rounds: int = 1,
) -> list[Record]:
    """Time every case; with a ``torch_process`` (built from the same arguments as ``cases``; see
    ``TorchProcess``), torch's time for it too. Each case is timed in ``rounds`` rounds, this process's
    best-of-``repeat`` and then torch's, and each side keeps its best round (module docstring: why)."""
    records = []
    others = (torch_process.pid,) if torch_process is not None else ()
    for index, case in enumerate(cases):
        ms, torch_ms, failure = float("inf"), None, None
        for _ in range(max(1, rounds)):
            try:
                quiesce(other_pids=others)
                ms = min(ms, best_ms(case.run, repeat))
            except Exception as exc:  # a broken kernel gets a row that says so, the rest still run
                failure = exc
                break
            if torch_process is not None and case.torch_run is not None:
                theirs = torch_process.time_ms(index, case)
                torch_ms = theirs if torch_ms is None else min(torch_ms, theirs)
        err = None
        if failure is None:
            try:
                err = case.check()
            except Exception as exc:
                failure = exc
        if failure is not None:
            records.append(
                Record(
                    case.op,
                    backend,
                    case.version,
                    case.shape,
                    float("nan"),
                    None,
                    None,
                    None,
                    None,
                    error=f"{type(failure).__name__}: {failure}",
                )
            )
            continue
        gflops = case.flops / ms / 1e6 if case.flops else None
        gbps = case.bytes_moved / ms / 1e6 if case.bytes_moved else None
        pct = 100.0 * gflops / sgemm if gflops else None
        records.append(Record(case.op, backend, case.version, case.shape, ms, gflops, gbps, pct, err, torch_ms))
        if progress:
            progress(records[-1])
    return records


def thread_schedstat(pid: int | str = "self") -> dict[int, tuple[int, int]] | None:
    """Per thread of process ``pid``: (nanoseconds run on a CPU, nanoseconds waited for one while
    runnable), from ``/proc/<pid>/task/*/schedstat``; None where there is no such process. Threads
    that end while being read are left out. ``quiesce`` and ``benchmarks/offload_threads.py`` read it."""
    import os

    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    out: dict[int, tuple[int, int]] = {}
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                ran, waited = f.read().split()[:2]
            out[int(tid)] = (int(ran), int(waited))
        except (OSError, ValueError):
            continue  # a thread that ended, or no schedstat
    return out


def quiesce(
    quiet_ns: int = 1_000_000, interval_s: float = 0.01, limit_s: float = 1.0, other_pids: tuple[int, ...] = ()
) -> float:
    """Wait until the process's other threads (and every thread of ``other_pids``) are idle; returns
    the seconds waited.

    OpenBLAS's worker threads spin for ~0.1 s after each multithreaded call (measured here: 120 ms
    after a 2000² NumPy matmul), and GNU OpenMP's (torch's) after each parallel region. A kernel
    timed in that window shares its cores with them: MobileNetV2's 1×1 backward-data 960→320 @4×4
    read 4.0-5.0 ms right after the NumPy reference check of the previous case and 2.4-2.7 ms
    alone, which made `engine kernels` disagree with itself by up to 2× from run to run. The same
    holds across processes: torch's timing process (``TorchProcess``) and this one each wait for
    the other's workers too (dense 1024→1024 read 1.49 ms ours and 7.02 ms torch's without that,
    0.74 and 0.56 alone). This polls
    the other threads' run time (``/proc/self/task/*/schedstat``, nanoseconds) until they used less
    than ``quiet_ns`` in an ``interval_s``; where that file does not exist it just sleeps once.
    """
    import threading

    def others_ns() -> int | None:
        me, total = threading.get_native_id(), 0
        for pid in ("self", *other_pids):
            stats = thread_schedstat(pid)
            if stats is None:
                if pid == "self":
                    return None
                continue  # a process that ended
            total += sum(ran for tid, (ran, _) in stats.items() if pid != "self" or tid != me)
        return total

    started = time.perf_counter()
    previous = others_ns()
    while True:
        time.sleep(interval_s)
        current = others_ns()
        if previous is None or current is None or current - previous < quiet_ns:
            return time.perf_counter() - started
        if time.perf_counter() - started > limit_s:
            return time.perf_counter() - started
        previous = current


def _cpu_count() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def kernels_table(records: list[Record], sgemm: float, compare_torch: bool, rounds: int = 1) -> Table:
    """The ``engine kernels`` table; the ratio column is torch's time over ours (above 1: we are faster)."""
    columns = ["op", "backend", "version", "shape", "ms", "GFLOP/s | GB/s", "% sgemm", "max abs err"]
    if compare_torch:
        columns += ["torch ms", "torch/ours"]
    best = "best of repeats" + (f" over {rounds} rounds" if rounds > 1 else "")
    best += ", alternating with torch's" if compare_torch and rounds > 1 else ""
    table = Table(f"kernels (NumPy sgemm {sgemm:.0f} GFLOP/s in this run; {best})", columns,
                  right={i for i, name in enumerate(columns) if name not in ("op", "backend", "version", "shape")})
    for r in records:
        rate = f"{r.gflops:.1f}" if r.gflops else (f"{r.gbps:.1f} GB/s" if r.gbps else "")
        row = [
            r.op,
            r.backend,
            r.version,
            r.shape,
            f"{r.ms:.2f}" if r.error is None else "error",
            rate,
            f"{r.pct_sgemm:.0f}%" if r.pct_sgemm else "",
            f"{r.max_abs_err:.1e}" if r.max_abs_err is not None else (r.error or ""),
        ]
        if compare_torch:
            row += [f"{r.torch_ms:.2f}" if r.torch_ms else "", f"{r.torch_ms / r.ms:.2f}" if r.torch_ms else ""]
        table.add_row(*row)
    return table


def render(records: list[Record], sgemm: float, compare_torch: bool, console: Any = None, rounds: int = 1) -> None:
    """Print ``kernels_table`` through engine/report.py: no cell cut, whatever the terminal's width."""
    render_table(kernels_table(records, sgemm, compare_torch, rounds), console)


# ----------------------------------------------------------------------------------------------
# Warm-up: compile every CPU kernel into Numba's cache
# ----------------------------------------------------------------------------------------------


def warm_up(parallel: bool = False, progress=None) -> tuple[float, int]:
    """Call every CPU table kernel, conv path and conv version once on tiny arrays; (seconds, calls).

    ``parallel``: in worker processes (``engine.warmup.ensure_compiled``), which fill the on-disk
    cache; otherwise one after another in this process (the kernels are then loaded here too)."""
    from engine.warmup import all_jobs, ensure_compiled, run_job

    jobs = all_jobs()
    start = time.perf_counter()
    if parallel:
        result = ensure_compiled(jobs, "engine kernels --warmup", progress, force=True)
        if result is not None and result.failed:
            raise RuntimeError("warm-up failed: " + "; ".join(result.failed))
    else:
        for done, job in enumerate(jobs, 1):
            run_job(job)
            if progress:
                progress(done, len(jobs))
    return time.perf_counter() - start, len(jobs)


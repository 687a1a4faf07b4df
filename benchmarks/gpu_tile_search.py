"""Fill the GEMM table (kernels/cuda/gemm_table.json) on a GPU: every conv GEMM of ResNet-18 and MobileNetV2.

For each distinct implicit GEMM of one training step (forward, backward data, weight gradient; found by
running the step under ``count_only`` with the kernel table intercepted, so no GPU time is spent
finding them), every candidate of the tile family (``kernels.cuda.gemm.CANDIDATES``) is timed with a
few split-K counts through the production launcher (``forced_choice``: the split's partial sums and
``sum_splits`` included), back-to-back launches between CUDA events, after one run checked against
the default configuration's result (itself checked against NumPy by the acceptance run, which runs
with the new table; ``--dry`` checks against NumPy directly). Shapes go largest first and
``--budget-s`` stops the search in time, the rest keeping the default. The fastest (config, splits)
goes into the table; beside it, cuBLAS (``cupy.matmul``) on a plain GEMM of the same M×N×K (batched
over z) in the same run, as the reference for the goal (≥ 40% of cuBLAS's TFLOP/s).

    python benchmarks/gpu_tile_search.py --output $OUT/gemm_table.json --results $OUT/tile_search.json

First, before the conv shapes, every candidate runs a plain (non-implicit) square GEMM of each ``--plain``
size (2048 and 4096) beside cuBLAS: the tile loop's own efficiency, apart from the implicit-GEMM index
arithmetic of the conv operands (on an H100 the 4096³ GEMM on 128×128 8×8 tiles reached 10 TFLOP/s of
cuBLAS's 51 before the loop was rewritten). Those seconds count in ``--budget-s``.

``--dry``: the same code under the CUDA simulator at tiny sizes (a 4×4 network, the small family
members, timed with the host clock): what a test runs to show the script works before a GPU is lent.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

DIRECTIONS = {"conv2d_forward": "forward", "conv2d_backward_data": "data", "conv2d_backward_weight": "weight"}


@dataclass(frozen=True)
class ConvCall:
    """One conv call of a step: what the launcher needs to run it again."""

    direction: str
    x_shape: tuple[int, ...]
    w_shape: tuple[int, ...]
    stride: int
    pad: int
    groups: int


@dataclass
class Row:
    key: str
    model: str
    direction: str
    shape: str
    gflop: float
    best_config: str = ""
    best_splits: int = 1
    best_tflops: float = 0.0
    default_tflops: float = 0.0  # the table's default config with the split rule: what ran before the search
    cublas_tflops: float | None = None
    max_error: float = 0.0
    tried: dict[str, float] = field(default_factory=dict)  # "config/splits" -> TFLOP/s


def step_conv_calls(model: str, batch: int, image_size: int, **options: Any) -> list[ConvCall]:
    """The conv calls of one SGD step of ``model`` (found under count_only: nothing runs)."""
    from engine.backend import counting_backend
    from engine.optim import make_optimizer
    from kernels.cuda import count_only
    from models import build_model

    backend = counting_backend()
    calls: list[ConvCall] = []

    def hook(op: str, function: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if op in DIRECTIONS:
            if op == "conv2d_forward":
                x, w, stride, pad, groups = args[0], args[1], args[4], args[5], args[6]
                x_shape = x.shape
            elif op == "conv2d_backward_data":
                w, dx, stride, pad, groups = args[1], args[2], args[3], args[4], args[5]
                x_shape = dx.shape
            else:
                x, dw, stride, pad, groups = args[0], args[2], args[4], args[5], args[6]
                w, x_shape = dw, x.shape
            calls.append(ConvCall(DIRECTIONS[op], tuple(int(v) for v in x_shape), tuple(int(v) for v in w.shape),
                                  int(stride if not isinstance(stride, tuple) else stride[0]),
                                  int(pad if not isinstance(pad, tuple) else pad[0]), int(groups)))
        return function(*args, **kwargs)

    net = build_model(model, 10, backend, seed=0, image_size=image_size, **options)
    try:
        optimizer = make_optimizer("sgd", net, backend, 0.01, momentum=0.9, manager=net.mgr)
        x = np.zeros((batch, 3, image_size, image_size), np.float32)
        y = np.zeros(batch, np.int64)
        with count_only(), net.backend.kernels.intercept(hook):
            net.forward(x, training=True)
            net.loss(y)
            net.backward()
            optimizer.step()
    finally:
        net.close()
    return calls


def _timer(dry: bool) -> Any:
    """time(fn, repeat) -> ms per call: CUDA events around back-to-back launches, or the host clock (--dry)."""
    if dry:
        def host(fn: Any, repeat: int) -> float:  # the check run before it warmed up
            start = time.perf_counter()
            for _ in range(repeat):
                fn()
            return (time.perf_counter() - start) * 1e3 / repeat
        return host

    import cupy

    def events(fn: Any, repeat: int) -> float:
        fn()
        cupy.cuda.get_current_stream().synchronize()
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        best = float("inf")
        for _ in range(3):
            start.record()
            for _ in range(repeat):
                fn()
            end.record()
            end.synchronize()
            best = min(best, cupy.cuda.get_elapsed_time(start, end) / repeat)
        return best
    return events


@dataclass
class PlainRow:
    """One candidate on a plain square GEMM C = A @ B (MATRIX operands), beside cuBLAS on the same arrays."""

    size: int
    config: str
    tflops: float
    cublas_tflops: float | None
    max_error: float


def plain_gemms(sizes: list[int], configs: dict[str, Any], repeat: int, dry: bool, log: Any = print) -> list[PlainRow]:
    """Time each candidate on size³ GEMMs (checked against NumPy under --dry, else against cuBLAS's result)."""
    from kernels.cuda import gemm

    xp = np
    if not dry:
        import cupy as xp
    timer = _timer(dry)
    rng = np.random.default_rng(1)
    rows = []
    for size in sizes:
        a_h = rng.standard_normal((size, size)).astype(np.float32)
        b_h = rng.standard_normal((size, size)).astype(np.float32)
        A, B = xp.asarray(a_h), xp.asarray(b_h)
        C = xp.empty((size, size), np.float32)
        flops = 2.0 * size ** 3
        cublas = None
        if dry:
            expected = a_h.astype(np.float64) @ b_h.astype(np.float64)
        else:
            xp.matmul(A, B, out=C)
            expected = C.get().astype(np.float64)
            cublas = flops / timer(lambda A=A, B=B, C=C: xp.matmul(A, B, out=C), repeat) / 1e9
        scale = max(1.0, float(np.abs(expected).max()))
        for name, config in configs.items():
            version = gemm.tile_version(config)
            C.fill(np.nan)
            version(A, B, C)
            got = (C.get() if hasattr(C, "get") else np.array(C)).astype(np.float64)
            error = float(np.abs(got - expected).max()) / scale
            if not error < 1e-3:
                log(f"  plain {size}^3 {name}: WRONG (error {error:.2e})")
                rows.append(PlainRow(size, name, 0.0, cublas, error))
                continue
            tflops = flops / timer(lambda v=version, A=A, B=B, C=C: v(A, B, C), repeat) / 1e9
            rows.append(PlainRow(size, name, tflops, cublas, error))
            log(f"  plain {size}^3 {name}: {tflops:.2f} TFLOP/s (cuBLAS {cublas or 0:.2f}"
                + (f", {tflops / cublas:.2f} of it)" if cublas else ")"))
    return rows


def split_options(K: int, rule: int, dry: bool) -> list[int]:
    """Split counts worth timing for a GEMM with K products: 1, the rule's, and twice and four times it,
    keeping at least 128 products a split (2 under --dry)."""
    floor = 2 if dry else 128
    options = sorted({1, rule, 2 * rule, 4 * rule})
    options = [s for s in options if s == 1 or K // s >= floor]
    return options[:2] if dry else options[:4]


def search(models: list[str], batch: int, image_size: int, configs: dict[str, Any], repeat: int, dry: bool,
           log: Any = print, max_shapes: int | None = None, budget_s: float | None = None,
           **model_options: Any) -> list[Row]:
    from kernels.cuda import conv as cuda_conv
    from kernels.cuda import gemm
    from kernels.reference import TABLE as REFERENCE

    xp = np
    if not dry:
        import cupy as xp
    timer = _timer(dry)
    rng = np.random.default_rng(0)
    rows: dict[str, Row] = {}
    # Every distinct GEMM of the models' steps, largest first, so a search cut short by its time budget has
    # spent it where the step's time is.
    todo: list[tuple[float, str, str, ConvCall, Any, Any]] = []
    for model in models:
        for call in step_conv_calls(model, batch, image_size, **model_options):
            g = cuda_conv.conv_geometry(call.x_shape, call.w_shape, call.stride, call.pad, call.groups)
            if g.direct:
                continue
            shape = g.gemm(call.direction)
            key = gemm.shape_key(shape.op, shape.M, shape.N, shape.K, shape.z)
            if key not in {t[2] for t in todo}:
                todo.append((2.0 * shape.M * shape.N * shape.K * shape.z, model, key, call, g, shape))
    todo.sort(key=lambda t: -t[0])
    if max_shapes is not None:
        todo = todo[:max_shapes]
    start = time.perf_counter()
    for flops, model, key, call, g, shape in todo:
        if budget_s is not None and time.perf_counter() - start > budget_s:
            log(f"time budget of {budget_s:.0f} s spent: {len(todo) - len(rows)} smaller shapes keep the default")
            break
        row = rows[key] = Row(key, model, call.direction,
                              f"x{call.x_shape} w{call.w_shape} s{call.stride} p{call.pad} g{call.groups}",
                              flops / 1e9)
        x_h = rng.standard_normal(call.x_shape).astype(np.float32)
        w_h = rng.standard_normal(call.w_shape).astype(np.float32)
        out_shape = (g.N, g.K, g.OH, g.OW)
        d_h = rng.standard_normal(out_shape).astype(np.float32)
        args = (call.stride, call.pad, call.groups)
        inputs, out_h = {"forward": ((x_h, w_h), np.empty(out_shape, np.float32)),
                         "data": ((d_h, w_h), np.empty(call.x_shape, np.float32)),
                         "weight": ((x_h, d_h), np.empty(call.w_shape, np.float32))}[call.direction]
        a, b = (xp.asarray(v) for v in inputs)
        out = xp.asarray(out_h)

        def run(scratch: Any, a: Any = a, b: Any = b, out: Any = out, direction: str = call.direction,
                args: tuple[int, int, int] = args) -> None:
            if direction == "forward":
                cuda_conv.conv2d_forward(a, b, None, out, *args, scratch)
            elif direction == "data":
                cuda_conv.conv2d_backward_data(a, b, out, *args, scratch)
            else:
                cuda_conv.conv2d_backward_weight(a, b, out, None, *args, scratch)

        candidates = [(name, s) for name in configs for s in split_options(
            shape.K, cuda_conv.split_rule(shape.M, shape.N, shape.K, shape.z), dry)]
        default = (gemm.DEFAULT_CONFIG if gemm.DEFAULT_CONFIG in configs else next(iter(configs)),
                   cuda_conv.split_rule(shape.M, shape.N, shape.K, shape.z))
        if default not in candidates:
            candidates.append(default)
        candidates.remove(default)
        candidates.insert(0, default)  # first: the others are checked against its result
        expected = scale = None
        if dry:  # tiny: the NumPy reference itself (on a GPU the acceptance run checks the table's choices)
            expected = np.empty_like(out_h)
            if call.direction == "forward":
                REFERENCE["conv2d_forward"](x_h, w_h, None, expected, *args)
            elif call.direction == "data":
                REFERENCE["conv2d_backward_data"](d_h, w_h, expected, *args)
            else:
                REFERENCE["conv2d_backward_weight"](x_h, d_h, expected, None, *args)
            scale = max(1.0, float(np.abs(expected).max()))
        for name, splits in candidates:
            with gemm.forced_choice(configs[name], splits):
                size = g.scratch_size(call.direction)
                scratch = xp.empty(max(size, 1), np.float32) if size else None
                out.fill(np.nan)
                run(scratch)
                got = (out.get() if hasattr(out, "get") else np.array(out)).astype(np.float64)
                if expected is None:  # the default's result, the reference for the other candidates
                    expected, scale = got, max(1.0, float(np.nanmax(np.abs(got))))
                error = float(np.abs(got - expected).max()) / scale
                row.max_error = max(row.max_error, error)
                if not error < 1e-3:
                    log(f"  {key} {name}/{splits}: WRONG (error {error:.2e}), not a candidate")
                    continue
                ms = timer(lambda scratch=scratch: run(scratch), repeat)
            tflops = flops / ms / 1e9
            row.tried[f"{name}/{splits}"] = round(tflops, 3)
            if (name, splits) == default:
                row.default_tflops = tflops
            if tflops > row.best_tflops:
                row.best_config, row.best_splits, row.best_tflops = name, splits, tflops
        if not dry:
            A = xp.asarray(rng.standard_normal((shape.z, shape.M, shape.K)).astype(np.float32))
            B = xp.asarray(rng.standard_normal((shape.z, shape.K, shape.N)).astype(np.float32))
            C = xp.empty((shape.z, shape.M, shape.N), np.float32)
            row.cublas_tflops = flops / timer(lambda A=A, B=B, C=C: xp.matmul(A, B, out=C), repeat) / 1e9
        log(f"  {key}: best {row.best_config}/{row.best_splits} {row.best_tflops:.2f} TFLOP/s "
            f"(default {row.default_tflops:.2f}, cuBLAS {row.cublas_tflops or 0:.2f})")
    return list(rows.values())


def table_from(rows: list[Row], device: str, default: str) -> dict[str, Any]:
    return {
        "about": "GEMM tile choice per shape for kernels/cuda/gemm.py (v4), measured by benchmarks/gpu_tile_search.py; "
                 "keys are op:MxNxK:z (z = groups x phases).",
        "device": device,
        "default": default,
        "entries": {r.key: {"config": r.best_config, "splits": r.best_splits,
                            "tflops": round(r.best_tflops, 3),
                            "cublas_tflops": None if r.cublas_tflops is None else round(r.cublas_tflops, 3)}
                    for r in rows if r.best_config},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["resnet18", "mobilenetv2"])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--configs", nargs="*", help="candidate names (default: all of gemm.CANDIDATES)")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--output", default="gemm_table.json", help="the table file to write (commit it)")
    parser.add_argument("--results", default="tile_search.json", help="every shape's figures")
    parser.add_argument("--max-shapes", type=int, help="only the largest N GEMM shapes")
    parser.add_argument("--budget-s", type=float, help="stop starting new shapes after this many seconds")
    parser.add_argument("--plain", type=int, nargs="*", default=[2048, 4096],
                        help="square GEMM sizes timed on every candidate beside cuBLAS first (none: skip)")
    parser.add_argument("--dry", action="store_true", help="under the CUDA simulator at tiny sizes")
    options = parser.parse_args(argv)
    if options.dry:
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
        if "numba" in sys.modules:
            from numba import config

            if not config.ENABLE_CUDASIM:
                print("error: --dry needs NUMBA_ENABLE_CUDASIM=1 before numba is imported", file=sys.stderr)
                return 2
    from kernels.cuda import gemm

    if options.dry:
        configs = {"8x8k8t2x2": gemm.SIMULATOR_CONFIG}
        models, batch, image, model_options = ["cnn"], 2, 4, {"width": 2}
        repeat = 1
    else:
        names = options.configs or list(gemm.CANDIDATES)
        configs = {n: gemm.CANDIDATES[n] for n in names}
        models, batch, image, model_options = options.models, options.batch_size, options.image_size, {}
        repeat = options.repeat
    device = "CUDA simulator (dry run: simulator tiles, not a table to commit)"
    if not options.dry:
        import cupy

        device = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    start = time.perf_counter()
    print(f"tile search on {device}: {len(configs)} configs, models {', '.join(models)}, batch {batch}")
    plain = plain_gemms([8] if options.dry and options.plain else options.plain, configs, repeat, options.dry)
    budget = None if options.budget_s is None else max(0.0, options.budget_s - (time.perf_counter() - start))
    rows = search(models, batch, image, configs, repeat, options.dry, max_shapes=options.max_shapes,
                  budget_s=budget, **model_options)
    default = max(configs, key=lambda n: sum(r.tried.get(f"{n}/{r.best_splits}", 0.0) for r in rows))
    table = table_from(rows, device, default if not options.dry else gemm.DEFAULT_CONFIG)
    for path, payload in ((options.output, table),
                          (options.results, {"device": device, "seconds": time.perf_counter() - start,
                                             "plain": [asdict(p) for p in plain],
                                             "rows": [asdict(r) for r in rows]})):
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(payload, handle, indent=1)
    ratios = [r.best_tflops / r.cublas_tflops for r in rows if r.cublas_tflops]
    summary = f"{len(rows)} GEMM shapes in {time.perf_counter() - start:.0f} s; table written to {options.output}"
    if ratios:
        summary += f"; best / cuBLAS: median {float(np.median(ratios)):.2f}, min {min(ratios):.2f}"
    for size in sorted({p.size for p in plain}):
        best = max((p for p in plain if p.size == size), key=lambda p: p.tflops)
        summary += f"; plain {size}^3: best {best.config} {best.tflops:.2f} TFLOP/s"
        if best.cublas_tflops:
            summary += f" = {best.tflops / best.cublas_tflops:.2f} of cuBLAS"
    print(summary)
    return 0 if all(r.best_config for r in rows) and all(p.tflops > 0 for p in plain) else 1


if __name__ == "__main__":
    sys.exit(main())

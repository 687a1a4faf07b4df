"""How much each CPU conv path rounds, against float64, beside what it costs (issue 32, ``ENGINE_CONV``).

    python benchmarks/conv_precision.py                        # the error table (any machine, any load)
    python benchmarks/conv_precision.py --time                 # and each path's time at batch 32 (quiet machine)
    python benchmarks/conv_precision.py --gradients            # one ResNet-18 step's gradients vs float64, per mode
    python benchmarks/conv_precision.py --gradients --modes auto weight4 data4 exact --seeds 1 2 3   # and mixes
    python benchmarks/conv_precision.py --gradients --modes auto weight4 --grad-image-size 224 --grad-batch 8
    python benchmarks/conv_precision.py --routes --modes auto weight4 data4 exact   # the F(4×4) kernels each gives up

**The table.** ResNet-18's 3×3 layers (CIFAR 32×32 and ImageNet 224×224 planes), stride 1 and 2, and the stems:
for each direction and each ``ENGINE_CONV`` mode (``kernels.cpu.conv.CONV_MODES``), the path the kernel table
takes and its relative error ‖y − y₆₄‖ / ‖y₆₄‖ against the float64 NumPy reference (``kernels.reference.conv``),
at ``--batch`` images (2) of post-ReLU-like inputs (|N(0, 1)| half zero) and He-scaled weights; ``gemm32`` is a
float32 im2col GEMM on the same data (``kernels.reference.conv.gemm32``), the level the float32 paths are held to;
``torch32`` is PyTorch's float32 where torch imports. Errors do not depend on the machine's load; ``--time``
adds the best of ``--repeat`` calls at ``--time-batch`` (32) images per (shape, direction, mode), which does.

**The gradients.** One training step of ResNet-18 at ``--grad-batch`` (8) images of ``--grad-image-size`` (32: the
CIFAR variant; above 64 the ImageNet one, as ``engine train`` picks), in a subprocess per entry of ``--modes`` and
seed of ``--seeds``: the engine's gradients with that entry's conv paths (an ``ENGINE_CONV`` mode, a ``MIXES`` name
or ``MODE:flag=0,...``, made the kernel table's by ``conv.use_paths``), then the PyTorch twin
(``tests/models/torch_models.py``) in float64 and in float32, both made to follow the engine's side of every
ReLU kink (its own masks), so that what is compared is rounding, not a flipped mask. Printed: the relative error
of all gradients together (‖g − g₆₄‖ / ‖g₆₄‖ over the concatenation) and of the worst tensor, the engine's and
PyTorch float32's, and their ratio (issue 32's goal: ≤ 2×), plus how many ReLU inputs the engine, and PyTorch
float32 given the same masks upstream, put on the other side of 0 than float64 does ("flips"; max-pool winners
are not forced: the ImageNet stem's are float32-GEMM-level in every mode).

**The routes.** ``--routes``: for each ResNet-18 layer and direction at 32 and 224 where ``auto`` or a mix of
``--modes`` takes an F(4×4) kernel, the path each takes and the calls per step (``conv_ab.layer_calls``), and per mix
the F(4×4) calls it keeps: what a mix gives up, for the lead to time (``bench_train --conv-paths``, ``conv_ab --set``).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

# (name, C, K, plane, stride): ResNet-18's 3×3 convolutions, CIFAR then ImageNet planes; the stems
SHAPES = [
    ("64 @32", 64, 64, 32, 1), ("128 @16", 128, 128, 16, 1), ("256 @8", 256, 256, 8, 1), ("512 @4", 512, 512, 4, 1),
    ("64 @56", 64, 64, 56, 1), ("128 @28", 128, 128, 28, 1), ("256 @14", 256, 256, 14, 1), ("512 @7", 512, 512, 7, 1),
    ("64→128 s2 @32", 64, 128, 32, 2), ("128→256 s2 @16", 128, 256, 16, 2), ("256→512 s2 @8", 256, 512, 8, 2),
    ("64→128 s2 @56", 64, 128, 56, 2), ("128→256 s2 @28", 128, 256, 28, 2), ("256→512 s2 @14", 256, 512, 14, 2),
    ("stem 3→64 @32", 3, 64, 32, 1),
]
DIRECTIONS = ("forward", "data", "weight")


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    """‖got − want‖₂ / ‖want‖₂ in float64."""
    want = np.asarray(want, np.float64)
    return float(np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want))


def case(c: int, k: int, plane: int, stride: int, batch: int, seed: int = 0):
    """x (post-ReLU-like), w (He-scaled), dout (N(0, 1)) for one layer."""
    rng = np.random.default_rng(seed)
    x = np.maximum(rng.standard_normal((batch, c, plane, plane)), 0).astype(np.float32)
    w = (rng.standard_normal((k, c, 3, 3)) * np.sqrt(2.0 / (9 * c))).astype(np.float32)
    out = (plane - 1) // stride + 1
    dout = rng.standard_normal((batch, k, out, out)).astype(np.float32)
    return x, w, dout


def reference64(direction: str, x, w, dout, stride: int) -> np.ndarray:
    from kernels.reference import conv as ref

    if direction == "forward":
        out = np.zeros(dout.shape)
        ref.conv2d_forward(x, w, None, out, stride, 1, 1)
    elif direction == "data":
        out = np.zeros(x.shape)
        ref.conv2d_backward_data(dout, w, out, stride, 1, 1)
    else:
        out = np.zeros(w.shape)
        ref.conv2d_backward_weight(x, dout, out, None, stride, 1, 1)
    return out


def run_path(direction: str, x, w, dout, stride: int, paths) -> np.ndarray:
    """One direction through ``kernels.cpu.conv`` with ``paths`` (the table's entry with a mode's paths)."""
    from kernels.cpu import conv

    size = conv.workspace_size(x.shape, w.shape, stride, 1, 1, direction, paths)
    scratch = np.empty(max(size, 1), np.float32)
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


def torch32(direction: str, x, w, dout, stride: int) -> np.ndarray | None:
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(1)
    xt, wt, dt = (torch.from_numpy(a) for a in (x, w, dout))
    if direction == "forward":
        return torch.nn.functional.conv2d(xt, wt, None, stride, 1).numpy()
    if direction == "data":
        return torch.nn.grad.conv2d_input(x.shape, wt, dt, stride, 1).numpy()
    return torch.nn.grad.conv2d_weight(xt, w.shape, dt, stride, 1).numpy()


def _best_ms(call, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def error_rows(batch: int, time_batch: int | None, repeat: int, shapes=SHAPES):
    """One row per (shape, direction): the gemm32 and torch32 errors, and per mode its path, error (and ms)."""
    from kernels.cpu import conv
    from kernels.reference import conv as ref

    for name, c, k, plane, stride in shapes:
        x, w, dout = case(c, k, plane, stride, batch)
        for direction in DIRECTIONS:
            if direction == "data" and c < 8:
                continue  # a stem's backward-data is never called (the network's input has no gradient)
            want = reference64(direction, x, w, dout, stride)
            a, b = {"forward": (x, w), "data": (dout, w), "weight": (x, dout)}[direction]
            row = {"shape": name, "direction": direction,
                   "gemm32": relative_error(ref.gemm32(direction, x.shape, w.shape, stride, 1, a, b), want)}
            t32 = torch32(direction, x, w, dout, stride)
            row["torch32"] = None if t32 is None else relative_error(t32, want)
            for mode in conv.CONV_MODES:
                paths = conv.paths_for(mode)
                kind = conv.path(x.shape, w.shape, stride, 1, 1, direction, paths)
                got = run_path(direction, x, w, dout, stride, paths)
                row[mode] = {"path": kind, "error": relative_error(got, want)}
                if time_batch:
                    big = case(c, k, plane, stride, time_batch, seed=1)
                    call = functools.partial(run_path, direction, *big, stride, paths)
                    call()  # compile / warm
                    row[mode]["ms"] = _best_ms(call, repeat)
            yield row


def print_table(rows, timed: bool) -> None:
    from kernels.cpu import conv

    head = "| layer | direction | gemm32 | torch32 |" + "".join(
        f" {m}: path | error (×gemm32) |" + (" ms |" if timed else "") for m in conv.CONV_MODES)
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for row in rows:
        cells = [row["shape"], row["direction"], f"{row['gemm32']:.2e}",
                 "-" if row["torch32"] is None else f"{row['torch32']:.2e}"]
        for mode in conv.CONV_MODES:
            r = row[mode]
            cells += [r["path"], f"{r['error']:.2e} ({r['error'] / row['gemm32']:.1f}×)"]
            if timed:
                cells.append(f"{r['ms']:.2f}")
        print("| " + " | ".join(cells) + " |", flush=True)


# ----------------------------------------------------------------------------------------------
# One ResNet-18 step's gradients against float64, with the engine's own ReLU masks
# ----------------------------------------------------------------------------------------------


MIXES = {
    "data4": {"winograd4_weight": False, "winograd4_weight_by_k": False},
    "weight4": {"winograd4": False, "winograd4_by_k": False},
}
"""Named mixes of paths that are no ``ENGINE_CONV`` mode, each ``auto``'s paths with these ``conv.Paths`` flags off:
``data4`` F(4×4) in backward-data only (the weight gradient on F(2×2) or the shifted GEMMs, as ``exact``), ``weight4``
F(4×4) in the weight gradient only (backward-data as ``exact``). Forwards are float32-GEMM-level in both."""


def mix_paths(spec: str):
    """``conv.Paths`` for ``spec``: a mode (``CONV_MODES``), a ``MIXES`` name, or either followed by
    ``:flag=0,flag=1`` (e.g. ``auto:winograd4_weight_by_k=0``: ``auto`` with the by-k F(4×4) weight gradient off)."""
    import dataclasses

    from kernels.cpu import conv

    base, _, flags = spec.partition(":")
    if base in MIXES:
        paths = dataclasses.replace(conv.paths_for("auto"), **MIXES[base])
    elif base in conv.CONV_MODES:
        paths = conv.paths_for(base)
    else:
        raise SystemExit(f"{spec!r}: {base!r} is none of the modes ({', '.join(conv.CONV_MODES)}) or mixes "
                         f"({', '.join(MIXES)})")
    changes = {}
    for item in filter(None, flags.split(",")):
        name, _, value = item.partition("=")
        if name not in {f.name for f in dataclasses.fields(conv.Paths)}:
            raise SystemExit(f"{spec!r}: {name!r} is not a conv.Paths flag")
        changes[name] = value.strip() not in ("0", "false", "False")
    return dataclasses.replace(paths, **changes)


def resnet_twin(variant: str):
    """The PyTorch twin of the engine's ResNet-18 (``variant`` cifar or imagenet), activations as modules."""
    sys.path.insert(0, str(ROOT / "tests" / "models"))
    from torch_models import TORCH_MODELS, ResNet18ImageNet

    return ResNet18ImageNet(10) if variant == "imagenet" else TORCH_MODELS["resnet18"](10)


def engine_network(backend, image_size: int, variant: str | None = None):
    """The engine's ResNet-18 for ``gradient_errors``, unchunked: each ReLU its own node, whose output (the mask the
    forward decided) the twin is given by name. At 224 the chunked layers would hold the stem's and layer1's ReLUs
    inside them (the same weights and bits either way)."""
    from models import build_model

    return build_model("resnet18", num_classes=10, backend=backend, seed=0, image_size=image_size, variant=variant,
                       chunkable=False)


def gradient_errors(spec: str, batch: int, image_size: int = 32, variant: str | None = None, seed: int = 1) -> dict:
    """In this process, with ``mix_paths(spec)`` as the kernel table's paths: the errors of one ResNet-18 step's
    gradients (``variant`` by ``image_size`` as ``engine train`` picks it), the engine's and PyTorch float32's."""
    sys.path.insert(0, str(ROOT / "tests" / "models"))
    import torch
    from torch_models import MaxPool, ReLU

    from engine.backend import get_backend
    from kernels.cpu import conv
    from models import resolve_variant

    variant = resolve_variant("resnet18", variant, image_size)
    conv.use_paths(mix_paths(spec))
    torch.set_num_threads(1)
    backend = get_backend("cpu")
    net = engine_network(backend, image_size, variant)
    state = {k: torch.from_numpy(np.array(v)) for k, v in net.state_dict().items()}
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, 3, image_size, image_size)).astype(np.float32)
    labels = rng.integers(0, 10, batch).astype(np.int64)

    outputs: dict[str, np.ndarray] = {}
    winners: dict[str, np.ndarray] = {}  # each max pool's argmax: the window places (uint8) it chose

    class Recorder:
        def after_forward(self, step, node):
            if "out" in node.layer.saved and type(node.layer).__name__ == "ReLU":
                outputs[node.name] = np.array(backend.to_host(node.layer.saved["out"].array))
            if type(node.layer).__name__ == "MaxPool2d":
                argmax = np.array(backend.to_host(node.layer.saved["argmax"].array))
                assert argmax.dtype == np.uint8, "the twin reads window places (3×3 windows), not plane indices"
                winners[node.name] = argmax

    net.hooks.append(Recorder())
    net.forward(x, training=True)
    net.loss(labels)
    net.backward()
    ours = {name: np.array(g, np.float64) for name, g in net.gradients.views.items()}
    net.close()

    def twin_gradients(dtype) -> tuple[dict, dict]:
        twin = resnet_twin(variant)
        twin.load_state_dict(state, strict=True)
        twin = twin.to(dtype).train()
        relus = {name: m for name, m in twin.named_modules() if isinstance(m, ReLU)}
        for name, module in relus.items():
            module.decided = torch.from_numpy(outputs[name]).to(dtype)
        pools = {name: m for name, m in twin.named_modules() if isinstance(m, MaxPool)}
        assert set(pools) == set(winners), (sorted(pools), sorted(winners))
        for name, module in pools.items():
            module.decided = torch.from_numpy(winners[name].astype(np.int64))
        loss = torch.nn.functional.cross_entropy(twin(torch.from_numpy(x).to(dtype)), torch.from_numpy(labels))
        loss.backward()
        grads = {name: p.grad.double().numpy() for name, p in twin.named_parameters()}
        return (grads, {name: m.seen_input.double().numpy() for name, m in relus.items()},
                {name: m.winners(m.seen_input).numpy() for name, m in pools.items()})

    exact, inputs, exact_winners = twin_gradients(torch.float64)
    theirs, their_inputs, their_winners = twin_gradients(torch.float32)
    flips = sum(int(np.sum((inputs[n] > 0) != (outputs[n] > 0))) for n in outputs)
    # PyTorch float32's own sides of 0 against float64's, given the same (engine's) masks upstream
    torch_flips = sum(int(np.sum((inputs[n] > 0) != (their_inputs[n] > 0))) for n in outputs)
    # the same for the max pools' winners: where float64 given the engine's inputs upstream would pick another
    pool_flips = sum(int(np.sum(exact_winners[n] != winners[n])) for n in winners)
    torch_pool_flips = sum(int(np.sum(exact_winners[n] != their_winners[n])) for n in winners)

    def summary(grads: dict) -> dict:
        names = list(exact)
        diff = np.sqrt(sum(float(np.sum((grads[n] - exact[n]) ** 2)) for n in names))
        norm = np.sqrt(sum(float(np.sum(exact[n] ** 2)) for n in names))
        worst = max(names, key=lambda n: relative_error(grads[n], exact[n]) if np.any(exact[n]) else 0.0)
        return {"all": diff / norm, "worst": relative_error(grads[worst], exact[worst]), "worst_name": worst}

    return {"mix": spec, "batch": batch, "image_size": image_size, "variant": variant, "seed": seed, "flips": flips,
            "torch_flips": torch_flips, "pool_flips": pool_flips, "torch_pool_flips": torch_pool_flips,
            "relu_inputs": sum(int(v.size) for v in outputs.values()),
            "engine": summary(ours), "torch32": summary(theirs)}


def gradients_table(mixes, batch: int, image_size: int = 32, variant: str | None = None, seeds=(1,)) -> None:
    """One row per (mix, seed), each in a fresh process (one network's kernels and plan at a time)."""
    print("| paths | batch | image | seed | flips: engine / torch32 (of ReLU inputs) | engine: all | torch32: all | "
          "ratio | engine: worst tensor | torch32: worst tensor |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for spec in mixes:
        for seed in seeds:
            command = [sys.executable, __file__, "--gradients-worker", spec, "--grad-batch", str(batch),
                       "--grad-image-size", str(image_size), "--seed", str(seed)]
            if variant:
                command += ["--variant", variant]
            env = dict(os.environ, PYTHONPATH=str(ROOT))
            done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True)
            if done.returncode != 0:
                sys.exit(f"{spec}: the gradient worker failed:\n{done.stderr}")
            r = json.loads(done.stdout.strip().splitlines()[-1])
            e, t = r["engine"], r["torch32"]
            pools = f"; max pool {r['pool_flips']} / {r['torch_pool_flips']}" if r["variant"] == "imagenet" else ""
            print(f"| {spec} | {batch} | {image_size} ({r['variant']}) | {seed} | {r['flips']} / {r['torch_flips']} "
                  f"({r['relu_inputs']:,}){pools} | {e['all']:.2e} | {t['all']:.2e} | {e['all'] / t['all']:.2f}× | "
                  f"{e['worst']:.2e} ({e['worst_name']}) | {t['worst']:.2e} ({t['worst_name']}) |", flush=True)


# ----------------------------------------------------------------------------------------------
# Which F(4×4) kernels a mix gives up, layer by layer (what the lead times)
# ----------------------------------------------------------------------------------------------

WINOGRAD4 = ("winograd4", "winograd4-by-k", "winograd4-weight-by-k")


def routes_table(mixes, sizes=(32, 224), batch: int = 32, models=("resnet18",)) -> None:
    """For every conv layer of ``models`` at each image size (``conv_ab.layer_calls``: the variant ``engine train``
    picks, each direction training runs, how often per step) where ``auto`` or a mix takes an F(4×4) kernel: the path
    under each. The last rows count, per mix, the F(4×4) calls per step it keeps: what the lead's timing weighs."""
    from conv_ab import layer_calls

    from kernels.cpu import conv

    sides = {"auto": conv.paths_for("auto"), **{m: mix_paths(m) for m in mixes if m != "auto"}}
    print("| model | image | layer | direction | calls/step | " + " | ".join(sides) + " |")
    print("|---|---|---|---|---|" + "---|" * len(sides))
    for size in sizes:
        kept = dict.fromkeys(sides, 0)
        for key, count in layer_calls(models, size, batch).items():
            model, x_shape, w_shape, stride, pad, groups, direction = key
            kinds = [conv.path(x_shape, w_shape, stride, pad, groups, direction, p) for p in sides.values()]
            if not any(k in WINOGRAD4 for k in kinds):
                continue
            for name, kind in zip(sides, kinds):
                kept[name] += count * (kind in WINOGRAD4)
            label = f"{w_shape[1] * groups}->{w_shape[0]} {w_shape[2]}x{w_shape[3]} s{stride} @{x_shape[2]}"
            print(f"| {model} | {size} | {label} | {direction} | {count} | " + " | ".join(kinds) + " |", flush=True)
        print(f"| {'/'.join(models)} | {size} | F(4×4) calls per step | | | "
              + " | ".join(str(kept[name]) for name in sides) + " |")


def main() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=2, help="images for the errors")
    parser.add_argument("--time", action="store_true", help="also time each path (a quiet machine only)")
    parser.add_argument("--time-batch", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=7, help="calls per timing; the best is kept")
    parser.add_argument("--threads", type=int, default=None, help="Numba threads (default: all)")
    parser.add_argument("--gradients", action="store_true", help="the ResNet-18 step's gradients instead")
    parser.add_argument("--modes", nargs="+", default=None, metavar="PATHS",
                        help="--gradients / --routes: modes, MIXES names or MODE:flag=0,... (default: the modes)")
    parser.add_argument("--grad-batch", type=int, default=8)
    parser.add_argument("--grad-image-size", type=int, default=32, help="above 64: the ImageNet variant")
    parser.add_argument("--variant", choices=("cifar", "imagenet"), default=None)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1], help="the batch's seeds, a row each")
    parser.add_argument("--seed", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--routes", action="store_true",
                        help="which F(4×4) kernels each of --modes gives up, per ResNet-18 layer at 32 and 224")
    parser.add_argument("--gradients-worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--shapes", nargs="*", default=None, help="only the layers whose name contains one of these")
    args = parser.parse_args()
    if args.threads:
        import numba

        numba.set_num_threads(args.threads)
    from kernels.cpu.conv import CONV_MODES

    mixes = args.modes or list(CONV_MODES)
    if args.gradients_worker:
        print(json.dumps(gradient_errors(args.gradients_worker, args.grad_batch, args.grad_image_size, args.variant,
                                         args.seed)))
        return
    for spec in mixes:
        mix_paths(spec)  # a wrong name fails here, before any run
    if args.routes:
        routes_table(mixes)
        return
    if args.gradients:
        gradients_table(mixes, args.grad_batch, args.grad_image_size, args.variant, args.seeds)
        return
    shapes = [s for s in SHAPES if not args.shapes or any(p in s[0] for p in args.shapes)]
    print_table(error_rows(args.batch, args.time_batch if args.time else None, args.repeat, shapes), args.time)


if __name__ == "__main__":
    main()

"""How much each CPU conv path rounds, against float64, beside what it costs (issue 32, ``ENGINE_CONV``).

    python benchmarks/conv_precision.py                        # the error table (any machine, any load)
    python benchmarks/conv_precision.py --time                 # and each path's time at batch 32 (quiet machine)
    python benchmarks/conv_precision.py --gradients            # one ResNet-18 step's gradients vs float64, per mode

**The table.** ResNet-18's 3×3 layers (CIFAR 32×32 and ImageNet 224×224 planes), stride 1 and 2, and the stems:
for each direction and each ``ENGINE_CONV`` mode (``kernels.cpu.conv.CONV_MODES``), the path the kernel table
takes and its relative error ‖y − y₆₄‖ / ‖y₆₄‖ against the float64 NumPy reference (``kernels.reference.conv``),
at ``--batch`` images (2) of post-ReLU-like inputs (|N(0, 1)| half zero) and He-scaled weights; ``gemm32`` is a
float32 im2col GEMM on the same data (``kernels.reference.conv.gemm32``), the level the float32 paths are held to;
``torch32`` is PyTorch's float32 where torch imports. Errors do not depend on the machine's load; ``--time``
adds the best of ``--repeat`` calls at ``--time-batch`` (32) images per (shape, direction, mode), which does.

**The gradients.** One training step of the CIFAR ResNet-18 at ``--grad-batch`` (8) images, in a subprocess per
mode (``ENGINE_CONV`` is read once per process): the engine's gradients, then the PyTorch twin
(``tests/models/torch_models.py``) in float64 and in float32, both made to follow the engine's side of every
ReLU kink (its own masks), so that what is compared is rounding, not a flipped mask. Printed: the relative error
of all gradients together (‖g − g₆₄‖ / ‖g₆₄‖ over the concatenation) and of the worst tensor, the engine's and
PyTorch float32's, and their ratio (issue 32's goal: ≤ 2×), plus how many ReLU inputs the engine put on the other
side of 0 than float64 does ("flips").
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


def gradient_errors(batch: int, seed: int = 1) -> dict:
    """In this process (its ``ENGINE_CONV``): the errors of one CIFAR ResNet-18 step's gradients."""
    sys.path.insert(0, str(ROOT / "tests" / "models"))
    import torch
    from torch_models import TORCH_MODELS, ReLU

    from engine.backend import get_backend
    from kernels.cpu import conv
    from models import build_model

    torch.set_num_threads(1)
    backend = get_backend("cpu")
    net = build_model("resnet18", num_classes=10, backend=backend, seed=0)
    state = {k: torch.from_numpy(np.array(v)) for k, v in net.state_dict().items()}
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, 3, 32, 32)).astype(np.float32)
    labels = rng.integers(0, 10, batch).astype(np.int64)

    outputs: dict[str, np.ndarray] = {}

    class Recorder:
        def after_forward(self, step, node):
            if "out" in node.layer.saved and type(node.layer).__name__ == "ReLU":
                outputs[node.name] = np.array(backend.to_host(node.layer.saved["out"].array))

    net.hooks.append(Recorder())
    net.forward(x, training=True)
    net.loss(labels)
    net.backward()
    ours = {name: np.array(g, np.float64) for name, g in net.gradients.views.items()}
    net.close()

    def twin_gradients(dtype) -> tuple[dict, dict]:
        twin = TORCH_MODELS["resnet18"](10)
        twin.load_state_dict(state, strict=True)
        twin = twin.to(dtype).train()
        relus = {name: m for name, m in twin.named_modules() if isinstance(m, ReLU)}
        for name, module in relus.items():
            module.decided = torch.from_numpy(outputs[name]).to(dtype)
        loss = torch.nn.functional.cross_entropy(twin(torch.from_numpy(x).to(dtype)), torch.from_numpy(labels))
        loss.backward()
        grads = {name: p.grad.double().numpy() for name, p in twin.named_parameters()}
        return grads, {name: m.seen_input.double().numpy() for name, m in relus.items()}

    exact, inputs = twin_gradients(torch.float64)
    theirs, _ = twin_gradients(torch.float32)
    flips = sum(int(np.sum((inputs[n] > 0) != (outputs[n] > 0))) for n in outputs)

    def summary(grads: dict) -> dict:
        names = list(exact)
        diff = np.sqrt(sum(float(np.sum((grads[n] - exact[n]) ** 2)) for n in names))
        norm = np.sqrt(sum(float(np.sum(exact[n] ** 2)) for n in names))
        worst = max(names, key=lambda n: relative_error(grads[n], exact[n]) if np.any(exact[n]) else 0.0)
        return {"all": diff / norm, "worst": relative_error(grads[worst], exact[worst]), "worst_name": worst}

    return {"mode": conv.MODE, "batch": batch, "flips": flips, "engine": summary(ours), "torch32": summary(theirs)}


def gradients_table(batch: int) -> None:
    from kernels.cpu.conv import CONV_MODES

    print("| ENGINE_CONV | flips vs float64 | engine: all | torch32: all | ratio | engine: worst tensor | "
          "torch32: worst tensor |")
    print("|---|---|---|---|---|---|---|")
    for mode in CONV_MODES:
        env = dict(os.environ, ENGINE_CONV=mode, PYTHONPATH=str(ROOT))
        done = subprocess.run([sys.executable, __file__, "--gradients-worker", "--grad-batch", str(batch)], env=env,
                              cwd=ROOT, check=True, capture_output=True, text=True)
        r = json.loads(done.stdout.strip().splitlines()[-1])
        e, t = r["engine"], r["torch32"]
        print(f"| {mode} | {r['flips']} | {e['all']:.2e} | {t['all']:.2e} | {e['all'] / t['all']:.2f}× | "
              f"{e['worst']:.2e} ({e['worst_name']}) | {t['worst']:.2e} ({t['worst_name']}) |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=2, help="images for the errors")
    parser.add_argument("--time", action="store_true", help="also time each path (a quiet machine only)")
    parser.add_argument("--time-batch", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=7, help="calls per timing; the best is kept")
    parser.add_argument("--threads", type=int, default=None, help="Numba threads (default: all)")
    parser.add_argument("--gradients", action="store_true", help="the ResNet-18 step's gradients instead")
    parser.add_argument("--grad-batch", type=int, default=8)
    parser.add_argument("--gradients-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--shapes", nargs="*", default=None, help="only the layers whose name contains one of these")
    args = parser.parse_args()
    if args.threads:
        import numba

        numba.set_num_threads(args.threads)
    if args.gradients_worker:
        print(json.dumps(gradient_errors(args.grad_batch)))
        return
    if args.gradients:
        gradients_table(args.grad_batch)
        return
    shapes = [s for s in SHAPES if not args.shapes or any(p in s[0] for p in args.shapes)]
    print_table(error_rows(args.batch, args.time_batch if args.time else None, args.repeat, shapes), args.time)


if __name__ == "__main__":
    main()

"""Workspace allocation against np.empty, the cost of validating a kernel argument, and whole-process peaks.

Run: python -m pytest benchmarks/bench_memory.py --benchmark-only

Whole process (issue 13, item 4: what a memory limit sees is the process):

    python benchmarks/bench_memory.py --process [--repeat 1] [--engine-path DIR ...]

runs the README's main command, ``engine train --model resnet18 --offload-n 4`` (digits, batch 32, one
epoch, then the evaluation of the test split), in a fresh process per run, and the same training and
evaluation in PyTorch (the model's twin from tests/models/torch_models.py with plain ``nn.ReLU``, SGD
momentum 0.9, lr 0.01, the same batches' shapes, evaluation under ``torch.no_grad()``), alternating.
The peak is the child's ``ru_maxrss`` as its parent's ``wait4`` reports it: the OS's figure, the one
``/usr/bin/time`` prints, not the engine's own. ``--engine-path`` puts another checkout first on
PYTHONPATH (the "before" of a change).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

from engine.backend import KernelTable, get_backend
from engine.memory import ArrayType, LearningPolicy, Workspace, WorkspaceConfig, WorkspaceManager, validation

CPU = get_backend("cpu")

# Activations and scratch of a CIFAR ResNet-18 step at batch 32 (NCHW float32), one shape per size class.
LAYER_SHAPES = {
    "stem 32x64x32x32": (32, 64, 32, 32),
    "stage3 32x256x8x8": (32, 256, 8, 8),
    "fc 32x512": (32, 512),
    "bn stats 64": (64,),
}


def learned_workspace() -> Workspace:
    ws = Workspace(CPU, "bench", WorkspaceConfig(initial_size=64 << 20, learning=LearningPolicy.NONE))
    ws.enter()
    return ws


@pytest.mark.parametrize("shape", list(LAYER_SHAPES.values()), ids=list(LAYER_SHAPES))
def test_workspace_create(benchmark, shape):
    """One allocation from a learned block: bump the pointer, make a typed view, wrap it in a Tensor."""
    ws = learned_workspace()

    def allocate():
        ws._offset = ws._need = 0  # rewind (private): every round is the first allocation of a cycle
        return ws.create(shape, np.float32)

    benchmark(allocate)
    ws.leave()


@pytest.mark.parametrize("shape", list(LAYER_SHAPES.values()), ids=list(LAYER_SHAPES))
@pytest.mark.parametrize("source", ["workspace", "np.empty"])
def test_allocate_and_write(benchmark, shape, source):
    """Allocation plus a first write: fresh large arrays pay page faults; workspace memory is already mapped."""
    ws = learned_workspace()

    def from_workspace():
        ws._offset = ws._need = 0
        ws.create(shape, np.float32).array.fill(1.0)

    def from_numpy():
        np.empty(shape, np.float32).fill(1.0)

    benchmark(from_workspace if source == "workspace" else from_numpy)
    ws.leave()


@pytest.mark.parametrize("source", ["workspace", "np.empty"])
def test_one_cycle_of_four_layer_tensors(benchmark, source):
    """A cycle through the public API: reset, then one tensor of each typical shape."""
    ws = learned_workspace()
    shapes = list(LAYER_SHAPES.values())

    def workspace_cycle():
        ws.reset()
        return [ws.create(shape, np.float32) for shape in shapes]

    def numpy_cycle():
        return [np.empty(shape, np.float32) for shape in shapes]

    benchmark(workspace_cycle if source == "workspace" else numpy_cycle)
    ws.leave()


@pytest.mark.parametrize("shape", list(LAYER_SHAPES.values()), ids=list(LAYER_SHAPES))
def test_np_empty(benchmark, shape):
    benchmark(np.empty, shape, np.float32)


def test_manager_create_activation(benchmark):
    """The layer-facing call: ArrayType -> workspace lookup, then the workspace allocation."""
    mgr = WorkspaceManager(CPU, "training")
    shape = LAYER_SHAPES["stage3 32x256x8x8"]
    with mgr.iteration():
        mgr.create(ArrayType.ACTIVATIONS, shape)
    with mgr.iteration():  # learned: inside the block from here on
        ws = mgr.workspaces["activations"]

        def allocate():
            ws._offset = ws._need = 0
            return mgr.create(ArrayType.ACTIVATIONS, shape)

        benchmark(allocate)
    mgr.close()


def test_validate_one_argument(benchmark):
    """Tensor._kernel_array on a current tensor: the check every kernel argument pays."""
    ws = learned_workspace()
    t = ws.create((32, 64), np.float32)
    benchmark(t._kernel_array, "conv2d_forward", "argument 0")
    ws.leave()


def test_validate_one_argument_switched_off(benchmark):
    ws = learned_workspace()
    t = ws.create((32, 64), np.float32)
    with validation(False):
        benchmark(t._kernel_array, "conv2d_forward", "argument 0")
    ws.leave()


def _noop(*args):
    return None


@pytest.mark.parametrize("checked", [True, False], ids=["kernel-table", "raw"])
def test_kernel_call_with_eight_tensor_arguments(benchmark, checked):
    """A conv-like call through the KernelTable (validates and unwraps 8 tensors) against the raw function."""
    ws = learned_workspace()
    tensors = [ws.create((8, 8), np.float32) for _ in range(8)]
    table = KernelTable("bench", {"noop": _noop})
    if checked:
        benchmark(table.noop, *tensors)
    else:
        arrays = [t.array for t in tensors]
        benchmark(table.raw("noop"), *arrays)
    ws.leave()


# --- whole process: the README's main command against PyTorch ------------------------------------------

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def torch_worker(batch_size: int = 32, threads: int = 2) -> None:
    """ResNet-18 (CIFAR twin) on digits for one epoch, then the test split: the engine command's work."""
    import torch

    sys.path.insert(0, ROOT)
    from engine.data.datasets import digits
    from tests.models.torch_models import TORCH_MODELS

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    data = digits()
    net = TORCH_MODELS["resnet18"](num_classes=10)
    for parent in list(net.modules()):  # the twin's ReLU keeps its input for the parity tests: use torch's own
        for name, child in list(parent.named_children()):
            if type(child).__name__ == "ReLU":
                setattr(parent, name, torch.nn.ReLU())

    def normalized(x: np.ndarray) -> torch.Tensor:
        x = np.repeat(x.astype(np.float32), 3, axis=1) if x.shape[1] == 1 else x.astype(np.float32)
        return torch.from_numpy((x - data.mean[0]) / data.std[0])

    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    order = np.random.default_rng(0).permutation(len(data.y_train))
    net.train()
    for step in range(len(order) // batch_size):
        chosen = order[step * batch_size:(step + 1) * batch_size]
        x, y = normalized(data.x_train[chosen]), torch.from_numpy(data.y_train[chosen])
        opt.zero_grad(set_to_none=False)
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    net.eval()
    correct = 0
    with torch.no_grad():
        for start in range(0, len(data.y_test), batch_size):
            x = normalized(data.x_test[start:start + batch_size])
            correct += int((net(x).argmax(1).numpy() == data.y_test[start:start + batch_size]).sum())
    print(json.dumps({"test_accuracy": correct / len(data.y_test)}))


def measure(command: list[str], env: dict[str, str], cwd: str = ROOT) -> dict:
    """Run ``command`` in ``cwd`` (``python -c`` puts it first on sys.path: the checkout measured); its peak
    RSS from wait4 (bytes), wall seconds and the last line of its output."""
    with tempfile.TemporaryFile() as out:
        started = time.perf_counter()
        child = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        _, status, usage = os.wait4(child.pid, 0)
        child.returncode = os.waitstatus_to_exitcode(status)
        seconds = time.perf_counter() - started
        out.seek(0)
        text = out.read().decode(errors="replace")
    if child.returncode != 0:
        sys.exit(f"{' '.join(command)} failed:\n{text[-3000:]}")
    scale = 1 if sys.platform == "darwin" else 1024
    return {"peak_rss_bytes": usage.ru_maxrss * scale, "seconds": seconds, "output_tail": text.strip()[-400:]}


def process_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description="whole-process peak RSS: engine's README command vs PyTorch")
    parser.add_argument("--process", action="store_true")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--engine-path", action="append", default=[],
                        help="also measure the engine from this checkout (PYTHONPATH), e.g. the code before a change")
    parser.add_argument("--json", help="write the runs here")
    args = parser.parse_args(argv)
    engine_command = [sys.executable, "-c", "import sys; from cli import main; sys.exit(main())",
                      "train", "--model", "resnet18", "--offload-n", "4", "--no-progress"]
    runs = []
    for _ in range(args.repeat):
        for label, path in [("engine", ROOT)] + [(f"engine@{p}", p) for p in args.engine_path] + [("torch", ROOT)]:
            env = dict(os.environ, PYTHONPATH=path)
            command = engine_command if label != "torch" else [sys.executable, __file__, "--torch-worker"]
            result = measure(command, env, cwd=path)
            runs.append({"run": label, **result})
            print(f"{label:<40} peak RSS {result['peak_rss_bytes'] / 2**20:7.1f} MiB  {result['seconds']:6.1f} s",
                  flush=True)
    torch_peak = float(np.median([r["peak_rss_bytes"] for r in runs if r["run"] == "torch"]))
    for label in dict.fromkeys(r["run"] for r in runs if r["run"] != "torch"):
        peak = float(np.median([r["peak_rss_bytes"] for r in runs if r["run"] == label]))
        print(f"{label}: {peak / 2**20:.1f} MiB = {peak / torch_peak:.2f}x PyTorch's {torch_peak / 2**20:.1f} MiB "
              "(goal <= 0.5x)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(runs, handle, indent=2)


if __name__ == "__main__":
    if "--torch-worker" in sys.argv:
        torch_worker()
    else:
        process_main(sys.argv[1:])

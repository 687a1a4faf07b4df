"""Workspace allocation against np.empty, and the cost of validating a kernel argument.

Run: python -m pytest benchmarks/bench_memory.py --benchmark-only
"""

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

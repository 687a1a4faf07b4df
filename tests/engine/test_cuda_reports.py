"""The CUDA reports that need no GPU: launches per step, the roofline, and the acceptance's checker.

Launches are counted with the CUDA launchers under ``count_only`` on NumPy arrays (nothing runs), so
these run in the normal test process, at real batch sizes, in seconds.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from engine.backend import counting_backend, get_backend
from engine.bench.cuda_launches import count_step_launches, counted_step
from engine.bench.gpu_acceptance import ReferenceChecker
from engine.bench.roofline import DEVICES, launch_cost, step_roofline


@pytest.mark.parametrize("model, before", [("resnet18", 3876), ("mobilenetv2", 3649)])
def test_conv_launches_do_not_grow_with_the_batch(model, before):
    """Per-image conv launched im2col + GEMM per image: 3,876 (ResNet-18) and 3,649 (MobileNetV2)
    launches a step at batch 32. Batched, conv is one launch per direction (+ a split-K sum)."""
    small = count_step_launches(model, 4, counting_backend())
    large = count_step_launches(model, 32, counting_backend())
    # by direction: the GEMM table picks a tile per shape, so one direction's launches spread over several names
    directions = ("conv_forward", "conv_backward_data", "conv_backward_weight", "direct_conv_")

    def per_direction(launches):
        return [sum(n for k, n in launches.by_kernel.items() if k.startswith(d)) for d in directions]

    assert sum(per_direction(large)) and per_direction(large) == per_direction(small)
    # ResNet-18: 196, MobileNetV2: 412 (batch norm takes two launches each way on its channels of over 4,096
    # values, kernels/cuda/batchnorm.py: 20 and 38 more at batch 32 than at 4)
    assert large.total * 8 < before
    assert "im2col" not in large.by_kernel and "col2im" not in large.by_kernel


def test_roofline_counts_resnet18_flops():
    """Forward convs of CIFAR ResNet-18: 0.556 GMAC an image (the figure its papers report), so
    1.11 GFLOP; backward-weight the same; the step's time is the sum over launches, at least its parts."""
    step = step_roofline("resnet18", 32, counting_backend())
    forward = sum(r.flops for r in step.rows if r.kernel.startswith("conv_forward"))
    weight = sum(r.flops for r in step.rows if r.kernel.startswith("conv_backward_weight"))
    assert forward / 32 == pytest.approx(1.111e9, rel=0.01)
    assert weight == pytest.approx(forward, rel=1e-9)
    h100 = DEVICES[1].name
    assert step.seconds[h100] == pytest.approx(sum(r.seconds[h100] for r in step.rows))
    assert step.seconds[h100] >= forward * 3 / DEVICES[1].fp32_flops  # at least the conv FLOPs at peak
    bound = {r.kernel: r.bound[h100] for r in step.rows}
    conv_forward = next(k for k in bound if k.startswith("conv_forward_tiles_"))  # the GEMM table's default tile
    assert bound[conv_forward] == "compute" and bound["relu_forward_kernel"] == "bandwidth"


def test_launch_cost_of_an_elementwise_kernel():
    _, launches = counted_step("cnn", 2, counting_backend(), image_size=8)
    relu = next(launch for launch in launches if launch.kernel == "relu_forward_kernel")
    cost = launch_cost(relu)
    assert cost.bytes == 2 * 4 * 2 * 16 * 8 * 8  # read x, write out: float32, batch 2, 16 channels, 8×8
    assert cost.flops == 2 * 16 * 8 * 8


def test_cli_roofline_and_launches_as_json():
    result = CliRunner().invoke(
        __import__("cli").main,
        ["kernels", "--backend", "cuda", "--roofline", "--launches", "--models", "mobilenetv2", "--batch-size", "8",
         "--format", "json"],
    )
    assert result.exit_code == 0, result.output
    records = json.loads(result.output)
    launches = [r for r in records if r["report"] == "launches"]
    roofline = [r for r in records if r["report"] == "roofline"]
    assert [r["batch"] for r in roofline] == [8, 32] and launches[0]["launches"] == roofline[0]["launches"]
    assert all(r["predicted_step_seconds"][d.name] > 0 for r in roofline for d in DEVICES)


def test_cli_static_needs_the_cuda_backend():
    result = CliRunner().invoke(__import__("cli").main, ["kernels", "--static"])
    assert result.exit_code != 0 and "--backend cuda" in result.output


def test_reference_checker_catches_a_wrong_kernel():
    """The acceptance's checker flags a kernel that writes the wrong values (and passes a right one)."""
    from kernels.reference import TABLE

    checker = ReferenceChecker(get_backend("cpu"))
    x = np.linspace(-1, 1, 8, dtype=np.float32)

    def broken_relu(x, out):
        out[:] = np.abs(x)

    checker("relu_forward", broken_relu, (x, np.empty_like(x)), {})
    checker("relu_forward", TABLE["relu_forward"], (x[:4], np.empty(4, np.float32)), {})
    assert [c.ok for c in checker.checks] == [False, True]
    inplace = x.copy()  # out is x: the reference must see one array too
    checker("relu_forward", TABLE["relu_forward"], (inplace[:6], inplace[:6]), {})
    assert checker.checks[-1].ok


def test_the_cuda_kernel_table_counts_launches():
    from kernels.cuda import count_only, reset_launches

    table = counting_backend().kernels
    assert get_backend("cpu").kernels.launch_count() is None
    reset_launches()
    x = np.zeros((2, 3, 4, 4), np.float32)
    with count_only():
        table.relu_forward(x, x)
        table.conv2d_forward(x, np.zeros((5, 3, 3, 3), np.float32), None, np.zeros((2, 5, 4, 4), np.float32),
                             1, 1, 1, None)
    assert table.launch_count() == 2
    # a shape the table does not name runs its default (what the last GPU session measured best there)
    from kernels.cuda.gemm import gemm_table

    default = gemm_table()["default"].replace("-", "_")
    assert dict(table.launches) == {"relu_forward_kernel": 1, f"conv_forward_tiles_{default}": 1}
    reset_launches()

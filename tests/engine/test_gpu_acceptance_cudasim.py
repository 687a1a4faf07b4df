"""The GPU acceptance run (benchmarks/gpu_acceptance.sh) in the CUDA simulator at tiny shapes.

What a GPU run does, end to end: every CUDA kernel checked against the reference on a real step's
inputs, every launch of a step replayed and timed, `engine train` with and without offload.
Runs only in the process started with NUMBA_ENABLE_CUDASIM=1 (tests/run does that).
"""

import pytest

from engine.bench.gpu_acceptance import run_acceptance

pytestmark = pytest.mark.cudasim


def test_acceptance_passes_in_the_simulator():
    report = run_acceptance("cudasim", tiny=True, repeat=1, log=lambda message: None)
    assert report.failures == []
    assert report.uncovered == []
    assert {c.op for c in report.checks} >= {"conv2d_forward", "batchnorm_backward_from_output", "adam_update",
                                                 "sgd_update"}
    assert any(t["kernel"].startswith("conv_backward_weight") for t in report.timings)
    assert [r.returncode for r in report.train] == [0, 0]
    assert report.train[0].final_loss == report.train[1].final_loss is not None

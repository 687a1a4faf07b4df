"""Data-parallel training and sharded evaluation on MPI (engine.parallel): the reference is one process.

The MPI checks run under ``mpiexec -n 2`` with one thread per rank (``mpi_checks.py``, one launch per
scenario: MPI start-up and Numba's cache loading cost seconds each). Every launch has a timeout, so a
hang fails the test instead of the suite.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHECKS = os.path.join(ROOT, "tests", "parallel", "mpi_checks.py")
TIMEOUT = 300  # a cold Numba cache compiles every kernel in both ranks at once; warm, a launch takes seconds


def mpiexec() -> str:
    pytest.importorskip("mpi4py")
    from engine.parallel.comm import mpiexec_path

    path = mpiexec_path()
    if path is None:
        pytest.skip("no mpiexec: pip install 'numba-offload-engine[mpi]'")
    return path


def environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PMI_SIZE", "PMI_RANK", "ENGINE_WORKERS_LAUNCHED")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH", "")) if p)
    return env


def run(command: list[str], cwd: str = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, env=environment(), cwd=cwd, timeout=TIMEOUT)


def test_importing_the_engine_never_imports_mpi():
    code = (
        "import sys, engine, engine.parallel, engine.parallel.wrapper, engine.parallel.inference, engine.train, cli\n"
        "print('mpi4py' in sys.modules)"
    )
    result = run([sys.executable, "-c", code])
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False"]


def test_buckets_tile_the_gradient_block_from_the_end():
    from engine.parallel.allreduce import bucket_ranges, node_ranges
    from models import build_model

    net = build_model("mlp", 10, "cpu", input_shape=(3, 8, 8), hidden=32, depth=3)
    ranges = node_ranges(net)
    buckets = bucket_ranges(net, bucket_bytes=4 * 2000)
    size = net.gradients.flat.size
    assert buckets[0][2] == size and buckets[-1][1] == 0  # first bucket ends the block, last one starts it
    assert all(a[1] == b[2] for a, b in zip(buckets, buckets[1:]))  # back to back, no gap, no overlap
    starts = {lo: index for index, lo, _ in ranges}
    for index, lo, hi in buckets:
        assert starts[lo] == index  # complete when the first layer it holds has finished backward
        assert (hi - lo) * 4 >= 4 * 2000 or lo == 0
    assert len(bucket_ranges(net)) == 1  # 25 MB default: one bucket for a small net


def test_shards_of_a_batch_are_the_rows_of_the_global_batch_with_its_augmentation():
    from engine.data.batches import BatchSource
    from engine.parallel.data import ShardedBatchSource

    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 255, (40, 3, 8, 8)).astype(np.uint8), np.arange(40)
    args = (x, y, np.full(3, 100.0), np.full(3, 50.0))
    whole = BatchSource(*args, 12, 3, True, True, 5)
    xs, ys = np.empty((12, 3, 8, 8), np.float32), np.empty(12, np.int64)
    whole.fill(1, 2, xs, ys)
    for rank in range(3):
        shard = ShardedBatchSource(*args, 4, 3, True, True, 5, rank=rank, workers=3)
        assert shard.batches_per_epoch == whole.batches_per_epoch and shard.batch_shape == (4, 3, 8, 8)
        xr, yr = np.empty((4, 3, 8, 8), np.float32), np.empty(4, np.int64)
        shard.fill(1, 2, xr, yr)
        assert np.array_equal(xr, xs[4 * rank : 4 * rank + 4]) and np.array_equal(yr, ys[4 * rank : 4 * rank + 4])
    with pytest.raises(ValueError, match="global batch"):
        ShardedBatchSource(*args, 16, 3, rank=0, workers=3)


def test_two_ranks_train_as_one_process_on_the_doubled_batch():
    """Bit for bit against the simulated allreduce (in mpi_checks), and within float32 summation-order
    noise against one process on the doubled batch: measured 8.1e-8 (SGD with momentum), 2.5e-7
    (parameter averaging F=1 vs gradient averaging, plain SGD). Adam divides every gradient element by
    its own running scale, so elements whose gradient is near zero turn that noise into a visible
    difference: measured 6.8e-5 relative to the largest weight after 6 steps."""
    result = run([mpiexec(), "-n", "2", sys.executable, CHECKS, "train"])
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["sgd_vs_one_process"] < 1e-6
    assert report["sgd_state_vs_one_process"] < 1e-6
    assert report["adam_vs_one_process"] < 1e-3
    assert report["parameter_averaging_f1_vs_gradients"] < 1e-6
    assert 0 < report["sgd_vs_one_process"] and 0 < report["parameter_averaging_f1_vs_gradients"]  # not the same run


@pytest.mark.parametrize("how, message", [("raise", "ValueError: boom at step 2"), ("term", "terminated (SIGTERM)")])
def test_a_failing_rank_ends_the_job_with_its_message_and_no_swap_directory_left(tmp_path, how, message):
    """The other rank is told (a point-to-point notice it polls for while waiting on the allreduce),
    removes its swap directory and acknowledges before MPI_Abort (whose SIGKILL would leave it)."""
    from engine.parallel.comm import mpich_segments

    segments = mpich_segments()
    result = run([mpiexec(), "-n", "2", sys.executable, CHECKS, how, str(tmp_path)])
    assert mpich_segments() - segments == set()  # MPI_Abort under the user's own mpiexec: no shared memory left
    assert result.returncode != 0
    assert f"Error: rank 1 of 2: {message}; ending every rank" in result.stderr, result.stderr
    assert result.stderr.count("Error: rank") == 1  # one message, from the failing rank
    assert list(tmp_path.iterdir()) == []


def test_cli_workers_rank_zero_writes_resume_is_bit_for_bit_and_eval_equals_one_worker(tmp_path):
    mpiexec()
    common = [sys.executable, "-m", "cli", "train", "--model", "mlp", "--data", "synthetic", "--num-classes", "4",
              "--batch-size", "8", "--workers", "2", "--threads", "1", "--no-progress", "--augment"]
    straight = run([*common, "--steps", "4", "--save", str(tmp_path / "straight.st"),
                    "--summary-json", str(tmp_path / "s.json")], cwd=str(tmp_path))
    assert straight.returncode == 0, straight.stdout + straight.stderr
    assert straight.stdout.count("training summary") == 1  # rank 0 alone speaks
    assert "2 workers × batch 8 = global batch 16" in straight.stdout
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["workers"] == 2 and summary["global_batch_size"] == 16 and summary["final_step"] == 4
    half = run([*common, "--steps", "2", "--save", str(tmp_path / "half.st")], cwd=str(tmp_path))
    assert half.returncode == 0, half.stderr
    resumed = run([*common, "--steps", "4", "--resume", str(tmp_path / "half.st"),
                   "--save", str(tmp_path / "resumed.st")], cwd=str(tmp_path))
    assert resumed.returncode == 0, resumed.stderr
    import safetensors.numpy

    a = safetensors.numpy.load_file(str(tmp_path / "straight.st"))
    b = safetensors.numpy.load_file(str(tmp_path / "resumed.st"))
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    evaluate = ["eval", "--model", "mlp", "--data", "synthetic", "--num-classes", "4",
                "--weights", str(tmp_path / "straight.st"), "--batch-size", "48", "--json", "--threads", "1"]
    sharded = run([sys.executable, "-m", "cli", *evaluate, "--workers", "2"])
    assert sharded.returncode == 0, sharded.stderr
    from click.testing import CliRunner

    from cli import main
    from engine.threads import threads

    with threads(1):  # one worker, in this process
        single = CliRunner().invoke(main, evaluate, catch_exceptions=False)
    assert single.exit_code == 0, single.output
    assert json.loads(sharded.stdout) == json.loads(single.output)  # 128 test images: 3 batches, 2 ranks
    with threads(1):  # a checkpoint of 2 workers resumed by one process: allowed, with a note
        alone = CliRunner().invoke(main, ["train", "--model", "mlp", "--data", "synthetic", "--num-classes", "4",
                                          "--batch-size", "8", "--threads", "1", "--no-progress", "--augment",
                                          "--steps", "3", "--resume", str(tmp_path / "half.st")],
                                   catch_exceptions=False)
    assert alone.exit_code == 0, alone.output
    assert "written with 2 worker(s), this run has 1" in " ".join(alone.output.split())


class _Gathered:
    """A stand-in communicator whose allgather returns what every rank would have said."""

    def __init__(self, said):
        self.said = said

    def allgather(self, mine):
        return self.said


@pytest.mark.parametrize("rank", [0, 1])
def test_a_refusal_of_any_rank_is_said_once_by_rank_zero_and_every_rank_exits_with_its_code(rank):
    from engine.parallel.comm import AgreedRefusal, World, abort_on_error, refuse_together

    world = World(_Gathered([None, "needs a limit of 1 GiB", "needs a limit of 2 GiB"]), rank, 3, rank, 3)
    refuse_together(World(_Gathered([None, None, None]), rank, 3, rank, 3), None)  # nobody refuses: goes on
    with pytest.raises(AgreedRefusal, match="^needs a limit of 1 GiB$") as refused:  # the lowest refusing rank's
        refuse_together(world, None)
    assert refused.value.exit_code == 1
    if rank == 0:  # rank 0 says it: the command line turns it into its one line
        with pytest.raises(AgreedRefusal), abort_on_error(world):
            refuse_together(world, None)
    else:  # the others leave quietly with the code, no MPI_Abort (nothing to abort: every rank is leaving)
        with pytest.raises(SystemExit) as leaving, abort_on_error(world):
            refuse_together(world, None)
        assert leaving.value.code == 1

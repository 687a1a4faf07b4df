"""`engine kernels`: the shape lists, the records, the JSON and table output, the warm-up (tiny shapes only)."""

import json

import numpy as np
import pytest
from click.testing import CliRunner

from cli import main
from engine.bench import kernels as kernel_bench


def test_resnet18_shapes_are_its_distinct_convolutions():
    labels = [s.label for s in kernel_bench.resnet18_convs(32)]
    assert labels == [
        "3->64 3x3 s1 @32x32 n32",
        "64->64 3x3 s1 @32x32 n32",
        "64->128 3x3 s2 @32x32 n32",
        "64->128 1x1 s2 @32x32 n32",
        "128->128 3x3 s1 @16x16 n32",
        "128->256 3x3 s2 @16x16 n32",
        "128->256 1x1 s2 @16x16 n32",
        "256->256 3x3 s1 @8x8 n32",
        "256->512 3x3 s2 @8x8 n32",
        "256->512 1x1 s2 @8x8 n32",
        "512->512 3x3 s1 @4x4 n32",
    ]


def test_mobilenetv2_shapes_include_every_depthwise_conv_once():
    shapes = kernel_bench.mobilenetv2_convs(8)
    depthwise = [s for s in shapes if s.groups > 1]
    assert len(shapes) == len(set(shapes))
    assert all(s.groups == s.x_shape[1] == s.w_shape[0] and s.w_shape[1] == 1 for s in depthwise)
    # stride-2 depthwise convs: 144 at 32x32, 192 at 16x16, 576 at 8x8 (torchvision's table, CIFAR strides)
    assert {(s.x_shape[1], s.x_shape[2]) for s in depthwise if s.stride == 2} == {(144, 32), (192, 16), (576, 8)}
    assert shapes[-1].w_shape == (1280, 320, 1, 1) and shapes[-1].x_shape[2] == 4


def test_conv_flops_count_multiply_and_add():
    shape = kernel_bench.ConvShape("t", (2, 4, 5, 5), (6, 2, 3, 3), 2, 1, 2)
    assert shape.out_shape == (2, 6, 3, 3)
    assert shape.flops == 2 * 2 * 6 * 3 * 3 * 2 * 3 * 3


def test_conv_records_check_every_version_against_the_reference():
    table, reference = kernel_bench.load_tables("cpu")
    cases = []
    for shape in kernel_bench.TINY_CONVS:
        cases += kernel_bench.conv_cases(shape, table, reference, versions=True, backend="cpu")
    records = kernel_bench.measure(cases, "cpu", repeat=1, sgemm=100.0)
    versions = (*range(1, 19), 20, 21, 23, *range(25, 48))
    assert {r.version for r in records} == {"table", *(f"v{v}" for v in versions)}
    for r in records:
        assert r.error is None, r
        assert r.max_abs_err < 1e-4 and r.ms > 0 and r.gflops > 0
        assert r.pct_sgemm == pytest.approx(r.gflops)  # sgemm = 100 GFLOP/s


def test_torch_is_timed_in_its_own_process_and_never_imported_here(tmp_path):
    """torch and Numba's pool share one OpenMP runtime per process (by soname) and whichever loads
    first sets its wait policy for both: dense 1024->1024 with bias read 7.9 ms instead of 0.74 with
    torch imported first. ``engine kernels --compare torch`` must time torch in a child process and
    never import it in the process that times the engine's kernels."""
    pytest.importorskip("torch")
    import subprocess
    import sys

    program = (
        "import runpy, sys\n"
        "sys.argv = ['cli', 'kernels', '--ops', 'relu_forward,add_forward,dense_forward', '--batch-size', '2',"
        " '--repeat', '1', '--compare', 'torch', '--format', 'json']\n"
        "try:\n    runpy.run_module('cli', run_name='__main__')\nexcept SystemExit as e:\n"
        "    assert not e.code, e.code\n"
        "assert 'torch' not in sys.modules, 'torch was imported in the measuring process'\n"
    )
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    records = json.loads(done.stdout)
    assert [r["op"] for r in records] == ["dense_forward"] * 3 + ["relu_forward", "add_forward"]
    assert all(r["torch_ms"] > 0 for r in records[:4])  # add_forward has no torch twin
    # the JSON's documented fields (one torch run for both: this was test_json_output_has_the_documented_fields)
    for r in records:
        for key in ("op", "backend", "shape", "ms", "gflops", "max_abs_err", "torch_ms", "sgemm_gflops"):
            assert key in r
        assert (r["repeat"], r["rounds"]) == (1, 3)  # --compare torch: three alternating rounds by default
        assert r["backend"] == "cpu"
    for r in records[3:]:
        assert r["max_abs_err"] == 0.0 and r["gbps"] > 0


def test_torch_process_refuses_a_case_list_that_differs():
    """The child builds its cases from the same arguments and checks each request's key: a parent
    asking for a case the child does not have at that index gets an error, not a wrong pairing."""
    pytest.importorskip("torch")
    cases, _ = kernel_bench.build_cases("cpu", ["relu_forward"], 2, False)
    with kernel_bench.TorchProcess(["relu_forward"], 2, False, ("resnet18",), 1) as process:
        assert process.time_ms(0, cases[0]) > 0
        wrong = kernel_bench.Case("relu_forward", "table", "1x1x1x1", cases[0].run, cases[0].check)
        with pytest.raises(RuntimeError, match="torch timing process stopped.*case 0 is relu_forward table 2x64"):
            process.time_ms(0, wrong)


def test_table_output_and_bad_options():
    runner = CliRunner()
    result = runner.invoke(main, ["kernels", "--ops", "relu_forward", "--batch-size", "1", "--repeat", "1"])
    assert result.exit_code == 0, result.output
    assert "relu_forward" in result.output and "% sgemm" in result.output
    result = runner.invoke(main, ["kernels", "--models", "vgg"])
    assert result.exit_code != 0 and "unknown vgg" in result.output
    result = runner.invoke(main, ["kernels", "--ops", "nonexistent"])
    assert result.exit_code != 0 and "no kernels match" in result.output


def test_warmup_calls_every_cpu_kernel():
    seconds, calls = kernel_bench.warm_up()
    table, _ = kernel_bench.load_tables("cpu")
    kernels = [name for name in table if not name.endswith("workspace_size")]
    assert seconds > 0 and calls >= len(kernels)


def test_best_ms_is_the_fastest_timed_call(monkeypatch):
    clock = iter([0.0, 0.005, 0.010, 0.011, 0.020, 0.030])  # (start, end) of three timed calls: 5, 1, 10 ms
    calls = []
    monkeypatch.setattr(kernel_bench.time, "perf_counter", lambda: next(clock))
    assert kernel_bench.best_ms(lambda: calls.append(1), repeat=3) == pytest.approx(1.0)
    assert len(calls) == 4  # one untimed warm-up call first


def test_sgemm_reference_is_measured():
    assert np.isfinite(kernel_bench.sgemm_gflops(1, size=64)) and kernel_bench.sgemm_gflops(1, size=64) > 0


def test_quiesce_waits_out_a_busy_thread_and_not_a_quiet_process(monkeypatch):
    """OpenBLAS's and OpenMP's workers spin for ~0.1 s after a call; a kernel timed then shares its
    cores. ``quiesce`` waits until the process's other threads are idle (and only then).

    The threads' run times are scripted, not a real spinning thread: on a loaded machine a real one
    may not get a CPU for a whole poll interval, look idle, and the test would depend on the load."""
    import threading

    from engine.bench import kernels as bench

    me, other = threading.get_native_id(), -1
    polls = []

    def scripted(busy_polls):
        def read(pid="self"):
            polls.append(pid)
            ran = 5_000_000 * min(len(polls), busy_polls + 1)  # 5 ms more per poll while busy, then none
            return {me: (10**12 * len(polls), 0), other: (ran, 0)}  # this thread's own time never counts
        return read

    monkeypatch.setattr(bench, "thread_schedstat", scripted(busy_polls=0))
    bench.quiesce(interval_s=0.001)
    assert len(polls) == 2  # quiet at the first look: one interval, no more
    polls.clear()
    monkeypatch.setattr(bench, "thread_schedstat", scripted(busy_polls=6))
    waited = bench.quiesce(interval_s=0.01)
    assert len(polls) == 8 and waited >= 7 * 0.01  # six busy intervals, then the quiet one (sleep is a minimum)
    polls.clear()
    monkeypatch.setattr(bench, "thread_schedstat", scripted(busy_polls=10**6))
    assert bench.quiesce(interval_s=0.01, limit_s=0.05) >= 0.05  # a thread that never settles: the limit ends it


def test_ops_prefix_can_name_one_conv_direction():
    """``--ops conv2d_forward`` keeps the conv forwards alone (it once matched nothing: the conv
    shapes were built only when "conv2d" itself started with a prefix)."""
    cases, _ = kernel_bench.build_cases("cpu", ["conv2d_forward"], 2, False, models=("resnet18",))
    assert cases and {case.op for case in cases} == {"conv2d_forward"}


def test_rounds_alternate_both_sides_and_keep_each_sides_best(monkeypatch):
    """``--rounds``: ours then torch's, round after round; each side keeps its best round (a slow moment in one
    round no longer decides a record)."""
    order, ours, theirs = [], iter([3.0, 1.0, 2.0]), iter([5.0, 6.0, 4.0])

    def fake_best(run, repeat):
        order.append("ours")
        return next(ours)

    class FakeTorch:
        pid = -1

        def time_ms(self, index, case):
            order.append("torch")
            return next(theirs)

    monkeypatch.setattr(kernel_bench, "best_ms", fake_best)
    monkeypatch.setattr(kernel_bench, "quiesce", lambda **kw: 0.0)
    case = kernel_bench.Case("conv2d_forward", "table", "s", run=lambda: None, check=lambda: 0.0, flops=1e6,
                             torch_run=lambda: None)
    [record] = kernel_bench.measure([case], "cpu", 7, 100.0, torch_process=FakeTorch(), rounds=3)
    assert order == ["ours", "torch"] * 3
    assert (record.ms, record.torch_ms) == (1.0, 4.0)
    order.clear()
    ours = iter([2.0])
    [record] = kernel_bench.measure([case], "cpu", 7, 100.0)  # one round by default
    assert order == ["ours"] and record.ms == 2.0 and record.torch_ms is None


def test_engine_kernels_takes_rounds_and_refuses_zero():
    result = CliRunner().invoke(main, ["kernels", "--rounds", "0"])
    assert result.exit_code != 0 and "--rounds" in result.output

"""The memory limit (cgroup v1, v2, ancestors, none) and the offload budget that follows it."""

from __future__ import annotations

import os

import pytest

from engine.memory.limits import MemoryLimit, cgroup_limit, memory_limit


def fake_proc(tmp_path, cgroup_lines: list[str], mount_lines: list[str]) -> str:
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text("\n".join(cgroup_lines) + "\n")
    (proc / "self" / "mountinfo").write_text("\n".join(mount_lines) + "\n")
    return str(proc)


def write(path, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def test_cgroup_v1_takes_the_smallest_limit_up_to_the_mount(tmp_path):
    mount = tmp_path / "memory"
    write(mount / "memory.limit_in_bytes", "9223372036854771712")  # the root: unlimited
    write(mount / "jobs" / "memory.limit_in_bytes", str(3 << 30))
    write(mount / "jobs" / "run1" / "memory.limit_in_bytes", str(5 << 30))  # the ancestor's 3 GiB binds
    proc = fake_proc(tmp_path, ["4:memory:/jobs/run1", "0::/"],
                     [f"35 31 0:32 / {mount} rw,relatime - cgroup cgroup rw,memory"])
    limit, source = cgroup_limit(proc)
    assert limit == 3 << 30 and source == f"cgroup v1 {mount / 'jobs' / 'memory.limit_in_bytes'}"


def test_cgroup_v2_memory_max_and_mount_root(tmp_path):
    mount = tmp_path / "unified"
    write(mount / "memory.max", "max")
    write(mount / "user.slice" / "memory.max", "max")
    write(mount / "user.slice" / "job" / "memory.max", str(1536 << 20))
    # a namespace whose mount root is /user.slice: the process sees its path from the host's root
    proc = fake_proc(tmp_path, ["0::/user.slice/job"],
                     [f"40 31 0:40 /user.slice {mount / 'user.slice'} rw - cgroup2 cgroup2 rw"])
    assert cgroup_limit(proc) == (1536 << 20, f"cgroup v2 {mount / 'user.slice' / 'job' / 'memory.max'}")


def test_no_cgroup_limit_means_available_ram(tmp_path):
    mount = tmp_path / "unified"
    write(mount / "memory.max", "max")
    proc = fake_proc(tmp_path, ["0::/"], [f"40 31 0:40 / {mount} rw - cgroup2 cgroup2 rw"])
    assert cgroup_limit(proc) is None
    limit = memory_limit(proc)
    assert limit.source == "available RAM" and limit.bytes > 0


def test_ranks_on_one_host_share_the_cgroup_and_the_ram_but_not_ulimit_v(tmp_path, monkeypatch):
    """``engine train --workers K``: K processes in one cgroup, each planned against the whole limit, were
    OOM-killed together; each gets 1/K of the cgroup and of the available RAM, while ``ulimit -v`` bounds
    every process by itself."""
    from engine.memory import limits

    mount = tmp_path / "unified"
    write(mount / "job" / "memory.max", str(3 << 30))
    proc = fake_proc(tmp_path, ["0::/job"], [f"40 31 0:40 / {mount} rw - cgroup2 cgroup2 rw"])
    monkeypatch.setattr(limits, "available_ram", lambda: 16 << 30)
    monkeypatch.setattr(limits, "address_space_limit", lambda proc: None)
    assert memory_limit(proc).bytes == 3 << 30
    two = memory_limit(proc, ranks_on_host=2)
    assert two.bytes == 3 << 29
    assert two.source == f"cgroup v2 {mount / 'job' / 'memory.max'}, shared by 2 ranks on this host"
    monkeypatch.setattr(limits, "available_ram", lambda: 2 << 30)  # RAM tighter than the cgroup: shared too
    assert memory_limit(proc, ranks_on_host=4) == MemoryLimit(1 << 29, "available RAM, shared by 4 ranks on this host")
    monkeypatch.setattr(limits, "address_space_limit", lambda proc: (1 << 28, "ulimit -v"))  # per process
    assert memory_limit(proc, ranks_on_host=4) == MemoryLimit(1 << 28, "ulimit -v")
    assert memory_limit(proc, ranks_on_host=1).bytes == 1 << 28


@pytest.fixture(scope="module")
def resnet_224():
    from models import build_model

    net = build_model("resnet18", 10, "cpu", image_size=224)
    yield net
    net.close()


def needs_at(net, limit_bytes: int, batch: int = 32):
    from engine.offload.budget import Setup, run_needs

    return run_needs(net, batch, 45 << 20, 55 << 20, 37 << 20, MemoryLimit(limit_bytes, "test"),
                     setup=Setup(0, 0, 0))


def test_budget_and_refusal_follow_the_limit(resnet_224):
    from engine.offload.budget import DoesNotFit, check_no_offload, check_offload

    roomy = needs_at(resnet_224, 64 << 30)
    assert roomy.needed_min_offload < roomy.needed_no_offload  # offload saves memory at 224, batch 32
    check_no_offload(roomy)
    between = needs_at(resnet_224, (roomy.needed_min_offload + roomy.needed_no_offload) // 2)
    with pytest.raises(DoesNotFit, match="without offload.*add --offload-n auto"):
        check_no_offload(between)
    check_offload(between, between.min_arena_bytes, "--offload-n 1")
    assert between.min_arena_bytes <= between.arena_budget < roomy.arena_budget
    tight = needs_at(resnet_224, roomy.needed_min_offload - (1 << 20))
    with pytest.raises(DoesNotFit, match=r"--offload-n 1 needs a limit of .*the smallest window \(--offload-n 1\)"):
        check_offload(tight, tight.min_arena_bytes, "--offload-n 1")
    with pytest.raises(DoesNotFit, match="lower --batch-size"):
        check_no_offload(tight)


def test_auto_recomputes_the_fewest_chunked_layers_that_fit(resnet_224):
    """``--chunks auto``: the largest batch-norm outputs stop being kept first, and only as many as the limit
    needs; below what all of them give, all recompute (the smallest limit a refusal names)."""
    from engine.offload.budget import fit_by_recompute, recompute_order

    net = resnet_224
    order = recompute_order(net)
    assert order[0] == "conv1+bn1+relu+maxpool" and len(order) == 5  # the stem's 98 MiB first, then layer1's
    keep = needs_at(net, 64 << 30)
    net.set_recomputed(order)
    smallest = needs_at(net, 64 << 30)
    assert smallest.recomputed == tuple(n.name for n in net.chunked)
    assert smallest.needed_no_offload < keep.needed_no_offload
    assert smallest.needed_min_offload < keep.needed_min_offload

    def fit(limit):
        net.set_recomputed([])
        return fit_by_recompute(net, needs_at(net, limit), lambda n: n.fits_without_offload,
                                lambda: needs_at(net, limit))

    assert fit(keep.needed_no_offload).recomputed == ()  # it fits: nothing recomputed
    between = fit(keep.needed_no_offload - 1)
    count = len(between.recomputed)
    assert between.fits_without_offload and set(between.recomputed) == set(order[:count]) and 0 < count < 5
    net.set_recomputed(order[:count - 1])
    assert not needs_at(net, keep.needed_no_offload - 1).fits_without_offload  # one fewer would not fit
    tight = fit(smallest.needed_no_offload - 1)
    assert not tight.fits_without_offload and len(tight.recomputed) == 5
    net.set_recomputed([])


def test_chunks_option_sets_every_chunked_layer(resnet_224):
    from engine.offload.budget import resolve_budget

    roomy = MemoryLimit(64 << 30, "test")
    for chunks, recomputed in [("recompute", 5), ("keep", 0), ("auto", 0)]:
        resolved = resolve_budget(resnet_224, 32, 45 << 20, 55 << 20, 37 << 20, None, None, roomy, chunks=chunks)
        assert len(resolved.needs.recomputed) == recomputed, chunks
        assert [n.layer.mode for n in resnet_224.chunked].count("recompute") == recomputed
    with pytest.raises(ValueError, match="--chunks must be one of auto, keep, recompute"):
        resolve_budget(resnet_224, 32, 0, 0, 0, None, None, roomy, chunks="some")


def test_a_fixed_window_recomputes_what_its_limit_needs(resnet_224):
    """``--offload-n 1`` with ``--chunks auto`` under a limit between what keep and recompute need: some chunked
    layers recompute and the run fits; below what recompute needs, the refusal names that smallest limit."""
    from engine.offload.budget import DoesNotFit, Setup, resolve_budget

    def resolve(limit, chunks):  # the setup fixed: this process's resident set moves between the calls
        return resolve_budget(resnet_224, 32, 45 << 20, 55 << 20, 37 << 20, "1", None, MemoryLimit(limit, "test"),
                              chunks=chunks, setup=Setup(0, 0, 0)).needs

    def needed(needs):
        (arena,) = needs.arenas.values()
        return needs.needed(arena)

    keep, everything = needed(resolve(64 << 30, "keep")), needed(resolve(64 << 30, "recompute"))
    assert everything < keep
    between = resolve((keep + everything) // 2, "auto")
    assert 0 < len(between.recomputed) <= 5 and needed(between) <= (keep + everything) // 2
    with pytest.raises(DoesNotFit, match=r"--offload-n 1 needs a limit of"):
        resolve(everything - (32 << 20), "auto")
    assert len(resnet_224.chunked) == 5 and all(n.layer.mode == "recompute" for n in resnet_224.chunked)
    resnet_224.set_recomputed([])


def test_a_shallower_input_ring_then_recompute_then_no_prefetch(resnet_224, monkeypatch):
    """engine train's default prefetch under a tight limit: a shallower ring that still prefetches first
    (``shallower_rings``), then the fewest chunked layers recompute, and no prefetch (``last_ring``) only when every
    layer recomputing does not fit, with the fewest recomputing again. The smallest limits and a refusal count the
    last ring; without the shallower rings, recompute alone."""
    from engine.offload import budget
    from engine.offload.budget import DoesNotFit, resolve_budget, round_up_mib

    monkeypatch.setattr(budget.Setup, "measure", classmethod(lambda cls, blocks=(): cls(0, 0, 0)))  # exact limits
    net = resnet_224
    rings = (55 << 20, 37 << 20, 18 << 20)

    def resolve(limit, shallower=rings[1:2], last=rings[2]):
        return resolve_budget(net, 32, 45 << 20, rings[0], 37 << 20, None, None, MemoryLimit(limit, "test"),
                              shallower_rings=shallower, last_ring=last)

    roomy = resolve(64 << 30)
    assert roomy.ring == 0 and roomy.needs.input_ring_bytes == rings[0] and roomy.needs.recomputed == ()
    floor = roomy.needs.needed_no_offload  # with the last ring: the smallest limit keeping every layer
    assert roomy.needs.floor_ring_bytes == rings[2] and roomy.needs.as_dict()["smallest_input_ring_bytes"] == rings[2]
    middle = resolve(floor + (rings[1] - rings[2]))  # room for the middle ring, keeping everything
    assert middle.ring == 1 and middle.needs.input_ring_bytes == rings[1] and middle.needs.recomputed == ()
    below = resolve(floor)  # the middle ring, and the fewest recompute (prefetching beats a layer kept)
    assert below.ring == 1 and 0 < len(below.needs.recomputed) < 5 and below.needs.fits_without_offload
    net.set_recomputed([n.name for n in net.chunked])
    everything = needs_at(net, 64 << 30)  # every layer recomputing (needs_at: the deepest ring, 55 MiB)
    smallest = everything.fixed_bytes + everything.no_offload_step_bytes + (37 << 20)  # + a ring
    last = resolve(smallest + rings[2] + (1 << 20))  # every layer recomputing does not fit with the middle ring
    assert last.ring == 2 and last.needs.input_ring_bytes == rings[2] and last.needs.fits_without_offload
    assert len(last.needs.recomputed) <= 5
    fixed = resolve(floor, shallower=(), last=None)  # --prefetch given: its ring stays, layers recompute instead
    assert fixed.ring == 0 and fixed.needs.input_ring_bytes == rings[0] and 0 < len(fixed.needs.recomputed)
    with pytest.raises(DoesNotFit) as refusal:  # names the smallest: the last ring, every layer recomputing
        resolve(1 << 20)
    assert f"needs a limit of {round_up_mib(smallest + rings[2]) / 2**30:.2f} GiB without offload" in str(refusal.value)
    net.set_recomputed([])


def test_the_prediction_adds_its_parts(resnet_224):
    """The smallest limit is the measured setup plus the planned blocks plus the step (or the evaluation)."""
    from engine.offload.budget import RUNTIME_BYTES, Setup, run_needs

    report = resnet_224.memory_report(32)
    setup = Setup(anon_bytes=300 << 20, file_bytes=0, blocks_resident_bytes=report.parameter_bytes)
    needs = run_needs(resnet_224, 32, 45 << 20, 55 << 20, 37 << 20, MemoryLimit(8 << 30, "test"), setup=setup)
    long_lived = report.parameter_bytes + report.gradient_bytes + report.buffer_bytes
    fixed = (300 << 20) - report.parameter_bytes + long_lived + (45 << 20) + RUNTIME_BYTES
    assert needs.fixed_bytes == fixed
    program = resnet_224.program(32)
    batch = program.buffers[program.input].nbytes  # the step's input is a ring slot: counted with the ring, once
    step_no_offload = report.planned_peak_bytes - long_lived - batch
    assert needs.needed_no_offload == fixed + (55 << 20) + step_no_offload + (37 << 20)  # + the evaluation's ring
    step = (55 << 20) + needs.offload_step_bytes + needs.min_arena_bytes
    assert needs.needed_min_offload == fixed + max(step, needs.evaluation_bytes)
    assert needs.arena_budget == (8 << 30) - fixed - (55 << 20) - needs.offload_step_bytes


def test_resident_array_bytes_counts_written_pages_only():
    import numpy as np

    from engine.memory.limits import resident_array_bytes

    block = np.zeros(64 << 20, dtype=np.uint8)  # calloc'd: mapped, not yet resident
    assert resident_array_bytes(block) <= 2 << 20
    block[: 16 << 20] = 1
    assert (16 << 20) <= resident_array_bytes(block) <= (18 << 20)  # a huge page may round up


def test_budget_is_read_once():
    from engine.offload.budget import parse_budget

    assert parse_budget(None) is None
    assert parse_budget(" Auto ").auto
    assert (parse_budget("120MB").kind, parse_budget("120MB").value) == ("bytes", 120_000_000)
    assert (parse_budget("0.3x").kind, parse_budget("0.3x").value) == ("share", 0.3)
    for bad in ("lots", "zx", "0x", "-1MB", "nan", "infx"):
        with pytest.raises(ValueError):
            parse_budget(bad)


def test_offload_budget_does_not_import_the_data_pipeline():
    """Offload serves the network: the INPUT ring's bytes are passed in (issue 30, item 6)."""
    import ast
    from pathlib import Path

    source = Path(__file__).resolve().parents[3] / "engine" / "offload" / "budget.py"
    modules = {n.module for n in ast.walk(ast.parse(source.read_text())) if isinstance(n, ast.ImportFrom)}
    assert not [m for m in modules if m and m.startswith("engine.data")]


def test_train_refuses_before_the_first_step(monkeypatch, tmp_path):
    from click.testing import CliRunner

    import engine.offload.budget as budget
    from cli import main

    monkeypatch.setattr(budget, "memory_limit", lambda: MemoryLimit(64 << 20, "test limit"))
    runner = CliRunner()
    args = ["train", "--model", "cnn", "--steps", "2", "--no-progress", "--offload-dir", str(tmp_path)]
    result = runner.invoke(main, args[:-2])
    assert result.exit_code == 1 and "without offload, the limit is 0.06 GiB (test limit)" in result.output
    for options in (["--offload-n", "auto"], ["--offload-n", "2"], ["--offload-budget", "0.9x"]):
        result = runner.invoke(main, [*args, *options])
        assert result.exit_code == 1, (options, result.output)
        assert "needs a limit of" in result.output and "the smallest window (--offload-n 1)" in result.output
        assert os.listdir(tmp_path) == []  # refused before the swap directory was made
    monkeypatch.setattr(budget, "memory_limit", lambda: MemoryLimit(16 << 30, "test limit"))
    result = runner.invoke(main, [*args, "--offload-budget", "auto"])
    assert result.exit_code == 0, result.output
    assert "memory limit 16.00 GiB (test limit)" in result.output and "offload: window" in result.output


def test_device_backends_skip_the_host_fit():
    from types import SimpleNamespace

    from engine.offload.budget import DoesNotFit, parse_budget, resolve_budget

    net = SimpleNamespace(backend=SimpleNamespace(is_device=True, name="cuda"))
    assert resolve_budget(net, 32, None, 0, 0, "auto", None).budget_bytes is None
    assert resolve_budget(net, 32, None, 0, 0, None, parse_budget("1GB")).budget_bytes == 10**9
    with pytest.raises(DoesNotFit, match="on the cuda backend give --offload-budget BYTES"):
        resolve_budget(net, 32, None, 0, 0, None, parse_budget("auto"))


def test_engine_memory_prints_the_smallest_limit_per_plan_and_batch_size():
    import json

    from click.testing import CliRunner

    from cli import main

    arguments = ["memory", "--model", "cnn", "--image-size", "16", "--batch-size", "2,8", "--offload-n", "2"]
    text = CliRunner().invoke(main, arguments)
    assert text.exit_code == 0, text.output
    assert "no layer runs in chunks here" in text.output and "smallest limit" in text.output
    result = CliRunner().invoke(main, [*arguments, "--json"])
    limits = json.loads(result.output)["limits"]
    assert [entry["batch_size"] for entry in limits] == [2, 8]
    assert set(limits[0]["needed_bytes"]) == {"--offload-n 1", "--offload-n 2"}
    for small, large in zip(limits[0]["needed_bytes"].values(), limits[1]["needed_bytes"].values()):
        assert small < large  # no chunked layer at 16 pixels: the limit grows with the batch
    assert limits[0]["needed_no_offload_bytes"] < limits[1]["needed_no_offload_bytes"]
    refused = CliRunner().invoke(main, ["memory", "--model", "cnn", "--batch-size", "2,x"])
    assert refused.exit_code == 1 and "comma-separated" in refused.output


def test_auto_at_its_floor_runs_n1_in_the_step_arenas_free_bytes(resnet_224, monkeypatch):
    """``--offload-n auto`` under a limit where N=1's units fit only in the bytes the step arena's tensors leave free
    (a byte budget counts the units' own arena, which does not fit): N=1, no budget, so the scheduler shares one
    region (``OffloadScheduler.sharing``); with room for the units' own arena, a budget as before."""
    from engine.offload import budget
    from engine.offload.budget import resolve_budget

    monkeypatch.setattr(budget.Setup, "measure", classmethod(lambda cls, blocks=(): cls(0, 0, 0)))  # exact limits
    resnet_224.set_recomputed([n.name for n in resnet_224.chunked])

    def resolve(limit):
        return resolve_budget(resnet_224, 32, 45 << 20, 18 << 20, 37 << 20, "auto", None, MemoryLimit(limit, "test"),
                              chunks="recompute")

    roomy = resolve(64 << 30).needs
    assert roomy.min_arena_bytes < roomy.min_units_arena_bytes  # sharing saves bytes at N=1
    floor = resolve(roomy.needed_min_offload + (1 << 20))
    assert (floor.window, floor.budget_bytes) == (1, None)
    apart = resolve(roomy.needed(roomy.min_units_arena_bytes) + (1 << 20))
    assert apart.window is None and apart.budget_bytes >= roomy.min_units_arena_bytes
    with pytest.raises(budget.DoesNotFit):
        resolve(roomy.needed_min_offload - (1 << 20))
    resnet_224.set_recomputed([])

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


@pytest.fixture(scope="module")
def resnet_224():
    from models import build_model

    net = build_model("resnet18", 10, "cpu", image_size=224)
    yield net
    net.close()


def test_budget_and_refusal_follow_the_limit(resnet_224):
    from engine.offload.budget import DoesNotFit, check_fit, memory_fit

    def fit(limit_bytes: int):
        return memory_fit(resnet_224, 32, 45 << 20, 55 << 20, MemoryLimit(limit_bytes, "test"), baseline_bytes=0)

    roomy = fit(64 << 30)
    assert roomy.needed_min_offload < roomy.needed_no_offload  # offload saves memory at 224, batch 32
    check_fit(roomy, offload=False)
    between = fit((roomy.needed_min_offload + roomy.needed_no_offload) // 2)
    with pytest.raises(DoesNotFit, match="without offload.*add --offload-n auto"):
        check_fit(between, offload=False)
    check_fit(between, offload=True)
    assert between.min_window_arena_bytes <= between.arena_budget < roomy.arena_budget
    tight = fit(roomy.needed_min_offload - (1 << 20))
    with pytest.raises(DoesNotFit, match=r"with offload \(N=1\)"):
        check_fit(tight, offload=True)
    with pytest.raises(DoesNotFit, match="lower --batch-size"):
        check_fit(tight, offload=False)


def test_train_refuses_before_the_first_step(monkeypatch):
    from click.testing import CliRunner

    import engine.offload.budget as budget
    from cli import main

    monkeypatch.setattr(budget, "memory_limit", lambda: MemoryLimit(64 << 20, "test limit"))
    runner = CliRunner()
    args = ["train", "--model", "cnn", "--steps", "2", "--no-progress"]
    result = runner.invoke(main, args)
    assert result.exit_code == 1 and "without offload, the limit is 0.06 GiB (test limit)" in result.output
    result = runner.invoke(main, [*args, "--offload-n", "auto"])
    assert result.exit_code == 1 and "with offload (N=1)" in result.output
    monkeypatch.setattr(budget, "memory_limit", lambda: MemoryLimit(16 << 30, "test limit"))
    result = runner.invoke(main, [*args, "--offload-budget", "auto"])
    assert result.exit_code == 0, result.output
    assert "memory limit 16.00 GiB (test limit)" in result.output and "offload: window" in result.output


def test_device_backends_skip_the_host_fit():
    from types import SimpleNamespace

    from engine.offload.budget import DoesNotFit, resolve_budget

    net = SimpleNamespace(backend=SimpleNamespace(is_device=True, name="cuda"))
    assert resolve_budget(net, 32, None, 2, "auto", None) == (None, None)
    assert resolve_budget(net, 32, None, 2, None, "1GB") == ("1GB", None)
    with pytest.raises(DoesNotFit, match="on the cuda backend give --offload-budget BYTES"):
        resolve_budget(net, 32, None, 2, None, "auto")

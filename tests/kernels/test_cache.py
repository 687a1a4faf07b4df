"""The kernel cache as a user meets it (issue 31, class 6): a read-only NUMBA_CACHE_DIR, no writable
cache anywhere, and a truncated cache file. Each runs in a fresh process (Numba decides its cache when
the kernels are defined) on the smallest kernel, global_avgpool_backward (one cache entry)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ONE_KERNEL = (
    "import json, sys\n"
    "from engine.warmup import Job, run_job\n"
    "from kernels.cpu.cache import where\n"
    "run_job(Job('global_avgpool_backward'))\n"
    "location = where()\n"
    "print(json.dumps([location.directory, location.persistent, location.problem]))\n"
)


def environment(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env


def read_only(command: list[str], *mounts: str) -> list[str]:
    """``command`` with each of ``mounts`` a read-only file system (root: a user and mount namespace with a
    read-only tmpfs on each; otherwise the directories' write permission is taken away)."""
    if os.geteuid() != 0:
        for path in mounts:
            os.chmod(path, 0o555)
        return command
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-r", "-m", "true"]).returncode != 0:
        pytest.skip("running as root without unshare -r -m: no way to make a directory read-only for root")
    script = " && ".join(f"mount -t tmpfs -o ro tmpfs '{path}'" for path in mounts)
    return ["unshare", "-r", "-m", "sh", "-c", f'{script} && exec "$@"', "sh", *command]


def test_a_read_only_numba_cache_dir_is_named_and_not_promised(tmp_path):
    """Numba silently ignores a NUMBA_CACHE_DIR it cannot write (it falls back to __pycache__ beside
    the kernels): the run trains, and says where the kernels really are and what to do."""
    cache = tmp_path / "cache"
    cache.mkdir()
    command = [sys.executable, "-m", "cli", "train", "--model", "mlp", "--data", "synthetic", "--num-classes", "4",
               "--batch-size", "8", "--steps", "1", "--threads", "1", "--no-progress"]
    result = subprocess.run(read_only(command, str(cache)), capture_output=True, text=True, cwd=str(tmp_path),
                            env=environment(NUMBA_CACHE_DIR=str(cache)), timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert f"note: NUMBA_CACHE_DIR={cache} cannot be written (" in " ".join(output.split()), output
    assert "Numba ignores it and caches the kernels in" in " ".join(output.split())
    assert f"cached in {cache}" not in output
    assert list(cache.iterdir()) == []


def test_no_writable_cache_anywhere_compiles_into_a_temporary_directory_and_says_so(tmp_path):
    """NUMBA_CACHE_DIR, the kernels' __pycache__ and the user's cache directory all read-only: Numba
    itself raises 'no locator available' while the kernels are imported; the engine runs, says that
    nothing is kept, and leaves no temporary directory behind."""
    if os.geteuid() != 0:
        pytest.skip("needs a mount namespace to make the kernels' own __pycache__ read-only")
    cache, home = tmp_path / "cache", tmp_path / "home"
    cache.mkdir()
    home.mkdir()
    beside = os.path.join(ROOT, "kernels", "cpu", "__pycache__")
    os.makedirs(beside, exist_ok=True)
    command = [sys.executable, "-c", ONE_KERNEL]
    result = subprocess.run(read_only(command, str(cache), beside, str(home)), capture_output=True, text=True,
                            env=environment(NUMBA_CACHE_DIR=str(cache), HOME=str(home), XDG_CACHE_HOME=str(home)),
                            timeout=600)
    assert result.returncode == 0, result.stderr
    import json

    directory, persistent, problem = json.loads(result.stdout.strip().splitlines()[-1])
    assert not persistent and "no kernel cache can be written" in problem
    assert f"NUMBA_CACHE_DIR={cache}: Read-only file system" in problem and "set NUMBA_CACHE_DIR" in problem
    assert not os.path.exists(directory)  # the temporary cache is removed at exit


def test_a_truncated_cache_file_is_compiled_again_with_one_line(tmp_path):
    """A cache file cut short (a killed compile, a full disk) made the kernel's first call end in
    'UnpicklingError: pickle data was truncated'; now the file is removed, one line names it, the
    kernel compiles again and its entry is written whole (the next run loads it without a word).
    The data file (.nbc), then the index (.nbi)."""
    cache = tmp_path / "cache"
    env = environment(NUMBA_CACHE_DIR=str(cache))

    def run() -> subprocess.CompletedProcess:
        result = subprocess.run([sys.executable, "-c", ONE_KERNEL], capture_output=True, text=True, env=env,
                                timeout=600)
        assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
        return result

    run()
    for suffix, what in ((".nbc", "entry"), (".nbi", "index")):
        files = sorted(cache.rglob(f"*{suffix}"))
        assert len(files) == 1, files
        whole = files[0].read_bytes()
        with open(files[0], "r+b") as f:
            f.truncate(len(whole) // 2)
        lines = [line for line in run().stderr.splitlines() if "kernel cache:" in line]
        assert len(lines) == 1 and f"{what} {files[0]} cannot be read" in lines[0], lines
        assert "compiled again" in lines[0]
        assert len(files[0].read_bytes()) == len(whole)  # written again, whole
    assert "kernel cache:" not in run().stderr

"""Shared test set-up: cudasim tests run only in the process started with NUMBA_ENABLE_CUDASIM=1.

``ENGINE_TEST_GPU=1`` runs the same cudasim-marked tests on a real GPU instead (the standing order's
first step when one is lent, benchmarks/gpu_session.sh): the ``cudasim`` backend keeps NumPy arrays,
and numba.cuda copies them to the device and back around every launch, so every test body runs
unchanged against the real hardware.
"""

import os
import sys

import pytest

# Bytecode caches, even where PYTHONDONTWRITEBYTECODE is set (this machine's shells set it): the suite starts
# many Python processes (the command line, MPI ranks, fault drills), and without the caches each
# one compiled every engine and kernels module from source, and this process rewrote and compiled every test file.
# tests/test_faults.py alone: 49.2 -> 41.1 s of CPU. The caches live in the ignored __pycache__ folders beside
# the sources, where Numba's kernel caches already are; Python checks each against its source's mtime and size.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

ON_GPU = os.environ.get("ENGINE_TEST_GPU") == "1"
CUDASIM = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1" or ON_GPU


@pytest.fixture(autouse=True)
def _cudasim_backend_on_gpu(monkeypatch):
    """Under ENGINE_TEST_GPU=1, ``get_backend("cudasim")`` runs the CUDA kernels on the real device."""
    if ON_GPU:
        import engine.backend

        monkeypatch.setattr(engine.backend, "enable_cudasim", lambda: None)
    yield


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", help="also run the tests marked slow (long soaks)")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "cudasim" in item.keywords and not CUDASIM:
            item.add_marker(pytest.mark.skip(reason="needs NUMBA_ENABLE_CUDASIM=1 (tests/run runs it)"))
        if "slow" in item.keywords and not config.getoption("--slow"):
            item.add_marker(pytest.mark.skip(reason="a long soak: run with --slow"))


def import_torchvision():
    """torchvision's pure-Python parts without its C++ operators (``benchmarks/export_torchvision.py``, where
    the workaround lives and why), or a skip when torchvision is not installed (``pip install -e '.[test]'``)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "export_torchvision.py"
    spec = importlib.util.spec_from_file_location("export_torchvision", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    try:
        return module.import_torchvision()
    except ModuleNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture
def torchvision():
    """torchvision's models, transforms and datasets.folder, imported without its C++ operators."""
    return import_torchvision()


@pytest.fixture
def one_torch_thread():
    """torch on one thread for float64 references: on a busy 2-core machine its two spinning OpenMP
    threads took MobileNetV2's float64 forward+backward at 224×224 from 1.5 s to 71 s."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real 256 KiB tmpfs: a disk that fills (root only; skipped where mounting is not allowed)."""
    import subprocess

    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)

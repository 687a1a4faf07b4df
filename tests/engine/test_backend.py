import subprocess
import sys

import pytest

from engine import backend as backend_module
from engine.backend import BackendUnavailable, get_backend


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    import os

    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **env}, timeout=120
    )


def test_importing_engine_does_not_import_cupy_or_numba():
    result = run_python(
        "import sys, engine, engine.backend, engine.info\n"
        "print('cupy' in sys.modules, 'numba' in sys.modules)"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "False"]


def test_auto_is_cpu_without_a_gpu(monkeypatch):
    monkeypatch.setattr(backend_module, "cuda_unavailable_reason", lambda: "no GPU driver")
    backend = get_backend("auto")
    assert backend.name == "cpu"
    import numpy as np

    assert backend.xp is np
    block = backend.alloc_block(128)
    assert block.nbytes == 128 and block.dtype == np.uint8


def test_cuda_without_gpu_names_the_reason(monkeypatch):
    monkeypatch.setattr(backend_module, "cuda_unavailable_reason", lambda: "CuPy not installed (pip ...)")
    with pytest.raises(BackendUnavailable, match="cuda: CuPy not installed.*--backend cpu"):
        get_backend("cuda")


def test_unknown_backend_lists_the_choices():
    with pytest.raises(BackendUnavailable, match="unknown backend 'tpu'.*cpu, cuda, cudasim, auto"):
        get_backend("tpu")


def test_cudasim_selection_in_a_fresh_process():
    result = run_python(
        "from engine.backend import get_backend\n"
        "b = get_backend('cudasim')\n"
        "from numba import config\n"
        "print(b.name, config.ENABLE_CUDASIM)"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["cudasim", "1"]


def test_cudasim_after_numba_was_imported_says_how_to_start():
    result = run_python(
        "import numba\n"
        "from engine.backend import get_backend, BackendUnavailable\n"
        "try:\n    get_backend('cudasim')\nexcept BackendUnavailable as e:\n    print(e)\n",
        NUMBA_ENABLE_CUDASIM="0",
    )
    assert result.returncode == 0, result.stderr
    assert "NUMBA_ENABLE_CUDASIM=1" in result.stdout and "already imported" in result.stdout


def test_kernel_table_unwraps_tensor_like_arguments():
    seen = {}

    class FakeTensor:
        def kernel_array(self, op, argument):
            seen["call"] = (op, argument)
            return "array"

    table = backend_module.KernelTable("cpu", {"double": lambda a, b=None: (a, b)})
    assert table.double(FakeTensor(), b=3) == ("array", 3)
    assert seen["call"] == ("double", "argument 0")
    with pytest.raises(AttributeError, match="has no kernel 'nope'"):
        table.nope  # noqa: B018


def test_info_json_and_help():
    result = subprocess.run(["engine", "info", "--json"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    import json

    report = json.loads(result.stdout)
    assert report["backends"]["cpu"]["available"] is True
    assert report["backends"]["auto"]["resolves_to"] in ("cpu", "cuda")
    if report["versions"]["cupy"] is None:
        assert "CuPy not installed" in report["backends"]["cuda"]["reason"]
    # The layer the kernels run on (kernels.cpu.threads asks for OpenMP first), not Numba's default order,
    # which puts the TBB that the mkl wheel installs first.
    kernels_layer = subprocess.run(
        [sys.executable, "-c", "import kernels.cpu, numba; numba.get_num_threads(); print(numba.threading_layer())"],
        capture_output=True, text=True, timeout=120,
    )
    assert kernels_layer.returncode == 0, kernels_layer.stderr
    assert report["cpu"]["threading_layer"] == kernels_layer.stdout.strip()
    help_text = subprocess.run(["engine", "--help"], capture_output=True, text=True).stdout
    assert "info" in help_text


def test_blas_pin_advice_names_the_variable_and_the_fix(monkeypatch):
    from engine import info

    monkeypatch.setattr(info, "_cpu_flags", lambda: {"avx2", "avx512f"})
    monkeypatch.setenv("OPENBLAS_CORETYPE", "Haswell")
    advice = info.blas_pin_advice()
    assert "OPENBLAS_CORETYPE=Haswell" in advice and "env -u OPENBLAS_CORETYPE" in advice
    monkeypatch.setattr(info, "_cpu_flags", lambda: {"avx2"})  # nothing faster to gain on an AVX2 CPU
    assert info.blas_pin_advice() is None
    monkeypatch.delenv("OPENBLAS_CORETYPE")
    assert info.blas_pin_advice() is None

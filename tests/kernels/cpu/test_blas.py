"""The kernels' sgemm: MKL's when installed (sequential, reproducible mode), OpenBLAS on request or without it."""

import os
import subprocess
import sys
import textwrap

import pytest

import kernels.cpu  # noqa: F401  selects the sgemm, as every kernel user does
from kernels.cpu import blas

HAVE_MKL = blas._mkl_library_path() is not None


def run(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})


PROBE = """
    import numpy as np
    from numba import njit
    import kernels.cpu
    from kernels.cpu import blas

    @njit
    def product(a, b, out):
        np.dot(a, b, out)

    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = np.ones((4, 2), np.float32)
    out = np.empty((3, 2), np.float32)
    product(a, b, out)
    assert np.array_equal(out, a @ b)
    maps = open("/proc/self/maps").read()
    print(blas.select_sgemm(), "|", "libmkl_sequential" in maps, "|", blas.reproducible_mode())
"""


@pytest.mark.skipif(not HAVE_MKL, reason="the mkl wheel is not installed (x86-64 Linux only)")
def test_kernels_multiply_with_mkl_sequential_and_reproducible():
    result = run(PROBE, ENGINE_BLAS="mkl")
    assert result.returncode == 0, result.stderr
    name, loaded, mode = result.stdout.strip().split(" | ")
    assert name.startswith("MKL") and loaded == "True"  # np.dot inside @njit reached MKL's sequential layer
    assert int(mode) == 2 | 0x10000  # MKL_CBWR_AUTO | MKL_CBWR_STRICT


def test_auto_takes_mkl_on_intel_cpus_only():
    assert blas.auto_uses_mkl("GenuineIntel")
    assert not blas.auto_uses_mkl("AuthenticAMD") and not blas.auto_uses_mkl("")
    result = run(PROBE, ENGINE_BLAS="auto")
    assert result.returncode == 0, result.stderr
    name, loaded, _ = result.stdout.strip().split(" | ")
    mkl_here = HAVE_MKL and blas.auto_uses_mkl(blas.cpu_vendor())
    assert name.startswith("MKL") == mkl_here and loaded == str(mkl_here)  # no MKL pages where it is not used
    if blas.cpu_vendor() and not mkl_here:
        assert blas.cpu_vendor() in run("from kernels.cpu import blas; print(blas.selection_reason())").stdout


def test_engine_blas_openblas_keeps_scipys_sgemm():
    result = run(PROBE, ENGINE_BLAS="openblas")
    assert result.returncode == 0, result.stderr
    name, loaded, mode = result.stdout.strip().split(" | ")
    assert name == blas.OPENBLAS and loaded == "False" and mode == "None"


def test_a_bad_engine_blas_is_one_line_from_the_command_line():
    result = run("from cli import main; main(['train', '--model', 'mlp', '--steps', '1'])", ENGINE_BLAS="fastest")
    assert result.returncode == 1
    assert result.stderr.strip() == ("Error: ENGINE_BLAS='fastest' is not one of auto, mkl, openblas: "
                                     "set one of those, or unset it")


@pytest.mark.skipif(HAVE_MKL, reason="MKL is installed here")
def test_engine_blas_mkl_without_mkl_says_so():
    result = run("import kernels.cpu", ENGINE_BLAS="mkl")
    assert result.returncode != 0 and "MKL cannot be used" in result.stderr


# -- MKL is an extra (issue 33): its absence is a fallback under auto, an error when asked for -----------


@pytest.mark.parametrize(("wanted", "vendor", "installed", "use_mkl", "reason"), [
    ("auto", "GenuineIntel", True, True, "auto on GenuineIntel"),
    ("auto", "GenuineIntel", False, False, "would be faster here but is not installed (pip install -e '.[mkl]'"),
    ("auto", "AuthenticAMD", True, False, "MKL is chosen on Intel CPUs only; ENGINE_BLAS=mkl uses it"),
    ("auto", "AuthenticAMD", False, False, "Intel CPUs only; ENGINE_BLAS=mkl uses it (pip install -e '.[mkl]'"),
    ("auto", "", False, False, "auto on an unknown CPU vendor"),
    ("openblas", "GenuineIntel", True, False, "ENGINE_BLAS=openblas"),
    ("mkl", "AuthenticAMD", True, True, "ENGINE_BLAS=mkl"),
])
def test_choose_takes_mkl_only_where_installed_and_faster(wanted, vendor, installed, use_mkl, reason):
    chosen, why = blas.choose(wanted, vendor, installed)
    assert chosen is use_mkl and reason in why


def test_engine_blas_mkl_without_the_extra_names_it():
    with pytest.raises(blas.BlasError, match=r"not installed \(pip install -e '\.\[mkl\]'.*unset ENGINE_BLAS"):
        blas.choose("mkl", "GenuineIntel", False)
    with pytest.raises(blas.BlasError, match="is not one of auto, mkl, openblas"):
        blas.choose("fast", "GenuineIntel", True)


IMPORT_PROBE = """
    import os, sys

    seen = {}

    class Watch:  # records the variable when SciPy's BLAS module (which links its OpenBLAS) is imported
        def find_spec(self, name, path=None, target=None):
            if name == "scipy.linalg.cython_blas":
                seen["timeout"] = os.environ.get("OPENBLAS_THREAD_TIMEOUT")
            return None

    sys.meta_path.insert(0, Watch())
    import kernels.cpu
    print(seen.get("timeout"), "|", os.environ.get("OPENBLAS_THREAD_TIMEOUT"), "|",
          "scipy.linalg.cython_blas" in sys.modules)
"""


def test_openblas_loads_with_its_workers_sleeping_soon_and_the_environment_restored():
    """OpenBLAS reads OPENBLAS_THREAD_TIMEOUT once, as it loads: the kernels' import loads SciPy's with the
    engine's value (blas.OPENBLAS_THREAD_TIMEOUT, why there), and leaves the environment as it found it."""
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(IMPORT_PROBE)], capture_output=True, text=True,
                            timeout=300, env={**env, "ENGINE_BLAS": "openblas"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [blas.OPENBLAS_THREAD_TIMEOUT, "|", "None", "|", "True"]
    user = run(IMPORT_PROBE, ENGINE_BLAS="openblas", OPENBLAS_THREAD_TIMEOUT="20")
    assert user.stdout.split() == ["20", "|", "20", "|", "True"], user.stderr

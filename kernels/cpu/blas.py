"""Which sgemm the CPU kernels call: Intel MKL's when the ``mkl`` wheel is installed, else SciPy's OpenBLAS.

Why. The convolutions are GEMMs (``conv.py``, ``conv_shifted.py``), and a GEMM runs at its BLAS's
speed. Single-threaded, as the kernels call it (one GEMM per thread), on the shapes ResNet-18's 3×3
layers issue (M × K × N, GFLOP/s, best of 9, this 2-core AVX-512 machine):

    shape              MKL 2026.2   SciPy's OpenBLAS
    64 × 192 × 1056        163           139
    128 × 384 × 272        170           146
    256 × 768 × 288        177           146
    512 × 1536 × 320       169           149
    512 × 4608 × 256       160           121
    4608 × 512 × 256       164           118

and the whole ResNet-18 training step (``benchmarks/bench_train.py --models resnet18 --batch-size 32
--steps 8 --threads 2 --frameworks engine``, two alternating runs each): 49.1–50.1 images/s on
OpenBLAS, 59.3–59.8 on MKL (+20%). oneDNN, what PyTorch runs, reaches ~190 GFLOP/s per core with
its own direct kernels; OpenBLAS left the engine 1.18× behind it on this step.

How. Numba's BLAS path (``np.dot`` inside ``@njit``, and ``numba_xxgemm``, which ``conv_shifted``
calls with leading dimensions) finds ``sgemm`` in ``scipy.linalg.cython_blas.__pyx_capi__``, the
table of C functions that Cython modules export to each other, the first time a kernel multiplies,
and keeps that pointer for the process. ``select_sgemm`` runs before any kernel (``kernels.cpu``'s
import), loads MKL's single dynamic library and puts MKL's Fortran ``sgemm_`` there under the same
name: the same Fortran ABI (32-bit integers, arguments by reference), so nothing else changes and
the compiled kernels stay in Numba's on-disk cache (they call the helper, not an address).

MKL runs **sequential** (the kernels give each thread its own GEMM; MKL's own threads would
oversubscribe the cores) and in **conditional numerical reproducibility** mode
(``MKL_CBWR_Set(AUTO | STRICT)``): without it MKL may pick a different code path for differently
aligned operands, and the offload arena places a layer's tensors at other addresses than the
workspaces do, which would break "offload on or off, the same weights". The CNR mode cost nothing
measurable on the shapes above. Without it, four GEMM shapes at three misalignments (4, 12
and 32 bytes) gave the same bits as aligned operands here too, but MKL documents alignment as a
source of run-to-run differences outside that mode, so it stays on.

**Which, by default (``ENGINE_BLAS=auto``): MKL on Intel CPUs, OpenBLAS on the others.** MKL picks
its kernels by CPU vendor: on an AMD EPYC (Zen 4, AVX-512, this project's other machine kind) it
loads its generic ``libmkl_def`` code path, not the AVX-512 one. Measured there, the engine's
training step with MKL against OpenBLAS (``bench_train.py --frameworks engine --steps 8 --threads 2``,
alternating, images/s): ResNet-18 47.1 / 44.6 against 48.2 / 46.0 (level), MobileNetV2 94.7 / 95.5
against 92.2 / 86.8 (MKL ~5% ahead); single-threaded sgemm 80–100 against 65–97 GFLOP/s. And MKL's
first sgemm costs the process 22 MiB of resident memory (15 MiB of its libraries' pages, the rest its
buffers): the README main command peaks at 394 MiB with MKL, 372 with OpenBLAS. Where MKL does not
win its speed clearly, its memory decides. ``engine info`` names the choice and the reason.

``ENGINE_BLAS=mkl`` uses MKL on any CPU (and makes a missing MKL an error instead of a silent
fallback); ``ENGINE_BLAS=openblas`` keeps SciPy's OpenBLAS.

**MKL is an extra** (``pip install -e '.[mkl]'``, x86-64 Linux): its wheels are 926 MiB of a 1.6 GB
base install, for a speed-up that exists on Intel CPUs only. Without it, ``auto`` takes OpenBLAS on
every CPU and ``engine info`` says why and how to add MKL; the test extra installs it, so CI tests
the MKL path. ``choose`` is the whole rule, as a function of the request, the vendor and whether
MKL is installed.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

from kernels.errors import BlasError

_MKL_SEQUENTIAL = 1  # MKL_Set_Threading_Layer: MKL_THREADING_SEQUENTIAL
_MKL_CBWR_AUTO = 2
_MKL_CBWR_STRICT = 0x10000
_MKL_CBWR_SUCCESS = 0

OPENBLAS = "OpenBLAS (SciPy's)"
MKL_VENDORS = ("GenuineIntel",)  # where ENGINE_BLAS=auto loads MKL (see the module docstring)
MKL_INSTALL = "pip install -e '.[mkl]', or pip install mkl"  # the extra that brings MKL
_selected: str | None = None
_reason = ""
_library: ctypes.CDLL | None = None  # kept loaded for the life of the process
_keep: list[bytes] = []  # capsule names: a capsule points at its name's buffer


def _mkl_library_path() -> Path | None:
    """libmkl_rt from the installed ``mkl`` distribution (its files sit in the environment's lib/)."""
    from importlib import metadata

    try:
        distribution = metadata.distribution("mkl")
    except metadata.PackageNotFoundError:
        return None
    for file in distribution.files or ():
        if file.name.startswith("libmkl_rt.so"):
            path = Path(distribution.locate_file(file)).resolve()
            if path.exists():
                return path
    return None


def _load_mkl() -> tuple[ctypes.CDLL, str]:
    path = _mkl_library_path()
    if path is None:
        raise BlasError(f"the mkl package is not installed ({MKL_INSTALL}), or has no libmkl_rt")
    library = ctypes.CDLL(str(path))
    # The threading layer first: any other call would load MKL's default (Intel OpenMP) layer.
    library.MKL_Set_Threading_Layer(ctypes.c_int(_MKL_SEQUENTIAL))
    cbwr = library.MKL_CBWR_Set(ctypes.c_int(_MKL_CBWR_AUTO | _MKL_CBWR_STRICT))  # before any computation
    if cbwr != _MKL_CBWR_SUCCESS:
        raise BlasError(f"MKL refused reproducible mode (MKL_CBWR_Set returned {cbwr})")
    from importlib import metadata

    return library, f"MKL {metadata.version('mkl')} (sequential, reproducible mode)"


def _install_sgemm(address: int) -> None:
    """Put ``address`` (a Fortran sgemm) where Numba looks up SciPy's sgemm (module docstring)."""
    import scipy.linalg.cython_blas as cython_blas

    api = ctypes.pythonapi
    api.PyCapsule_GetName.restype = ctypes.c_char_p
    api.PyCapsule_GetName.argtypes = [ctypes.py_object]
    api.PyCapsule_New.restype = ctypes.py_object
    api.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    table = cython_blas.__pyx_capi__
    signature = api.PyCapsule_GetName(table["sgemm"])  # the C signature string Cython checks on import
    _keep.append(signature)  # the capsule points at this buffer: it must outlive the capsule
    table["sgemm"] = api.PyCapsule_New(address, signature, None)



def choose(wanted: str, vendor: str, mkl_installed: bool) -> tuple[bool, str]:
    """``ENGINE_BLAS``'s rule: (whether to load MKL, why), for ``wanted`` (auto, mkl, openblas) on a CPU of
    ``vendor``, with or without the ``mkl`` extra installed. BlasError for a value not in the list, and
    for ``mkl`` without MKL installed (asked for explicitly, its absence is an error, not a fallback)."""
    if wanted not in ("auto", "mkl", "openblas"):
        raise BlasError(f"ENGINE_BLAS={wanted!r} is not one of auto, mkl, openblas: set one of those, or unset it")
    if wanted == "openblas":
        return False, "ENGINE_BLAS=openblas"
    if wanted == "mkl":
        if not mkl_installed:
            raise BlasError("ENGINE_BLAS=mkl, but MKL cannot be used: the mkl package is not installed "
                            f"({MKL_INSTALL}); unset ENGINE_BLAS to use OpenBLAS")
        return True, "ENGINE_BLAS=mkl"
    if not auto_uses_mkl(vendor):
        return False, (f"auto on {vendor or 'an unknown CPU vendor'}: MKL is chosen on Intel CPUs only; "
                       "ENGINE_BLAS=mkl uses it" + ("" if mkl_installed else f" ({MKL_INSTALL})"))
    if not mkl_installed:
        return False, f"auto on {vendor}: MKL would be faster here but is not installed ({MKL_INSTALL})"
    return True, f"auto on {vendor}"


def select_sgemm() -> str:
    """Choose the kernels' sgemm once per process (``ENGINE_BLAS``: auto, mkl, openblas); returns its name.

    Must run before any kernel multiplies: Numba keeps the first sgemm it finds.
    """
    global _selected, _library, _reason
    if _selected is not None:
        return _selected
    wanted = os.environ.get("ENGINE_BLAS", "auto").strip().lower() or "auto"
    use_mkl, reason = choose(wanted, cpu_vendor() if wanted == "auto" else "", _mkl_library_path() is not None)
    if not use_mkl:
        _load_openblas()
        _selected, _reason = OPENBLAS, reason
        return _selected
    try:
        library, name = _load_mkl()
    except (BlasError, OSError, AttributeError) as exc:  # installed, but its library does not load
        if wanted == "mkl":
            raise BlasError(f"ENGINE_BLAS=mkl, but MKL cannot be used: {exc}; unset ENGINE_BLAS to use OpenBLAS") \
                from exc
        _selected, _reason = OPENBLAS, f"auto: MKL cannot be used ({exc})"
        return _selected
    _install_sgemm(ctypes.cast(library.sgemm_, ctypes.c_void_p).value)
    _library, _selected, _reason = library, name, reason
    return _selected


OPENBLAS_THREAD_TIMEOUT = "4"
"""log2 of the cycles an idle OpenBLAS worker spins before it sleeps (OpenBLAS's ``OPENBLAS_THREAD_TIMEOUT``;
4, its least, against its default 28: 2^28 cycles, ~100 ms here).

Why. The dense layers are the one place the engine lets OpenBLAS thread a GEMM itself (``dense.py``). After
ResNet-18's classifier head, OpenBLAS's worker spun for ~100 ms on one of the two cores while the first backward
convolutions ran their two threads: at 224×224, batch 32, ``layer4.1.conv2``'s backward-data took 35–54 ms against
19–22 ms for the same call on the same shape a layer later, or after a 0.5 s sleep (each conv call of a step timed
through the kernel table's ``intercept`` hook; ``python benchmarks/step_profile.py --model resnet18 --nodes 12``
shows it per node: ``layer4.1.conv2``'s backward 90 ms against 48–52 for its siblings). The training step
(``benchmarks/bench_train.py --frameworks engine --models resnet18 --image-size 224 --steps 8 --threads 2 --runs
1``, three rounds alternating, 2026-11-28, quiet): 18.9 / 19.2 / 17.0 images/s with the default, 19.4 / 19.5 / 19.3
with 4. A sleeping worker costs a wake-up (tens of µs) per threaded GEMM: three a step."""


def _load_openblas() -> None:
    """Load SciPy's OpenBLAS (what Numba's sgemm calls) now, with ``OPENBLAS_THREAD_TIMEOUT`` set, which OpenBLAS
    reads once, when it loads. A value the user set is left alone; the variable is restored after (the process's
    environment is the user's). If SciPy's OpenBLAS was loaded earlier, this changes nothing."""
    previous = os.environ.get("OPENBLAS_THREAD_TIMEOUT")
    if previous is None:
        os.environ["OPENBLAS_THREAD_TIMEOUT"] = OPENBLAS_THREAD_TIMEOUT
    try:
        import scipy.linalg.cython_blas  # noqa: F401  links SciPy's OpenBLAS: its initializer reads the variable
    finally:
        if previous is None:
            del os.environ["OPENBLAS_THREAD_TIMEOUT"]


def selection_reason() -> str:
    """Why ``select_sgemm`` chose what it did (``engine info`` shows it beside the name)."""
    select_sgemm()
    return _reason


def cpu_vendor() -> str:
    """The CPU's vendor string (``GenuineIntel``, ``AuthenticAMD``, ...) from /proc/cpuinfo; "" where unknown."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def auto_uses_mkl(vendor: str) -> bool:
    """``ENGINE_BLAS=auto``'s rule: MKL on the vendors whose CPUs MKL runs its own fast kernels on."""
    return vendor in MKL_VENDORS


def reproducible_mode() -> int | None:
    """MKL's conditional-reproducibility setting (``MKL_CBWR_Get``); None when MKL is not in use."""
    select_sgemm()
    return None if _library is None else int(_library.MKL_CBWR_Get(ctypes.c_int(-1)))

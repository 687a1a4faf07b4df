"""Errors the kernel packages raise that the command line turns into one line (cli.EngineGroup).

Here, not in ``kernels.cpu``, so the command line can name them without importing the CPU kernels
(whose import selects the BLAS and starts Numba's threads)."""


class SettingError(RuntimeError):
    """An ``ENGINE_*`` environment variable the kernels read holds a value they cannot use."""


class BlasError(SettingError):
    """ENGINE_BLAS asked for a BLAS that cannot be used (kernels/cpu/blas.py)."""

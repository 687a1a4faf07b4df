"""Errors the kernel packages raise that the command line turns into one line (cli.EngineGroup).

Here, not in ``kernels.cpu``, so the command line can name them without importing the CPU kernels
(whose import selects the BLAS and starts Numba's threads)."""


class BlasError(RuntimeError):
    """ENGINE_BLAS asked for a BLAS that cannot be used (kernels/cpu/blas.py)."""

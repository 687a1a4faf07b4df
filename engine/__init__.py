"""A readable training engine: Numba kernels, typed workspaces, disk offload of layer windows.

Importing ``engine`` is cheap and safe everywhere: it imports neither numba nor CuPy.
"""

__version__ = "0.1.0"

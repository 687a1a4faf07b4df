"""Argument checks the CPU kernel wrappers run before a kernel: a wrong array fails with its name.

A Numba kernel handed a float64 array silently compiles a second version, and one handed a
non-contiguous view silently runs slower or writes into a copy; checking first turns both into an
error that names the kernel, the argument and what to pass instead.
"""

from __future__ import annotations

import numpy as np


def check_array(
    op: str, name: str, array: object, shape: tuple[int, ...] | None = None, dtype: type = np.float32
) -> np.ndarray:
    """Raise unless ``array`` is a C-contiguous ndarray of ``dtype`` (and ``shape``, when given)."""
    if not isinstance(array, np.ndarray):
        raise TypeError(f"{op}: {name} must be a NumPy array on the cpu backend, got {type(array).__name__}")
    if array.dtype != dtype:
        raise TypeError(f"{op}: {name} must be {np.dtype(dtype).name}, got {array.dtype}; convert it with .astype()")
    if not array.flags.c_contiguous:
        raise ValueError(f"{op}: {name} must be C-contiguous; pass np.ascontiguousarray({name})")
    if shape is not None and array.shape != tuple(shape):
        raise ValueError(f"{op}: {name} has shape {array.shape}, expected {tuple(shape)}")
    return array


def same_memory(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether ``a`` and ``b`` are the same elements: one array, or views of the same memory and layout. The kernels
    with an in-place branch (element-wise, batch norm's chunk kernels) take it when the written array is a read one;
    an array that overlaps another only in part is not a supported argument of any of them."""
    return (a.shape == b.shape and a.strides == b.strides
            and a.__array_interface__["data"][0] == b.__array_interface__["data"][0])

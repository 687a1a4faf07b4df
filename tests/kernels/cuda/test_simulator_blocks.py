"""The simulator's block manager as kernels/cuda/_launch.py replaces it: barriers hold, exceptions surface."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda, float32  # module globals: the simulator swaps a kernel's global `cuda` for its own

pytestmark = pytest.mark.cudasim


def test_the_patched_manager_is_the_one_running_and_barriers_hold():
    from numba.cuda.simulator import kernel as simulator

    from kernels.cuda import _launch

    assert simulator.BlockManager.run.__module__ == _launch.__name__

    @cuda.jit
    def rotate_twice(out):
        shared = cuda.shared.array(16, float32)
        i = cuda.threadIdx.x
        shared[i] = i
        cuda.syncthreads()  # without the barrier a thread may read a neighbour's slot before it is written
        value = shared[(i + 1) % 16]
        cuda.syncthreads()
        shared[i] = value
        cuda.syncthreads()
        out[cuda.blockIdx.x, i] = shared[(i + 1) % 16]

    out = np.full((3, 16), -1, np.float32)
    rotate_twice[3, 16](out)
    assert np.array_equal(out, np.tile((np.arange(16) + 2) % 16, (3, 1)).astype(np.float32))


def test_an_exception_in_one_thread_stops_the_block_and_is_raised():
    @cuda.jit
    def fails_in_thread_5(out):
        i = cuda.threadIdx.x
        cuda.syncthreads()
        out[i + (100 if i == 5 else 0)] = 1.0  # thread 5 writes past the end

    with pytest.raises(IndexError):
        fails_in_thread_5[1, 8](np.zeros(8, np.float32))

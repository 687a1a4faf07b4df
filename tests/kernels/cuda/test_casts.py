"""The simulator's integer casts (kernels/cuda/_launch.py) give the values numba's casts give on a GPU."""

from __future__ import annotations

import numpy as np
import pytest

from kernels.cuda import _launch

EDGES = [0, 1, 7, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**32 + 5, 2**63 - 1, -1, -2, -(2**31), -(2**31) - 1,
         -(2**32) - 3, -(2**63)]


@pytest.mark.parametrize("bits, dtype", [(32, np.uint32), (64, np.uint64)])
def test_unsigned_casts_wrap_like_the_machine_type(bits, dtype):
    cast = _launch._wrap_unsigned(bits)
    for value in EDGES:
        expected = int(np.array(value, np.int64).astype(dtype)) if -(2**63) <= value < 2**63 else None
        got = cast(value)
        assert isinstance(got, int) and 0 <= got < 2**bits
        if expected is not None:
            assert got == expected, value
    assert cast(np.int64(-1)) == 2**bits - 1 and cast(np.uint32(5)) == 5  # NumPy scalars in, Python ints out


def test_int64_cast_is_twos_complement():
    for value in EDGES + [2**63, 2**64 - 1, 2**64 + 9]:
        expected = int(np.array(value & (2**64 - 1), np.uint64).astype(np.int64))
        assert _launch._wrap_int64(value) == expected, value


def test_the_kernels_use_the_casts_chosen_for_this_process():
    import numba

    from kernels.cuda import conv, gemm

    simulated = bool(numba.config.ENABLE_CUDASIM)
    assert (conv.uint32 is numba.uint32) is not simulated and gemm.U32 is conv.uint32
    assert (conv.int64 is numba.int64) is not simulated and (conv.uint64 is numba.uint64) is not simulated

"""Every CUDA kernel compiles to PTX for real GPUs (compute capability 8.0 and 9.0), no GPU needed.

The simulator runs kernels as plain Python and accepts code the CUDA compiler rejects (a float64
sneaking into a shared array, an unsupported call); this test builds each kernel with the types the
launchers pass (float32 arrays, int64 sizes, float32 scalars) through NVVM, which is what a GPU run
would do first. It runs in the normal test process, without NUMBA_ENABLE_CUDASIM.
"""

from __future__ import annotations

import importlib
import os

import pytest

if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
    pytest.skip("compile_ptx needs the real CUDA target, not the simulator", allow_module_level=True)

from numba import cuda, types  # noqa: E402
from numba.cuda.dispatcher import CUDADispatcher  # noqa: E402

FAMILIES = ("gemm", "conv", "channels", "elementwise", "pool", "batchnorm", "loss", "optim")
COMPUTE_CAPABILITIES = [(8, 0), (9, 0)]

f32 = types.float32
i64 = types.int64
boolean = types.boolean


def array(dtype, ndim, layout="C"):
    return types.Array(dtype, ndim, layout)


f1, f2, f3, f4 = (array(f32, d) for d in (1, 2, 3, 4))
f2_any = array(f32, 2, "A")
f2_fortran = array(f32, 2, "F")
u8_1 = array(types.uint8, 1)
u8_2 = array(types.uint8, 2)
u8_4 = array(types.uint8, 4)
i32_2 = array(types.int32, 2)
i32_4 = array(types.int32, 4)
i64_1 = array(i64, 1)

# Kernel name -> the argument types its launchers pass (one signature per layout combination).
SIGNATURES = {
    "gemm_v1_naive": [(f2, f2, f2, boolean), (f2_fortran, f2, f2, boolean), (f2, f2_fortran, f2, boolean)],
    "gemm_v2_tiled": [(f2, f2, f2, boolean), (f2_any, f2_any, f2_any, boolean)],
    "gemm_v3_register_blocked": [(f2, f2, f2, boolean), (f2_any, f2_any, f2_any, boolean)],
    "im2col": [(f4, f2, i64, i64, i64, i64, i64, i64, i64)],
    "col2im": [(f2, f4, i64, i64, i64, i64, i64, i64, i64, i64)],
    "direct_conv_forward": [(f4, f4, f4, i64, i64, i64)],
    "direct_conv_backward_data": [(f4, f4, f4, i64, i64, i64)],
    "direct_conv_backward_weight": [(f4, f4, f4, i64, i64, i64)],
    "channel_sum": [(f3, f1)],
    "add_channel_bias": [(f3, f1)],
    "relu_forward_kernel": [(f1, f1)],
    "relu_backward_kernel": [(f1, f1, f1)],
    "relu6_forward_kernel": [(f1, f1)],
    "relu6_backward_kernel": [(f1, f1, f1)],
    "add_kernel": [(f1, f1, f1)],
    "dropout_kernel": [(f1, u8_1, f32, f1)],
    "maxpool_forward_kernel": [(f4, f4, i32_4, i64, i64, i64, boolean), (f4, f4, u8_4, i64, i64, i64, boolean)],
    "maxpool_backward_kernel": [(f2, i32_2, f2)],
    "maxpool_backward_local_kernel": [(f2, u8_2, f2, i64, i64, i64, i64, i64)],
    "avgpool_forward_kernel": [(f4, f4, i64, i64, i64)],
    "avgpool_backward_kernel": [(f4, f4, i64, i64, i64)],
    "global_avgpool_forward_kernel": [(f2, f1)],
    "global_avgpool_backward_kernel": [(f1, f2)],
    "batchnorm_train_kernel": [(f3, f1, f1, f1, f1, f3, f1, f1, f32, f32)],
    "batchnorm_infer_kernel": [(f3, f1, f1, f1, f1, f3, f32)],
    "batchnorm_backward_kernel": [(f3, f3, f1, f1, f1, f3, f1, f1)],
    "batchnorm_backward_from_output_kernel": [(f3, f3, f1, f1, f1, f3, f1, f1)],
    "softmax_xent_forward_kernel": [(f2, i64_1, f2, f1)],
    "softmax_xent_backward_kernel": [(f2, i64_1, f2)],
    "sgd_kernel": [(f1, f1, f1, f32, f32, f32, boolean)],
    "adam_kernel": [(f1, f1, f1, f1, f32, f32, f32, f32, f32, f32)],
}


def all_kernels() -> dict[str, CUDADispatcher]:
    """Every @cuda.jit kernel (not device function) defined in the kernels.cuda family modules."""
    kernels = {}
    for family in FAMILIES:
        module = importlib.import_module(f"kernels.cuda.{family}")
        for name, value in vars(module).items():
            if isinstance(value, CUDADispatcher) and not value.targetoptions.get("device"):
                if value.py_func.__module__ == module.__name__:
                    kernels[name] = value
    return kernels


def test_every_kernel_has_a_signature_here():
    assert set(all_kernels()) == set(SIGNATURES)


@pytest.mark.parametrize("cc", COMPUTE_CAPABILITIES, ids=lambda cc: f"sm_{cc[0]}{cc[1]}")
@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_kernel_compiles_to_ptx(name, cc):
    kernel = all_kernels()[name]
    for signature in SIGNATURES[name]:
        ptx, return_type = cuda.compile_ptx(kernel.py_func, signature, cc=cc)
        assert return_type == types.void
        assert f".target sm_{cc[0]}{cc[1]}" in ptx
        assert ".entry" in ptx


def test_register_blocked_gemm_keeps_its_tile_in_registers():
    """What v3 buys, read off the PTX: no local (spilled) memory, and more FMAs per shared-memory load than v2."""
    from kernels.cuda import gemm

    signature = (f2, f2, f2, boolean)
    tiled, _ = cuda.compile_ptx(gemm.gemm_v2_tiled.py_func, signature, cc=(8, 0))
    blocked, _ = cuda.compile_ptx(gemm.gemm_v3_register_blocked.py_func, signature, cc=(8, 0))
    assert ".local" not in blocked  # the 4×4 accumulators and fragments live in registers

    def fma_per_shared_load(ptx: str) -> float:
        return ptx.count("fma.rn.f32") / ptx.count("ld.shared.f32")

    assert fma_per_shared_load(blocked) >= 4 * fma_per_shared_load(tiled)

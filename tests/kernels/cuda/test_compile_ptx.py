"""Every CUDA kernel builds for real GPUs (sm_80, sm_90) without one, and ptxas says it fits.

The simulator runs kernels as plain Python and accepts code the CUDA compiler rejects (a float64
sneaking into a shared array, an unsupported call); these tests build each kernel with the types the
launchers pass (float32 arrays, int64 sizes, float32 scalars) through NVVM, which is what a GPU run
would do first, then assemble the PTX with ``ptxas -v`` (engine/bench/cuda_static.py, the same code
as `engine kernels --backend cuda --static`). A kernel fails if it spills registers or keeps a
local array in memory (stack frame), or, for the GEMM kernels, if its theoretical occupancy at the
launchers' block size falls below ``GEMM_OCCUPANCY_FLOOR``. Each (kernel, architecture) is compiled
once per process and shared by the tests below. Runs without NUMBA_ENABLE_CUDASIM.
"""

from __future__ import annotations

import os

import pytest

if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
    pytest.skip("compile_ptx needs the real CUDA target, not the simulator", allow_module_level=True)

from engine.bench import cuda_static  # noqa: E402

ALL_SPECS = {spec.name: spec for spec in cuda_static.catalog()}
FAMILY_BUILDS = {
    name for name, spec in ALL_SPECS.items()
    if (config := cuda_static.tile_config_of(name)) is not None
    and (name.startswith("conv_backward_data") or config.name == "64x64k8t4x4")
}
"""The tile family's builds this test makes: every candidate with the operand set that needs the most
registers (backward data), and the default configuration with all four. Each build takes 3–8 s; the
rest (every candidate × operand set × architecture) is `engine kernels --backend cuda --static`."""
SPECS = {name: spec for name, spec in ALL_SPECS.items() if cuda_static.tile_config_of(name) is None
         or name in FAMILY_BUILDS}


def test_every_kernel_is_in_the_catalog():
    """A new @cuda.jit kernel must get its launch types in engine/bench/cuda_static.py, or this fails."""
    module_kernels = set(cuda_static.module_kernels())
    assert module_kernels <= set(SPECS)
    from kernels.cuda import gemm

    for config in gemm.CANDIDATES.values():
        assert f"conv_backward_data_tiles_{config.name.replace('-', '_')}" in FAMILY_BUILDS
    for version in ("v1_naive", "v2_tiled", "v3_register_blocked"):
        for operands in ("gemm", "conv_forward", "conv_backward_data", "conv_backward_weight"):
            assert f"{operands}_{version}" in SPECS


def _cases():
    for name in sorted(SPECS):
        # the family's builds on sm_90 only (the H100 the GPU sessions get); everything else on both
        ccs = ((9, 0),) if name in FAMILY_BUILDS else cuda_static.COMPUTE_CAPABILITIES
        for cc in ccs:
            yield pytest.param(name, cc, id=f"{name}-sm_{cc[0]}{cc[1]}")


@pytest.mark.parametrize("name, cc", list(_cases()))
def test_kernel_builds_without_spills(name, cc):
    spec = SPECS[name]
    ptx = cuda_static.build_ptx(spec, cc)
    assert f".target sm_{cc[0]}{cc[1]}" in ptx and ".entry" in ptx
    assert ".func" not in ptx  # device functions (block_sum, GEMM operands) are inlined
    r = cuda_static.resources(spec, cc)
    assert (r.spill_stores, r.spill_loads, r.stack_bytes) == (0, 0, 0), r
    config = cuda_static.tile_config_of(name)
    if config is not None:  # the tile family: ptxas keeps the launch bound the configuration asks for
        assert r.blocks_per_sm >= (config.min_blocks or 1), r
    elif spec.family == "gemm":
        assert r.occupancy >= cuda_static.GEMM_OCCUPANCY_FLOOR, r


def test_register_blocked_gemm_keeps_its_tile_in_registers():
    """What v3 buys, read off the PTX: no local memory, and more FMAs per shared-memory load than v2.

    Counted over the whole PTX (sm_80): v2 has 16 FMAs to 32 shared loads (0.5), v3 16 to 16 (1.0;
    its inner loop is 16 FMAs to 8 loads, the epilogue through shared memory adds loads outside it).
    """
    tiled = cuda_static.build_ptx(SPECS["gemm_v2_tiled"], (8, 0))
    for name in ("gemm_v3_register_blocked", "conv_forward_v3_register_blocked"):
        blocked = cuda_static.build_ptx(SPECS[name], (8, 0))
        assert ".local" not in blocked  # the 4×4 accumulators and fragments live in registers

        def fma_per_shared_load(ptx: str) -> float:
            return ptx.count("fma.rn.f32") / ptx.count("ld.shared.f32")

        assert fma_per_shared_load(blocked) >= 2 * fma_per_shared_load(tiled), name


def test_occupancy_calculator():
    """The calculator against hand-worked cases (CUDA occupancy calculator rules, sm_80)."""
    a100 = cuda_static.ARCHS[(8, 0)]
    assert cuda_static.occupancy(32, 0, 256, a100) == (8, 1.0, "warps")  # 8 warps a block, 64 max
    assert cuda_static.occupancy(80, 20480, 256, a100)[:2] == (3, 0.375)  # 80·32 = 2560 regs a warp: 25 warps
    assert cuda_static.occupancy(126, 0, 256, a100)[:2] == (2, 0.25)  # 4096 a warp: 16 warps
    blocks, _, limit = cuda_static.occupancy(16, 48 * 1024, 256, a100)  # (48 + 1) KiB a block: 3 fit in 164
    assert (blocks, limit) == (3, "shared memory")


SYNTHETIC_SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   LDG.E R2, desc[UR4][R4.64] ;
        /*0020*/                   IMAD.WIDE R6, R3, 0x4, R8 ;
.L_x_0:
        /*0030*/                   LDS.128 R12, [R10] ;
        /*0040*/                   FFMA R20, R12, R13, R20 ;
        /*0050*/                   FFMA R21, R12, R14, R21 ;
        /*0060*/              @P0 BRA `(.L_x_0) ;
        /*0070*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0080*/                   CALL.REL.NOINC `($__internal_0_$__cuda_sm20_div_s64) ;
        /*0090*/              @P1 BRA `(.L_x_1) ;
        /*00a0*/                   EXIT ;
"""


def test_main_loop_counts_a_rolled_k_loop_once_per_trip():
    """The slab loop holds a rolled k loop of 2 FFMAs: a 4-deep slab of 2×2 patches (16 FFMAs) is 8 trips."""
    from kernels.cuda.gemm import TileConfig

    loop = cuda_static.main_loop(SYNTHETIC_SASS, TileConfig(8, 8, 4, 2, 2))
    assert loop.rolled_k and loop.ffma == 16
    assert loop.instructions == 8 * 4 + 5  # the k loop's 4 instructions 8 times, the slab's other 5 once
    assert loop.shared_loads == {128: 8} and loop.global_loads == 1 and loop.int64 == 1 and loop.calls == 1
    assert loop.per_ffma == (8 * 4 + 5) / 16


@pytest.mark.skipif(cuda_static.nvdisasm_path() is None, reason="nvdisasm (the test extra) is not installed")
@pytest.mark.parametrize("name", sorted(FAMILY_BUILDS))
def test_tile_loop_in_sass(name):
    """What the tile loop costs the GPU, read off its sm_90 SASS: no 64-bit division (the conv operands'
    per-k index arithmetic multiplies by precomputed reciprocals), each fragment read from shared memory
    as vector_m / vector_n words at a time (LDS.128 for 4), the k loop of a slab spelled out (no loop
    inside the slab loop), and at most a bound of instructions per FFMA in a k-slab.

    Before the loop was rewritten, the default 64×64 4×4 plain GEMM's slab was 5.96 instructions per FFMA
    with scalar LDS only, and its backward data 17.05 with 20 calls to the 64-bit division a slab; after,
    1.76 and 2.77 with none (every figure in kernels/README.md, "The tile loop in SASS")."""
    config = cuda_static.tile_config_of(name)
    r = cuda_static.resources(SPECS[name], (9, 0))
    loop = r.loop
    assert loop is not None and loop.calls == 0 and not loop.rolled_k, loop
    assert set(loop.shared_loads) <= {32 * config.vector_m, 32 * config.vector_n}, loop
    bound = {"gemm": 1.9, "conv_forward": 2.5, "conv_backward_weight": 2.75}.get(name.split("_tiles_")[0], 3.0)
    if config.thread_m * config.thread_n >= 16:  # 2×2 patches are latency-bound small tiles: no bound
        assert loop.per_ffma <= bound, loop

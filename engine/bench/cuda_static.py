"""`engine kernels --backend cuda --static`: what each CUDA kernel costs a real GPU, known without one.

For every kernel of kernels/cuda (and every GEMM version, for every operand set: the plain GEMM and
the three implicit-GEMM conv directions) this builds PTX with ``numba.cuda.compile_ptx`` for sm_80
(A100) and sm_90 (H100), assembles it with ``ptxas -v`` from the nvidia-cuda-nvcc wheel, and reads
off registers per thread, spill stores/loads, static shared memory and the stack frame. From those
and the launch configuration the launchers use (``threads`` below) it computes the theoretical
occupancy the way NVIDIA's occupancy calculator does: the resident blocks per SM are the least of
the warp limit, the register-file limit (registers allocated per warp in units of 256), the shared
memory limit (allocated in units of 128 bytes plus 1 KiB the system reserves per block on sm_80 and
later) and the block limit. Spills matter because a spilled value goes to local memory (DRAM behind
L1), per access; occupancy because latency is hidden by switching among resident warps.

numba-cuda compiles a device function for the *current* GPU (``get_current_device()``), which fails
on a machine without one. ``stand_in_device(cc)`` answers that question with the compute capability
being built for, only for the duration of one ``compile_ptx``; on a GPU machine nothing is patched
by the engine itself.
"""

from __future__ import annotations

import functools
import importlib
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from types import SimpleNamespace
from typing import Any

COMPUTE_CAPABILITIES = ((8, 0), (9, 0))
FAMILIES = ("gemm", "conv", "channels", "elementwise", "pool", "batchnorm", "loss", "optim")


@dataclass(frozen=True)
class Arch:
    """Per-SM limits of one architecture (CUDA C Programming Guide, 'Compute Capabilities' table)."""

    name: str
    gpu: str
    max_warps: int = 64
    max_blocks: int = 32
    registers: int = 65536
    register_unit: int = 256  # registers are allocated per warp in units of this many
    shared_bytes: int = 167936  # usable shared memory per SM
    shared_unit: int = 128
    shared_reserved: int = 1024  # per block, taken by the system on sm_80 and later


ARCHS = {
    (8, 0): Arch("sm_80", "A100", shared_bytes=164 * 1024),
    (9, 0): Arch("sm_90", "H100", shared_bytes=228 * 1024),
}

GEMM_OCCUPANCY_FLOOR = 0.375
"""The least theoretical occupancy any GEMM kernel (every version, every operand set) may have.

A register-blocked GEMM keeps its 4×4 accumulators, fragments and addresses in registers and hides
latency with independent FMAs (instruction-level parallelism) more than with resident warps: tuned
SGEMM kernels (CUTLASS, cuBLAS) run at 12–25%. Ours has no software pipelining of its global loads,
so it needs warps to hide them: 37.5% is three 256-thread blocks per SM, what v3's launch bound
(``V3_MIN_BLOCKS_PER_SM``) buys without a spill. Unbounded, v3 sat at 25% (108–126 registers)."""


@dataclass(frozen=True)
class KernelSpec:
    """A kernel as the static report builds it: where it lives, its argument types, its block size."""

    name: str
    family: str
    kernel: Any
    signature: tuple[Any, ...]
    threads: int  # threads per block at the launch configuration the launcher uses


@dataclass(frozen=True)
class Resources:
    """What ptxas reports for one kernel on one architecture, and the occupancy that follows."""

    kernel: str
    family: str
    arch: str
    registers: int
    spill_stores: int
    spill_loads: int
    stack_bytes: int
    shared_bytes: int
    threads: int
    blocks_per_sm: int
    occupancy: float
    limited_by: str
    loop: MainLoop | None = None  # the tile family's main loop in SASS (None: another kernel, or no nvdisasm)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class MainLoop:
    """One k-slab of a tile-family GEMM's main loop, counted in its SASS (what the GPU issues per slab).

    The slab loop is the innermost SASS loop that holds a barrier; if the k loop inside it stayed rolled,
    its body counts once per trip (``bk·tm·tn`` FFMAs a slab over the FFMAs one trip holds). Every path
    through the loop body counts (both sides of a branch, a division's slow path), so ``per_ffma`` is an
    upper bound on the instructions issued per FMA; 1.0 would be FMAs only. ``int64`` counts the 64-bit
    integer arithmetic (carry-propagating adds, wide multiplies, 64-bit compares) and ``calls`` the
    subroutine calls (ptxas's 64-bit division and remainder); both were the index arithmetic of the
    loads. ``shared_loads`` maps width (32, 64, 128 bits) to LDS instructions a slab.
    """

    instructions: float
    ffma: int
    per_ffma: float
    shared_loads: dict[int, float]
    global_loads: float
    int64: float
    calls: float
    rolled_k: bool  # the k loop inside a slab stayed a loop (not fully unrolled)


def nvdisasm_path() -> str | None:
    """nvdisasm from the nvidia-cuda-nvdisasm wheel (the 'test' extra), else from PATH; None if neither."""
    try:
        import nvidia

        for base in nvidia.__path__:
            for sub in ("cu13", "cuda_nvdisasm", "cu12"):
                candidate = os.path.join(base, sub, "bin", "nvdisasm")
                if os.path.exists(candidate):
                    return candidate
    except ImportError:
        pass
    from shutil import which

    return which("nvdisasm")


def ptxas_path() -> str:
    """ptxas from the nvidia-cuda-nvcc wheel (the `cuda`/`test` extras), else from PATH."""
    try:
        import nvidia.cuda_nvcc as nvcc

        base = nvcc.__path__[0]
        candidate = os.path.join(base, "bin", "ptxas")
        if os.path.exists(candidate):
            return candidate
    except ImportError:
        pass
    from shutil import which

    found = which("ptxas")
    if found is None:
        raise RuntimeError("ptxas not found: pip install nvidia-cuda-nvcc-cu12 (in the 'test' and 'cuda' extras)")
    return found


@contextmanager
def stand_in_device(cc: tuple[int, int]) -> Iterator[None]:
    """Let numba-cuda compile device functions for ``cc`` when there is no GPU to ask."""
    import numba.cuda.dispatcher as dispatcher

    original = dispatcher.get_current_device

    def current() -> Any:
        try:
            return original()
        except Exception:  # no driver, no device: answer with the architecture being built for
            return SimpleNamespace(compute_capability=cc)

    dispatcher.get_current_device = current
    try:
        yield
    finally:
        dispatcher.get_current_device = original


def _types() -> SimpleNamespace:
    from numba import types

    def array(dtype: Any, ndim: int, layout: str = "C") -> Any:
        return types.Array(dtype, ndim, layout)

    f32, i64 = types.float32, types.int64
    return SimpleNamespace(
        f32=f32,
        i64=i64,
        boolean=types.boolean,
        f1=array(f32, 1),
        f2=array(f32, 2),
        f3=array(f32, 3),
        f4=array(f32, 4),
        f2_any=array(f32, 2, "A"),
        u8_1=array(types.uint8, 1),
        u8_2=array(types.uint8, 2),
        u8_4=array(types.uint8, 4),
        i32_2=array(types.int32, 2),
        i32_4=array(types.int32, 4),
        i64_1=array(i64, 1),
    )


def _signatures() -> dict[str, tuple[Any, ...]]:
    """Kernel name -> the argument types its launcher passes (float32 arrays, int64 sizes, float32 scalars)."""
    t = _types()
    f1, f2, f3, f4, f32, i64 = t.f1, t.f2, t.f3, t.f4, t.f32, t.i64
    return {
        "sum_splits": (f2, f1),
        "direct_conv_forward": (f4, f4, f4, i64, i64, i64),
        "direct_conv_backward_data": (f4, f4, f4, i64, i64, i64),
        "direct_conv_backward_weight": (f4, f4, f4, i64, i64, i64),
        "channel_sum": (f3, f1),
        "add_channel_bias": (f3, f1),
        "relu_forward_kernel": (f1, f1),
        "relu_backward_kernel": (f1, f1, f1),
        "relu6_forward_kernel": (f1, f1),
        "relu6_backward_kernel": (f1, f1, f1),
        "leaky_relu_forward_kernel": (f1, f32, f1),
        "leaky_relu_backward_kernel": (f1, f1, f32, f1),
        "add_kernel": (f1, f1, f1),
        "copy_kernel": (f1, f1),
        "dropout_kernel": (f1, t.u8_1, f32, f1),
        "maxpool_forward_kernel": (f4, f4, t.i32_4, i64, i64, i64, t.boolean),  # local=True with a uint8 argmax
        "maxpool_backward_kernel": (f4, t.u8_4, f4, i64, i64, i64, t.boolean),  # local=True with a uint8 argmax
        "avgpool_forward_kernel": (f4, f4, i64, i64, i64),
        "avgpool_backward_kernel": (f4, f4, i64, i64, i64),
        "global_avgpool_forward_kernel": (f2, f1),
        "global_avgpool_backward_kernel": (f1, f2),
        "batchnorm_train_kernel": (f3, f1, f1, f1, f1, f3, f1, f1, f32, f32),
        "batchnorm_infer_kernel": (f3, f1, f1, f1, f1, f3, f32),
        "batchnorm_backward_from_output_kernel": (f3, f3, f1, f1, f1, f3, f1, f1),
        "batchnorm_partial_stats_kernel": (f3, f2, f2, i64),
        "batchnorm_normalize_kernel": (f3, f1, f1, f1, f1, f3, f1, f1, f2, f2, i64, f32, f32),
        "batchnorm_backward_partials_kernel": (f3, f3, f1, f1, f2, f2, i64),
        "batchnorm_backward_apply_kernel": (f3, f3, f1, f1, f1, f3, f1, f1, f2, f2, i64),
        "softmax_xent_forward_kernel": (f2, t.i64_1, f2, f1),
        "softmax_xent_backward_kernel": (f2, t.i64_1, f2),
        "sgd_kernel": (f1, f1, f1, f32, f32, f32, t.boolean),
        "adam_kernel": (f1, f1, f1, f1, f32, f32, f32, f32, f32, f32),
        "sgd_scalars_kernel": (f1, f1, f1, f1, f1, f32, f32, t.boolean),
        "adam_scalars_kernel": (f1, f1, f1, f1, f1, f1, f32, f32, f32, f32),
    }


THREADS_OVERRIDE = {"softmax_xent_forward_kernel": 32}
"""Block sizes other than 256: the loss is one block of ``reduction_threads(batch)`` threads (32 at batch 32)."""


def module_kernels() -> dict[str, tuple[str, Any]]:
    """Every @cuda.jit kernel (not device function) defined at module level in the kernels.cuda families."""
    from numba.cuda.dispatcher import CUDADispatcher

    found = {}
    for family in FAMILIES:
        module = importlib.import_module(f"kernels.cuda.{family}")
        for name, value in vars(module).items():
            if isinstance(value, CUDADispatcher) and not value.targetoptions.get("device"):
                if value.py_func.__module__ == module.__name__ and family != "gemm":
                    found[name] = (family, value)
    return found


def catalog() -> list[KernelSpec]:
    """Every kernel the report covers: the module-level kernels, then each GEMM version × operand set."""
    from numba import types

    from kernels.cuda import conv, gemm
    from kernels.cuda._launch import THREADS_PER_BLOCK

    t = _types()
    signatures = _signatures()
    specs = []
    for name, (family, kernel) in sorted(module_kernels().items()):
        if name not in signatures:
            raise KeyError(f"kernel {name} has no signature in engine/bench/cuda_static.py: add its launch types")
        specs.append(KernelSpec(name, family, kernel, signatures[name], THREADS_OVERRIDE.get(name, THREADS_PER_BLOCK)))
    geom = types.UniTuple(t.i64, gemm.GEOMETRY_LENGTH)
    gemm_args = (t.i64, t.i64, t.i64, t.i64, geom, t.boolean)
    operand_arrays = {
        "gemm": (t.f2_any, t.f2_any, t.f2_any),  # views of any strides (w.T, sliced rows)
        "conv_forward": (t.f2, t.f4, t.f3),  # w[K, C/g·R·S], x, out[N, K, P]
        "conv_backward_data": (t.f2, t.f4, t.f3),  # w, dout, dx[N, C, H·W]
        "conv_backward_weight": (t.f3, t.f4, t.f3),  # dout[N, K, P], x, partial dw[splits, K, C/g·R·S]
    }
    versions = [gemm.VERSIONS[name]() for name in ("v1", "v2", "v3")]
    versions += [gemm.tile_version(config) for config in gemm.CANDIDATES.values()]
    for version in versions:
        threads = version.threads[0] * version.threads[1]
        for operands in (gemm.MATRIX, *conv.OPERANDS):
            kernel = version.kernel(operands)
            name = kernel.py_func.__name__
            specs.append(KernelSpec(name, "gemm", kernel, operand_arrays[operands.name] + gemm_args, threads))
    return specs


def tile_config_of(kernel_name: str) -> Any:
    """The tile family's configuration a kernel was built for (None for every other kernel)."""
    from kernels.cuda import gemm

    for config in gemm.CANDIDATES.values():
        if kernel_name.endswith("_tiles_" + config.name.replace("-", "_")):
            return config
    return None


@functools.cache
def build_ptx(spec: KernelSpec, cc: tuple[int, int]) -> str:
    """PTX of one kernel for one architecture (cached per process: the PTX test and the report share it)."""
    from numba import cuda, types

    with stand_in_device(cc):
        launch_bounds = spec.kernel.targetoptions.get("launch_bounds")
        ptx, return_type = cuda.compile_ptx(spec.kernel.py_func, spec.signature, cc=cc, launch_bounds=launch_bounds)
    if return_type != types.void:
        raise TypeError(f"{spec.name}: a kernel must return nothing, compiled to {return_type}")
    return ptx


_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"Used \d+ registers[^\n]*?(\d+) bytes smem")
_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def ptxas_info(ptx: str, cc: tuple[int, int], sass: list[str] | None = None) -> dict[str, int]:
    """Run ``ptxas -v`` on one kernel's PTX; registers, smem, stack and spill bytes of its entry function.

    With a ``sass`` list (and nvdisasm at hand) the assembled code's disassembly is appended to it."""
    arch = ARCHS[cc].name
    with tempfile.TemporaryDirectory() as tmp:
        source = os.path.join(tmp, "kernel.ptx")
        cubin = os.path.join(tmp, "kernel.cubin")
        with open(source, "w") as handle:
            handle.write(ptx)
        result = subprocess.run(
            [ptxas_path(), "-v", f"--gpu-name={arch}", source, "-o", cubin],
            capture_output=True,
            text=True,
        )
        disassembler = nvdisasm_path() if sass is not None and result.returncode == 0 else None
        if disassembler is not None:
            listing = subprocess.run([disassembler, "-c", cubin], capture_output=True, text=True)
            if listing.returncode != 0:
                raise RuntimeError(f"nvdisasm failed for {arch}: {listing.stderr.strip()}")
            sass.append(listing.stdout)
    if result.returncode != 0:
        raise RuntimeError(f"ptxas failed for {arch}: {result.stderr.strip()}")
    used, spill = _USED.search(result.stderr), _SPILL.search(result.stderr)
    if used is None or spill is None:
        raise RuntimeError(f"could not read ptxas -v output: {result.stderr.strip()}")
    return {
        "registers": int(used.group(1)),
        "shared_bytes": int(smem.group(1)) if (smem := _SMEM.search(result.stderr)) else 0,
        "stack_bytes": int(spill.group(1)),
        "spill_stores": int(spill.group(2)),
        "spill_loads": int(spill.group(3)),
    }


def occupancy(registers: int, shared_bytes: int, threads: int, arch: Arch) -> tuple[int, float, str]:
    """(resident blocks per SM, warps resident / max warps, the limiting resource)."""
    warps = -(-threads // 32)
    per_warp = -(-max(registers, 1) * 32 // arch.register_unit) * arch.register_unit
    by_registers = (arch.registers // per_warp) // warps
    shared = -(-(shared_bytes + arch.shared_reserved) // arch.shared_unit) * arch.shared_unit
    limits = {
        "warps": arch.max_warps // warps,
        "registers": by_registers,
        "shared memory": arch.shared_bytes // shared,
        "blocks": arch.max_blocks,
    }
    blocks = min(limits.values())
    limited_by = min(limits, key=lambda k: (limits[k], k != "warps"))
    return blocks, blocks * warps / arch.max_warps, limited_by


_SASS_INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
_SASS_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_SASS_BRANCH = re.compile(r"`\((\.L_x_\d+)\)")
_INT64_OPS = ("IMAD.WIDE", "IMAD.X", "IADD3.X", "LEA.HI.X", "SHF.L.U64", "SHF.R.U64", "SHF.R.S64", "IADD.64")


def _sass_instructions(sass: str) -> tuple[list[tuple[int, str, str]], dict[str, int]]:
    """(address, opcode, operands) of every instruction, and each label's address."""
    instructions, labels, pending = [], {}, []
    for line in sass.splitlines():
        label = _SASS_LABEL.match(line)
        if label:
            pending.append(label.group(1))
            continue
        found = _SASS_INSN.search(line)
        if found:
            address = int(found.group(1), 16)
            labels.update((name, address) for name in pending)
            pending = []
            instructions.append((address, found.group(2), found.group(3)))
    return instructions, labels


def main_loop(sass: str, config: Any) -> MainLoop:
    """Count one k-slab of a tile-family kernel's main loop in its SASS (see ``MainLoop``)."""
    instructions, labels = _sass_instructions(sass)
    loops = []  # (first, last address) of each backward branch's loop
    for address, opcode, operands in instructions:
        target = _SASS_BRANCH.search(operands)
        if opcode.startswith("BRA") and target and labels.get(target.group(1), address + 1) <= address:
            loops.append((labels[target.group(1)], address))

    def body(loop: tuple[int, int]) -> list[tuple[int, str, str]]:
        return [i for i in instructions if loop[0] <= i[0] <= loop[1]]

    def count(items: list[tuple[int, str, str]], test: Any) -> int:
        return sum(1 for _, opcode, operands in items if test(opcode, operands))

    def is_ffma(opcode: str, operands: str) -> bool:
        return opcode == "FFMA"

    slabs = [loop for loop in loops if count(body(loop), lambda op, _: op.startswith("BAR"))
             and count(body(loop), is_ffma)]
    if not slabs:
        raise ValueError("no main loop (a loop with a barrier and FFMAs) in this SASS")
    slab = min(slabs, key=lambda loop: loop[1] - loop[0])
    inner = [loop for loop in loops if slab[0] <= loop[0] and loop[1] <= slab[1] and loop != slab
             and count(body(loop), is_ffma)]
    ffma = config.block_k * config.thread_m * config.thread_n
    weights: dict[int, float] = {}
    for address, _, _ in body(slab):
        weights[address] = 1.0
    for loop in sorted(inner, key=lambda loop: loop[1] - loop[0], reverse=True):  # outer first, inner multiplies
        items = body(loop)
        per_trip = count(items, is_ffma)
        outside = sum(weights[a] for a, op, _ in body(slab) if op == "FFMA" and not loop[0] <= a <= loop[1])
        trips = (ffma - outside) / per_trip
        for address, _, _ in items:
            weights[address] = trips
    items = body(slab)

    def weighted(test: Any) -> float:
        return float(sum(weights[a] for a, op, operands in items if test(op, operands)))

    total = weighted(lambda op, _: True)
    shared = {}
    for bits, suffix in ((32, ""), (64, ".64"), (128, ".128")):
        got = weighted(lambda op, _, suffix=suffix: op == "LDS" + suffix or op == "LDS.U" + suffix)
        if got:
            shared[bits] = got
    return MainLoop(
        instructions=total,
        ffma=ffma,
        per_ffma=total / ffma,
        shared_loads=shared,
        global_loads=weighted(lambda op, _: op.startswith(("LDG", "LD.E", "LD."))),
        int64=weighted(lambda op, operands: op.startswith(_INT64_OPS) or (".EX" in op and op.startswith("ISETP"))),
        calls=weighted(lambda op, _: op.startswith("CALL")),
        rolled_k=bool(inner),
    )


def resources(spec: KernelSpec, cc: tuple[int, int]) -> Resources:
    config = tile_config_of(spec.name)
    sass: list[str] | None = [] if config is not None else None
    info = ptxas_info(build_ptx(spec, cc), cc, sass)
    loop = main_loop(sass[0], config) if sass else None
    blocks, occ, limited_by = occupancy(info["registers"], info["shared_bytes"], spec.threads, ARCHS[cc])
    return Resources(
        spec.name,
        spec.family,
        ARCHS[cc].name,
        info["registers"],
        info["spill_stores"],
        info["spill_loads"],
        info["stack_bytes"],
        info["shared_bytes"],
        spec.threads,
        blocks,
        occ,
        limited_by,
        loop,
    )


def static_report(ccs: tuple[tuple[int, int], ...] = COMPUTE_CAPABILITIES, progress: Any = None) -> list[Resources]:
    rows = []
    for spec in catalog():
        for cc in ccs:
            rows.append(resources(spec, cc))
            if progress:
                progress(rows[-1])
    return rows


def render_static(rows: list[Resources], console: Any = None) -> None:
    """The --static table, through engine/report.py (no kernel name cut on a narrow terminal)."""
    from engine.report import Table, render_table

    columns = ["kernel", "arch", "regs", "spill st/ld B", "stack B", "smem B", "threads", "blocks/SM", "occupancy",
               "limited by", "loop SASS/FFMA", "LDS bits"]
    table = Table("CUDA kernels: ptxas -v resources and theoretical occupancy at the launchers' block size", columns,
                  right={i for i, name in enumerate(columns) if name not in ("kernel", "arch", "limited by")})
    for r in rows:
        table.add_row(r.kernel, r.arch, str(r.registers), f"{r.spill_stores}/{r.spill_loads}", str(r.stack_bytes),
                      str(r.shared_bytes), str(r.threads), str(r.blocks_per_sm), f"{100 * r.occupancy:.0f}%",
                      r.limited_by, "–" if r.loop is None else f"{r.loop.per_ffma:.2f}",
                      "–" if r.loop is None else "/".join(str(b) for b in sorted(r.loop.shared_loads)))
    spills = [f"{r.kernel} ({r.arch})" for r in rows if r.spill_stores or r.spill_loads]
    table.notes.append(f"spills: {', '.join(spills) if spills else 'none'}; production GEMM occupancy floor "
                       f"{100 * GEMM_OCCUPANCY_FLOOR:.0f}%")
    table.notes.append("loop SASS/FFMA: the tile family's main loop, SASS instructions a k-slab per FFMA it holds "
                       "(every path counted; 1.0 = FMAs only; – without nvdisasm); LDS bits: its shared-load widths")
    render_table(table, console)


if __name__ == "__main__":  # python -m engine.bench.cuda_static
    render_static(static_report(progress=lambda r: print(f"built {r.kernel} {r.arch}", file=sys.stderr)))

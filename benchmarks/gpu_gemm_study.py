"""Where the CUDA GEMM's time goes, on a real GPU: tile loop or implicit-GEMM index arithmetic?

The first GPU run (kernels/README.md, "First run on a real GPU") timed the conv GEMMs at 0.4-0.9
TFLOP/s on an H100, 1% of its fp32 peak. This script separates the two suspects:

1. plain matrix GEMMs (``kernels.cuda.gemm`` on 2-D CuPy arrays: no conv geometry) for v1, v2, v3
   and v3 tile variants, beside cuBLAS (``cupy.matmul``) on the same arrays;
2. conv forward through the production launcher (implicit GEMM: every load computes an im2col
   index) on ResNet-18 shapes, batch 32, with the same versions.

Every figure is the median of back-to-back launches timed with CUDA events (the host's launch cost
is hidden behind the queue), after a checked warm-up run against cuBLAS / the NumPy reference.
Needs a GPU and CuPy:  python benchmarks/gpu_gemm_study.py [--repeat 20]
"""

from __future__ import annotations

import argparse
import functools

import numpy as np


def _time(fn, repeat: int) -> float:
    import cupy

    fn()
    cupy.cuda.Device().synchronize()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for _ in range(3):
        start.record()
        for _ in range(repeat):
            fn()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end) / repeat)
    return float(np.median(times))


def _cell(name: str, flops: float, ms: float, error: float) -> str:
    flagged = "" if error < 1e-4 else f" (error {error:.1e})"
    return f"{name.split(' (')[0]} {flops / ms / 1e9:7.2f}{flagged}"


def main() -> None:
    import cupy

    from kernels.cuda import gemm as g
    from kernels.cuda.conv import conv2d_forward
    from kernels.reference.conv import conv2d_forward as reference_forward

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    versions = {
        "v1 naive 16x16": g.naive_version(),
        "v2 tiled 16": g.tiled_version(),
        "v3 64x64 k8 4x4": g.register_blocked_version(),
        f"v4 {g.DEFAULT_CONFIG} (the table's default)": g.tile_version(g.CANDIDATES[g.DEFAULT_CONFIG]),
        "v3 128x64 k8 8x4": g.register_blocked_version(128, 64, 8, 8, 4),
        "v3 128x128 k8 8x8": g.register_blocked_version(128, 128, 8, 8, 8),
        "v3 64x64 k16 4x4": g.register_blocked_version(64, 64, 16, 4, 4),
    }
    rng = np.random.default_rng(0)
    print(f"device: {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}")
    print("1. plain GEMM C[M,N] = A[M,K] @ B[K,N], float32, TFLOP/s (median of back-to-back launches)")
    for m, n, k in ((2048, 2048, 2048), (512, 512, 4608), (64, 32768, 576), (4096, 4096, 4096)):
        a = cupy.asarray(rng.standard_normal((m, k), dtype=np.float32))
        b = cupy.asarray(rng.standard_normal((k, n), dtype=np.float32))
        c = cupy.empty((m, n), dtype=cupy.float32)
        flops = 2.0 * m * n * k
        reference = a @ b
        row = [_cell("cuBLAS", flops, _time(functools.partial(cupy.matmul, a, b, out=c), args.repeat), 0.0)]
        for name, version in versions.items():
            c.fill(cupy.nan)
            version(a, b, c)
            error = float(cupy.abs(c - reference).max() / cupy.abs(reference).max())
            row.append(_cell(name, flops, _time(functools.partial(version, a, b, c), args.repeat), error))
        print(f"  {m}x{n}x{k}: " + " | ".join(row))
    print("2. conv forward (implicit GEMM), batch 32, TFLOP/s")
    for c_in, c_out, hw, stride in ((64, 64, 32, 1), (256, 256, 8, 1), (512, 512, 4, 1), (128, 256, 16, 2)):
        x_host = rng.standard_normal((32, c_in, hw, hw), dtype=np.float32)
        w_host = rng.standard_normal((c_out, c_in, 3, 3), dtype=np.float32)
        oh = (hw + 2 - 3) // stride + 1
        out_host = np.empty((32, c_out, oh, oh), np.float32)
        reference_forward(x_host, w_host, None, out_host, stride, 1, 1)
        x, w = cupy.asarray(x_host), cupy.asarray(w_host)
        out = cupy.empty((32, c_out, oh, oh), dtype=cupy.float32)
        flops = 2.0 * 32 * c_out * oh * oh * c_in * 9
        row = []
        for name, version in versions.items():
            g.use_gemm(version)
            out.fill(cupy.nan)
            conv2d_forward(x, w, None, out, stride, 1, 1)
            error = float(np.abs(cupy.asnumpy(out) - out_host).max() / np.abs(out_host).max())
            ms = _time(functools.partial(conv2d_forward, x, w, None, out, stride, 1, 1), args.repeat)
            row.append(_cell(name, flops, ms, error))
        g.use_gemm(None)  # back to the table
        print(f"  {c_in}->{c_out} @{hw}x{hw} s{stride}: " + " | ".join(row))


if __name__ == "__main__":
    main()

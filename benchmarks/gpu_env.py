"""The GPU session's first step: device, driver and versions into env.json, and one smoke kernel.

    python benchmarks/gpu_env.py OUT/env.json [--dry]
"""

from __future__ import annotations

import json
import subprocess
import sys


def main(argv: list[str]) -> int:
    path, dry = argv[0], "--dry" in argv[1:]
    import numba
    import numpy

    versions = {"numba": numba.__version__, "numpy": numpy.__version__}
    try:
        import numba_cuda

        versions["numba-cuda"] = numba_cuda.__version__
    except ImportError:
        pass
    device = "CUDA simulator (dry run)"
    if not dry:
        import cupy
        from numba import cuda

        versions["cupy"] = cupy.__version__
        versions["cuda runtime"] = str(cupy.cuda.runtime.runtimeGetVersion())
        versions["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                            capture_output=True, text=True).stdout.strip()
        device = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()

        @cuda.jit
        def add1(a):
            i = cuda.grid(1)
            if i < a.size:
                a[i] += 1

        a = numpy.arange(8, dtype=numpy.float32)
        add1[1, 32](a)
        if a.tolist() != list(range(1, 9)):
            print(f"smoke kernel wrote {a.tolist()}", file=sys.stderr)
            return 1
    with open(path, "w", encoding="utf-8") as handle:
        json.dump({"device": device, "versions": versions}, handle, indent=1)
    print(device, versions)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

#!/usr/bin/env bash
# The standing order's GPU session in one call (DEVELOPERS: "a GPU when one is lent"): every step the
# order names, each with its own time limit and log, so one failure does not hide the rest.
#   1. the machine and the versions that matter (driver, numba, numba-cuda, CuPy);
#   2. the cudasim test set on the real GPU (ENGINE_TEST_GPU=1, tests/conftest.py);
#   3. benchmarks/gpu_acceptance.sh (every kernel of real steps against NumPy, timings, training);
#   4. engine kernels --backend cuda (every kernel on ResNet-18/MobileNetV2 shapes, batch 32);
#   5. a short engine train --backend cuda without and with --offload-n.
# Logs go to $OUT (the device tool's folder) or ./gpu_session_out; the last lines of each are printed.
# Usage, from the repository root:  bash benchmarks/gpu_session.sh [steps...]   (default: all)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_session_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
[ -d /usr/local/cuda ] && export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}

step() {  # step NAME LIMIT_S COMMAND...
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    echo "=== $name: $*"
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "=== $name: rc=$rc in $((SECONDS - t0)) s"
    tail -n "${TAIL:-12}" "$OUT/$name.log"
}

steps=${*:-"env tests accept kernels train"}
for s in $steps; do
    case $s in
    env)
        nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
        python - <<'EOF'
import numba, numba_cuda, numpy
from numba import cuda
print("python numba", numba.__version__, "numba-cuda", numba_cuda.__version__, "numpy", numpy.__version__)
try:
    import cupy
    print("cupy", cupy.__version__)
except Exception as exc:
    print("cupy: not importable:", exc)
print("device:", cuda.get_current_device().name, "cc", cuda.get_current_device().compute_capability)
@cuda.jit
def add1(a):
    i = cuda.grid(1)
    if i < a.size:
        a[i] += 1
a = numpy.arange(8, dtype=numpy.float32)
add1[1, 32](a)
print("smoke kernel:", a.tolist())
EOF
        ;;
    tests) ENGINE_TEST_GPU=1 step tests 300 python -m pytest -q -m cudasim --maxfail=30 ;;
    accept) step accept 330 bash benchmarks/gpu_acceptance.sh --output "$OUT/gpu_acceptance.json" ;;
    kernels) step kernels 240 python -m cli kernels --backend cuda --batch-size 32 --output "$OUT/kernels_cuda.json" ;;
    train)
        step train 120 python -m cli train --model resnet18 --backend cuda --steps 30 --no-progress
        step train_offload 120 python -m cli train --model resnet18 --backend cuda --steps 30 --offload-n 4 --no-progress
        ;;
    *) echo "unknown step $s (env tests accept kernels train)"; exit 2 ;;
    esac
done

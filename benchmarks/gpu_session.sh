#!/usr/bin/env bash
# A lent GPU's whole session in one call of at most 8 minutes (issue 34). Each step has a time limit
# and a log, and is skipped when the session's 470 s are nearly spent, so one failure or overrun does
# not hide the rest:
#   env      the device, driver and versions (env.json) and a smoke kernel;
#   search   benchmarks/gpu_tile_search.py: every conv GEMM of ResNet-18 / MobileNetV2 (batch 32) on
#            every tile-family candidate and a few split counts, beside cuBLAS; writes gemm_table.json
#            (commit it as kernels/cuda/gemm_table.json) and tile_search.json. The steps after it run
#            with that table (ENGINE_GEMM_TABLE);
#   accept   engine/bench/gpu_acceptance.py, part 1: every kernel of real steps against NumPy;
#   bench    benchmarks/gpu_step_bench.py, in one process (the kernels compile once): eager vs one
#            captured CUDA graph per step (images/s, host µs per step, same weights), ResNet-18 and
#            MobileNetV2, batch 32; engine train ResNet-18 with and without --offload-n 4 (images/s,
#            same loss); ResNet-18 at 224×224 (ImageNet variant) with and without offload;
#   profile  benchmarks/gpu_kernel_profile.py: every distinct launch of a ResNet-18 step (CIFAR b32, 224 b8)
#            timed inside a CUDA graph (no host in the figure), summed by kernel: where the step's GPU time goes;
#   report   benchmarks/gpu_report.py: gpu-<date>.json (commit as benchmarks/results/) and .md.
# Logs and files go to $OUT (the device tool's folder) or ./gpu_session_out.
# Usage, from the repository root:  bash benchmarks/gpu_session.sh [--dry] [steps...]
# --dry: the Python parts under the CUDA simulator at tiny sizes (no GPU; what the test runs).
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=""
if [ "${1:-}" = "--dry" ]; then DRY="--dry"; shift; fi
OUT=${OUT:-$PWD/gpu_session_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
[ -d /usr/local/cuda ] && export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
[ -n "$DRY" ] && export NUMBA_ENABLE_CUDASIM=1
# The lent machines' `python` may not be the Python that holds their packages (2026-11-27, an H200: it was
# not; python3 was /opt/torch/.venv/bin/python3). A symbolic link loses the venv, so a wrapper execs python3.
if ! python -c "import numba" >/dev/null 2>&1 && python3 -c "import numba" >/dev/null 2>&1; then
    PYBIN=$(mktemp -d)
    printf '#!/bin/sh\nexec "%s" "$@"\n' "$(command -v python3)" >"$PYBIN/python"
    chmod +x "$PYBIN/python"
    export PATH="$PYBIN:$PATH"
fi
# The lent machine's NumPy may be newer than numba-cuda 0.30.x can import (2026-11-28, an H200: NumPy 2.5.2,
# where np.row_stack is gone, so every kernel failed to compile; pyproject.toml pins NumPy < 2.5 for this). Those
# machines reach no package index, so a NumPy 2.4 wheel travels with the tree in .gpu_wheels/ (ignored; carry it):
#   pip download numpy==2.4.6 --python-version 3.12 --only-binary=:all: --platform manylinux_2_28_x86_64 \
#       --no-deps -d .gpu_wheels
if [ -z "$DRY" ] && ! python -c "import numba.cuda.cudaimpl" >/dev/null 2>&1; then
    wheel=$(ls .gpu_wheels/numpy-*.whl 2>/dev/null | head -n 1)
    if [ -n "$wheel" ]; then
        have=$(python -c 'import numpy; print(numpy.__version__)' 2>&1 | tail -n 1)
        NPDIR=$(mktemp -d)
        python -m pip install --quiet --no-deps --target "$NPDIR" "$wheel" && export PYTHONPATH=$NPDIR:$PYTHONPATH
        echo "numba.cuda does not import with NumPy $have here; using $wheel"
    fi
    python -c "import numba.cuda.cudaimpl" || echo "numba.cuda still does not import; the steps below will fail"
fi
BUDGET=${GPU_SESSION_BUDGET_S:-470}
START=$SECONDS
STEPS_JSON="$OUT/steps.json"
echo "{}" >"$STEPS_JSON"

step() {  # step NAME LIMIT_S COMMAND...: runs unless the budget is spent; records rc and seconds
    local name=$1 limit=$2
    shift 2
    local left=$((BUDGET - (SECONDS - START)))
    if [ "$left" -lt 20 ]; then
        echo "=== $name: skipped, ${left} s of the session left"
        python - "$STEPS_JSON" "$name" skipped 0 <<'PY'
import json, sys
path, name, rc, seconds = sys.argv[1:]
data = json.load(open(path)); data[name] = {"rc": rc, "seconds": int(seconds)}; json.dump(data, open(path, "w"))
PY
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    local t0=$SECONDS
    echo "=== $name (limit ${limit} s): $*"
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "=== $name: rc=$rc in $((SECONDS - t0)) s"
    tail -n "${TAIL:-8}" "$OUT/$name.log"
    python - "$STEPS_JSON" "$name" "$rc" "$((SECONDS - t0))" <<'PY'
import json, sys
path, name, rc, seconds = sys.argv[1:]
data = json.load(open(path)); data[name] = {"rc": int(rc), "seconds": int(seconds)}; json.dump(data, open(path, "w"))
PY
}

steps=${*:-"env search accept bench profile report"}
for s in $steps; do
    case $s in
    env) step env 60 python benchmarks/gpu_env.py "$OUT/env.json" $DRY ;;
    search)
        if [ -n "$DRY" ]; then
            step search 200 python benchmarks/gpu_tile_search.py --dry --max-shapes 1 \
                --output "$OUT/gemm_table.json" --results "$OUT/tile_search.json"
        else
            step search 150 python benchmarks/gpu_tile_search.py --repeat 5 --budget-s 100 \
                --output "$OUT/gemm_table.json" --results "$OUT/tile_search.json"
            # the rest of the session runs with the fresh table, if the search finished and wrote one
            if python -c "import json,sys; t=json.load(open(sys.argv[1])); sys.exit(0 if t['entries'] else 1)" \
                "$OUT/gemm_table.json" 2>/dev/null; then
                export ENGINE_GEMM_TABLE="$OUT/gemm_table.json"
            fi
        fi
        ;;
    accept)
        if [ -n "$DRY" ]; then echo "=== accept: covered by tests/engine/test_gpu_acceptance_cudasim.py in a dry run"
        else step accept 100 python -m engine.bench.gpu_acceptance --no-timings --no-train \
            --output "$OUT/gpu_acceptance.json"; fi
        ;;
    bench)
        if [ -n "$DRY" ]; then step bench 150 python benchmarks/gpu_step_bench.py --dry --parts graph \
            --output "$OUT/step_bench.json"
        else step bench 200 python benchmarks/gpu_step_bench.py --parts graph offload imagenet \
            --output "$OUT/step_bench.json"; fi
        ;;
    profile)
        if [ -n "$DRY" ]; then step profile 100 python benchmarks/gpu_kernel_profile.py --dry \
            --output "$OUT/kernel_profile.json"
        else step profile 90 python benchmarks/gpu_kernel_profile.py --output "$OUT/kernel_profile.json"; fi
        ;;
    report) python benchmarks/gpu_report.py "$OUT" ;;
    *) echo "unknown step $s (env search accept bench profile report)"; exit 2 ;;
    esac
done
echo "session: $((SECONDS - START)) s"

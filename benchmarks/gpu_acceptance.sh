#!/usr/bin/env bash
# The first thing to run on a GPU machine (issue 16). After
#     pip install -e '.[cuda]'
# run from the repository root:
#     bash benchmarks/gpu_acceptance.sh            # report on screen, JSON in gpu_acceptance.json
# It checks every CUDA kernel against the NumPy reference on a real ResNet-18 / MobileNetV2 training
# step (batch 32), times every launch of a step against the roofline (engine kernels --backend cuda
# --roofline), measures the host time per launch, trains with and without --offload-n, and ends
# with PASS or FAIL (exit status 1). Options: --repeat N, --output FILE; --backend cudasim --tiny
# runs the same code in the CUDA simulator (what CI does, tests/engine/test_gpu_acceptance_cudasim.py).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m engine.bench.gpu_acceptance "$@"

#!/usr/bin/env bash
# Everything GPU in one device call: the CUDA test suite, kernel micro-benchmarks, and `qwen-mtp bench`.
# Usage on the device box, from the repo root:  bash benchmarks/gpu_suite.sh [bench recipe] [--set ...]
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 QWEN_MTP_CACHE=/tmp/qwen-mtp-cache
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)'
STAGE="${STAGE:-all}"
if [[ "$STAGE" == all || "$STAGE" == tests ]]; then
  python3 -m pytest -q -x tests/test_triton_ops.py tests/gpu 2>&1 | tee "$OUT/gpu-tests.log" | tail -25
fi
if [[ "$STAGE" == all || "$STAGE" == kernels ]]; then
  python3 benchmarks/kernels.py 2>&1 | tee "$OUT/kernels.log"
fi
if [[ "$STAGE" == all || "$STAGE" == bench ]]; then
  recipe="${1:-recipes/bench-27b.yaml}"; shift || true
  python3 -m qwen_mtp.cli bench "$recipe" --set "bench.out_dir=$OUT/bench" "$@" 2>&1 | tee "$OUT/bench.log"
fi

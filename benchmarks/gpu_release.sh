#!/usr/bin/env bash
# The release check in one device call (~9 min on an H200), each part under its own time limit so that every
# part reports: the decode-path exactness suite (MTP-on == MTP-off at batch 1/8/32 with graphs, long contexts,
# the stress runs, one host sync per step), the feature GPU tests (sampling, FP8, prefix caching), then
# `qwen-mtp bench` at 27B: the batch sweep (B1/8/32/64, plain, K=2 and K=3 at oracle 0.8), the context sweep
# (8k and 32k, B1), and FP8 at B1. Reports under $OUT (bench.json/png per part).
# Usage (device box, repo root; carry [".whl"] with torchao from ../shared/tools/device-wheels.sh):
#   bash benchmarks/gpu_release.sh
set -uo pipefail
source benchmarks/device_env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
bench() {  # name, limit, settings...
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 -m qwen_mtp.cli bench recipes/bench-27b.yaml --set "bench.out_dir=$OUT/$name" \
    --set bench.head=false --set bench.output_len=48 --set 'bench.accept_rates=[0.8]' "$@" 2>&1 \
    | grep -E "^ctx|^[0-9]+ +\|" | sed "s/^/$name /"
  rm -f "$OUT/$name/bench.txt"
}
echo "== exactness (decode path)"
timeout "${EXACT_S:-220}" python3 -m pytest -q -rA -k "not compiled" tests/gpu/test_cuda_exactness.py tests/gpu/test_host_syncs.py \
  tests/ops/test_linear.py >"$OUT/exactness.log" 2>&1; echo "exit $?"; grep -E "passed|failed|FAILED|Error" "$OUT/exactness.log" | tail -8
echo "== batch sweep"
bench batch 130 --set 'bench.batch_sizes=[1,8,32,64]' --set 'bench.ks=[2,3]' --set cache.max_batch=64
echo "== context sweep"
bench context 70 --set 'bench.prompt_len=[8192,32768]' --set 'bench.ks=[3]' --set cache.prefill_chunk=2048
rm -f "$OUT/context/bench.png"
echo "== features"
timeout "${FEATURES_S:-60}" python3 -m pytest -q -rA tests/gpu/test_sampling_cuda.py tests/gpu/test_fp8.py \
  tests/gpu/test_prefix_cache_cuda.py >"$OUT/features.log" 2>&1; echo "exit $?"
grep -E "passed|failed|FAILED|Error" "$OUT/features.log" | tail -12
echo "== fp8"
bench fp8 55 --set model.synthetic=qwen3.5-27b-fp8 --set 'bench.ks=[3]'
rm -f "$OUT/fp8/bench.png"

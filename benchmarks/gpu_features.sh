#!/usr/bin/env bash
# The feature GPU tests in one device call, each file under its own time limit so that every file reports:
# sampling (kernels at the real vocabulary, sampled MTP-on == MTP-off under graphs), FP8 (kernels, logits, MTP
# exactness), MoE (both families' real per-layer shapes), prefix caching and the one-sync-per-step check. Logs
# under $OUT.
# Usage (device box, repo root; carry [".whl"]):  bash benchmarks/gpu_features.sh
set -uo pipefail
source benchmarks/device_env.sh
# -vv below: pyproject's addopts -q cancels one -v, and the per-test lines must survive a timeout
for part in ${FEATURES:-sampling_cuda:150 fp8:170 moe_exactness:150 prefix_cache_cuda:120 host_syncs:90}; do
  name=${part%%:*} limit=${part##*:}
  echo "== $name"
  timeout "$limit" python3 -m pytest -vv "tests/gpu/test_$name.py" ${PYTEST_K:+-k "$PYTEST_K"} >"$OUT/$name.log" 2>&1
  echo "exit $?"; grep -E "::.* (PASSED|FAILED|ERROR)|^E  .{0,200}" "$OUT/$name.log" | grep -v "^E  *$" | head -24
done

#!/usr/bin/env bash
# The feature GPU tests in one device call, each file under its own time limit so that every file reports:
# sampling (kernels at the real vocabulary, sampled MTP-on == MTP-off under graphs), FP8 (kernels, logits, MTP
# exactness), MoE (both families' real per-layer shapes), prefix caching and the one-sync-per-step check. Then,
# when asked (FP8_FAMILY=1), the FP8 decode-GEMM plan sweep. Logs under $OUT.
# Usage (device box, repo root; carry [".whl"]):  bash benchmarks/gpu_features.sh
set -uo pipefail
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$PWD/.site" .whl/*.whl
fi
export PYTHONPATH="$PWD/.site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 QWEN_MTP_CACHE=/tmp/qwen-mtp-cache
export TORCHAO_FORCE_SKIP_LOADING_SO_FILES=1
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
for part in ${FEATURES:-sampling_cuda:150 fp8:170 moe_exactness:150 prefix_cache_cuda:120 host_syncs:90}; do
  name=${part%%:*} limit=${part##*:}
  echo "== $name"
  timeout "$limit" python3 -m pytest -v "tests/gpu/test_$name.py" ${PYTEST_K:+-k "$PYTEST_K"} >"$OUT/$name.log" 2>&1
  echo "exit $?"; grep -E "::.* (PASSED|FAILED|ERROR)|^E  .{0,200}" "$OUT/$name.log" | grep -v "^E  *$" | head -24
done

# Sourced by the device-call scripts (gpu_release.sh, gpu_features.sh): install the carried wheels (.whl/, see
# ../shared/tools/device-wheels.sh) into .site, and the environment every part of a call runs in.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$PWD/.site" .whl/*.whl
fi
export PYTHONPATH="$PWD/.site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 QWEN_MTP_CACHE=/tmp/qwen-mtp-cache
export TORCHAO_FORCE_SKIP_LOADING_SO_FILES=1
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"

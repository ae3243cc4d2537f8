#!/usr/bin/env bash
# The self-distillation story (docs/training.md), about 3 minutes on an H200:
#   1. acceptance of BASE (greedy, K=2 and 3, the shipped held-out prompts);
#   2. fine-tune the target only (train.mode: target; the MTP head is left as it was) on the standard library's
#      test/ files, and measure acceptance again: the head now reads hidden states it was not trained on;
#   3. `qwen-mtp train --mtp-only` on the same files (the frozen target's own greedy tokens as labels), measure.
# Writes OUTDIR/distill-story.json (the three measurements and each phase's summary) and the phases' curves.
#
#   benchmarks/train_distill.sh BASE_CHECKPOINT OUTDIR
set -euo pipefail
base=${1:?usage: benchmarks/train_distill.sh BASE_CHECKPOINT OUTDIR}
out=${2:?usage: benchmarks/train_distill.sh BASE_CHECKPOINT OUTDIR}
cd "$(dirname "$0")/.."
mkdir -p "$out"
work=.train-work/distill
mkdir -p "$work"
export PYTHONUNBUFFERED=1
device=$("${PYTHON:-python3}" -c "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')")
dtype=$([ "$device" = cuda ] && echo bfloat16 || echo float32)  # the engine's GPU path runs bf16
measure() {  # checkpoint, name
  "${PYTHON:-python3}" -m qwen_mtp.cli acceptance "$1" --ks 2,3 --max-new-tokens 48 --device "$device" --dtype "$dtype" \
    --out "$work/acceptance-$2.json"
}
phase() {  # name, init checkpoint, extra args...
  local name=$1 init=$2
  shift 2
  "${PYTHON:-python3}" -m qwen_mtp.cli train recipes/train-small.yaml --set "train.output_dir=$work/$name" \
    --set "train.init=$init" --set "train.include=['test/**/*.py']" --set train.batch_size=32 \
    --set train.steps=400 --set train.time_budget_s=50 --set train.warmup_steps=20 --set train.eval_every=0 \
    --set train.save_every=1000 "$@"
}
measure "$base" base
phase finetuned "$base" --set train.mode=target --set train.lr=0.001
measure "$work/finetuned/model" finetuned
phase distilled "$work/finetuned/model" --mtp-only --set train.lr=0.002
measure "$work/distilled/model" distilled
"${PYTHON:-python3}" - "$work" "$out/distill-story.json" <<'PY'
import json, sys
from pathlib import Path
work, target = Path(sys.argv[1]), Path(sys.argv[2])
story = {name: json.loads((work / f"acceptance-{name}.json").read_text()) for name in ("base", "finetuned", "distilled")}
for name in ("finetuned", "distilled"):
    summary = json.loads((work / name / "train-summary.json").read_text())
    summary.pop("history")
    story[f"{name}_training"] = summary
target.write_text(json.dumps(story, indent=2) + "\n")
for name in ("base", "finetuned", "distilled"):
    print(name, {k: v["acceptance_length"] for k, v in story[name]["k"].items()})
PY
cp "$work/finetuned/loss.png" "$out/loss-finetuned.png"
cp "$work/distilled/loss.png" "$out/loss-distilled.png"

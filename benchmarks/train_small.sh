#!/usr/bin/env bash
# Train the shipped small model on one GPU (about 7 minutes on an H200) and put what ships into OUTDIR:
# the checkpoint (config.json, generation_config.json, model.safetensors, tokenizer.json, tokenizer_config.json),
# train-summary.json (losses, held-out perplexity, speed, the whole loss log) and loss.png: 7 files.
#
#   benchmarks/train_small.sh OUTDIR [--set train.key=value ...]
#
# The run's working state (tokenizer, token cache, resume point every 250 steps) stays in .train-work/small
# (git-ignored): started again on the same machine, the run resumes where it stopped. Throughput is printed
# after the first 12 steps ("throughput: ... tokens/s"); the step count is then fixed so that the run ends
# within train.time_budget_s (420 s) and recorded in train-summary.json ("steps").
set -euo pipefail
out=${1:?usage: benchmarks/train_small.sh OUTDIR [--set train.key=value ...]}
shift
cd "$(dirname "$0")/.."
mkdir -p "$out" .train-work
work=.train-work/small
export PYTHONUNBUFFERED=1
"${PYTHON:-python3}" -m qwen_mtp.cli train recipes/train-small.yaml --set "train.output_dir=$work" "$@" 2>&1 | tee "$work.log"
cp "$work"/model/{config.json,generation_config.json,model.safetensors,tokenizer.json,tokenizer_config.json} "$out"/
cp "$work/train-summary.json" "$work/loss.png" "$out"/
ls -la "$out"

#!/usr/bin/env bash
# Everything GPU in one device call: the CUDA test suite, kernel micro-benchmarks (GEMM vs cuBLAS, the GEMM
# plan sweep, a step profile), and `qwen-mtp bench`.
# STAGE=tests|kernels|sweep|family|fp8family|longprefill|profile|bench|compile|verify|prefill|attention|context|
# verifybench|ttft|probe|buckets|smallkernels|stepbench|longcontext|lookahead|pdl|ladefault|prefillgemm|tmaloads|prefetch|w8a8|prefillgraphs|issue20|
# prefillbuckets|mixeddefault|fp8prefill|newdefaults|splits|splitcosts|normcosts|penalties|structured|structuredsteps|conv|drafthead|targets|kauto|ksweep|serve|tp2|tp2serve|tp2bench runs one part (all but tests, kernels, profile and bench only when asked: minutes each). These are
# one device call each:
#   verify       the exactness subset after decode-path changes;
#   prefill      the checks after prefill-path changes (kernel tests, packed steps, long-context MTP-on == MTP-off,
#                the packed TTFT);
#   attention    the checks after decode / verify attention changes (kernel tests and times, a K=3 exactness
#                subset, B8 at 32k);
#   context      the context sweep 128..128k, with B8 at 32k;
#   verifybench  the 27B rows of the sixth session's open claims;
#   ttft         where TTFT goes at 32 x 128 packed and at one 32k prompt;
#   probe        the GEMM's row-tile variants (gemm_buckets.py, BUCKET_SET), graphed step splits at B1 / B32,
#                decode attention plans;
#   buckets      tune and apply the GEMM row buckets (27B, 0.8B; W8A8_BUCKETS=1: the W8A8 kernel's at 27B too),
#                their GPU tests, the 27B batch bench (BENCH_SETS: extra --set arguments, e.g. an FP8 preset);
#   smallkernels the step's kernels other than GEMMs: norm, rope and split-KV op tests, the quantization and conv
#                launch choices (small_kernels.py), decode attention plans (CONTEXTS), the graphed B1 / B32 step split;
#   stepbench    after a change to every step (e.g. a norm): the exactness subset, then the 27B bf16 bench, K=3 at
#                oracle 0.8, B1 and B32 at 128 tokens and B1 at 8k and 32k;
#   longcontext  the 128k bench row, MTP-on == MTP-off for prompts of 1..32k at K=1..4, then B8 at 32k;
#   pdl          programmatic dependent launch: its tests, the exactness subset with it, the 27B bf16 bench B1 and
#                B32 (K=3 at oracle 0.8) without it (QWEN_MTP_PDL=0) and with it; FP8=1 adds the 27B FP8 B1 pair
#                (carry torchao); with LOOKAHEAD=1 also the host-sync tests and the bench with cache.lookahead;
#   prefillgemm  the invariant GEMM at prefill rows (gemm_prefill.py: the "grid" and "tma" plans against cuBLAS at
#                M = 512..8192, bits checked), its winners written into PREFILL_TUNED on the device copy (APPLY=0:
#                not; PRESET=qwen3.5-9b: that preset's shapes), the GEMM and packed-step GPU tests with them, then
#                mixed_steps.py's TTFT / ITL;
#   ladefault    the GPU suite with cache.lookahead on (the default on branch wp11-la-default), in two calls:
#                PART=1 the bf16 exactness tests, the stress runs, sampling and the host-sync counts; PART=2 MoE,
#                prefix caching, mixed steps, the FP8 draft lm_head and FP8 exactness (carry torchao), then the
#                27B bf16 bench B1 / B8 / B32; PART=features the tests of both parts that no call ran with the
#                lookahead before (sampling, host syncs, MoE, prefix caching, mixed steps, draft lm_head, FP8);
#   tmaloads     `GemmPlan.tma_loads` on the decode GEMMs: gemm_tma_loads.py (bf16 and W8A8 at 27B, M = 1..256,
#                pointer against TMA loads, bits compared; SWEEP=0: not; APPLY=1: into TMA_LOAD_BUCKETS), the 27B
#                bf16 bench (BF16_BATCHES, K=3 at oracle 0.8) without TMA loads and with the table's, FP8=1 (carry
#                torchao) the same at FP8 (FP8_BATCHES), then the exactness subset with every plan loading by TMA;
#   prefetch     `GemmPlan.l2_prefetch` (QWEN_MTP_L2_PREFETCH=N: every decode GEMM asks L2 for its first N weight
#                K blocks before its PDL wait; default 2, 0: none) and tree A/Bs: the 27B bench (BATCHES) per model
#                in MODELS (bf16, fp8: carry torchao) and per SETTINGS (N; "baseline": the qwen_mtp in BASELINE,
#                carried; "tree:DIR"; those two with their own default prefetch; "env:NAME=VALUE,..."), then
#                (EXACT=1) the W8A8 and bf16 exactness tests with PREFETCH_EXACT blocks;
#   w8a8         kernel benchmarks (MICRO: gemm_w8a8, gdn_recurrent) with this tree and a carried BASELINE tree;
#                FAMILY=1 adds the W8A8 plan family sweep;
#   prefillgraphs compile.prefill_graphs: its GPU test, then mixed_steps.py's bursts and ITL without and with it,
#                and the 27B B32 bench with cache.mixed_steps off and on (B32=0 leaves it out);
#   issue20      issue #20's H200 figures in one call: the packed stress test, mixed_steps.py at 27B bf16 and FP8,
#                the B32 bench with mixed steps off and on (carry torchao);
#   prefillbuckets the prefill GEMM's row buckets: mixed_steps.py, the sweep applied, mixed_steps.py again;
#   mixeddefault the GPU suites that run default engines (exactness, prefix caching, sampling), for a default's change;
#   newdefaults  the long-context rows with prefills packed by default, then the GPU tests not yet run so (prefill
#                graphs, host syncs, the draft lm_head, the op tests);
#   splits       the N = 5120 decode shapes (o_proj, mlp down) as the engine launches them at more K splits (SPLITS,
#                default 3,4,5,6,8,12; benchmarks/gemm_buckets.py --set splits), bf16 and W8A8, rows checked across M;
#   normcosts    the quantizing 5120-wide norm at M = 1, 8, 32, one program a row against 5..40 (the engine's: 5;
#                benchmarks/norm_costs.py, bytes compared with the one-program kernel's);
#   fp8prefill   packed prefill rows of FP8 weights (W8A8 "tma" plans): their GPU tests, the plan sweep applied,
#                mixed_steps.py at 27B FP8 (carry torchao);
#   lookahead    cache.lookahead: the host-sync tests, the exactness subset, B1 / B8 / B32 plain and K=3 with and
#                without it;
#   penalties    logit bias and repetition / presence / frequency penalties: the op tests, sampled and penalized
#                MTP-on == MTP-off under graphs, the kernel's time beside the sampler's, the 27B B1 / B32 bench with
#                every row penalized against unpenalized;
#   tp2          issue #23 on two GPUs (nvidia-h200-x2), part 1: benchmarks/tensor_parallel.py tokens at 27B (MODEL:
#                a synthetic preset, default qwen3.5-27b; qwen3.5-27b-fp8 for FP8, carry torchao): MTP K=1..4 ==
#                MTP off for 32 mixed prompts at B = 1, 8, 32 under graphs, TP=2 tokens against TP=1 (where they
#                part, by how much TP=1 led), then tests/gpu/test_tp2.py but its server test (TESTS=0: not);
#   kauto        `mtp.k: auto` with chained steps against a fixed K=3 (27B bf16, B1 / B8 / B32), the exactness subset
#                and the chained k auto test first; AUTO_ONLY=1: k auto unchained (cache.lookahead=false), the A/B's other half;
#   ksweep       #16's batch sweep (27B at oracle 0.8: plain, K=1..4 and k auto, max_k 4) for BATCHES (default 1,2,4;
#                then 8,16 and 32,64 in two more calls), MODEL=fp8 (default; carry .whl for torchao) or bf16;
#   serve        `qwen-mtp serve` on one GPU (MTP on answers as off, SIGTERM), the MoE exactness suite (the MoE block's
#                tensor-parallel seam at TP=1) and the host-sync counts;
#   tp2serve     `qwen-mtp serve` at TP=2 on two GPUs (the shipped model, graphs): MTP on answers as MTP off;
#   tp2bench     issue #23, part 2: the collectives' latency at the rows a step sends, `qwen-mtp bench` at TP=1 and
#                TP=2 (B1, B8; plain, K=2, K=3 at oracle 0.8), and the table of both (tensor_parallel.py summary);
#   conv         the conv update's kernels (tile, columns): op tests, launch choices, the decode attention's launch
#                choices (warps, prefetch) at B1 / B32, the 27B bench A/B, exactness;
#   drafthead    the FP8 draft lm_head (mtp.draft_lm_head: fp8): the W8A8 plan family at the lm_head's shape, the 27B
#                FP8 B1 K=3 bench with the bf16 and FP8 draft lm_heads (carry torchao);
#   targets      the open issues' figures in one call: the bf16 exactness subset, #13's 27B bf16 rows (B1 / B8 / B32,
#                K=2 and K=3), #14's and #16's 27B FP8 B1 rows (both draft lm_heads, whole and 32k vocabularies),
#                the bf16 and W8A8 GEMM launches against cuBLAS at M = 1..256 (#13's and #14's tables);
#   structuredsteps what a constrained step costs at 27B (benchmarks/structured_steps.py; carry .whl, llguidance);
#   structured   structured outputs (carry .whl; install .whl/llguidance*.whl beside torchao): the token mask at the
#                real vocabulary, constrained MTP-on == MTP-off under graphs, the lookahead left alone, then the CPU
#                suite's structured tests on this machine.
# Usage on the device box, from the repo root:  bash benchmarks/gpu_suite.sh [bench recipe] [--set ...]
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 QWEN_MTP_CACHE=/tmp/qwen-mtp-cache
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)'
STAGE="${STAGE:-all}"
# The prefill, attention and context stages' helpers. counted LIMIT LOG CMD...: CMD's output into $OUT/LOG, then
# its rc, how many tests passed and any FAILED / ERROR line (pytest -q -rA: the verdicts at the end; -vv: a line per
# test as it ends, so a run its LIMIT cuts still shows what passed). bench_27b LIMIT NAME SETS...: `qwen-mtp bench`
# at 27B bf16, K=3 at oracle 0.8, 64 new tokens, into $OUT/NAME; its table printed (a device call brings back at most
# 8 files: the JSON is kept, the log only when the run failed, the plot only with KEEP_PLOTS=1).
counted() { local limit=$1 log=$2; shift 2; timeout "$limit" "$@" >"$OUT/$log" 2>&1
            echo "[rc $? at ${SECONDS}s] $log: $(grep -cE "^PASSED| PASSED( |$)" "$OUT/$log") passed"
            grep -E "^(FAILED|ERROR)| (FAILED|ERROR)( |$)" "$OUT/$log"; }
bench_27b() { local limit=$1 name=$2 rc; shift 2
              timeout "$limit" python3 -m qwen_mtp.cli bench recipes/bench-27b.yaml --set 'bench.accept_rates=[0.8]' \
                --set bench.head=false --set bench.output_len=64 --set 'bench.ks=[3]' "$@" \
                --set "bench.out_dir=$OUT/$name" >"$OUT/$name.log" 2>&1; rc=$?; echo "[rc $rc at ${SECONDS}s] $name"
              cat "$OUT/$name/bench.txt" 2>/dev/null || tail -5 "$OUT/$name.log"
              rm -f "$OUT/$name/bench.txt"; [[ $rc == 0 ]] && rm -f "$OUT/$name.log"
              [[ "${KEEP_PLOTS:-0}" == 1 ]] || rm -f "$OUT/$name/bench.png"; }
# itl_27b NAME GEMM_ROWS [SETS...]: benchmarks/mixed_steps.py at 27B (the bursts' TTFT, the ITL of 16 running
# requests while a 2048-token prompt arrives every 0.5 s; packing off and on) into $OUT/mixed-steps-NAME.json, its
# TTFT and ITL lines printed; GEMM_ROWS '' skips its bf16 GEMM timings. b32_mixed: the 27B B32 bench (plain, K=3)
# with cache.mixed_steps off and on (issue #20's decode throughput in steady state).
itl_27b() { local name=$1 rows=$2; shift 2
            timeout 150 python3 benchmarks/mixed_steps.py recipes/bench-27b.yaml --set cache.max_step_tokens=16384 \
              "$@" --gemm-rows "$rows" --itl-tokens 384 --arrivals 4 --new-tokens 8 --solo 2 \
              --out "$OUT/mixed-steps-$name.json" >"$OUT/mixed-steps-$name.log" 2>&1
            echo "[rc $? at ${SECONDS}s] mixed_steps $name"; grep -E "^(TTFT|ITL)" "$OUT/mixed-steps-$name.log"; }
# sweep_apply LIMIT SCRIPT NAME PATTERN: benchmarks/SCRIPT --apply (a plan sweep writing its tables into this copy's
# ops/linear.py) into $OUT/NAME.json and .log, its rc and the log's lines matching PATTERN printed, linear.py back in $OUT.
sweep_apply() { timeout "$1" python3 "benchmarks/$2" --out "$OUT/$3.json" --apply >"$OUT/$3.log" 2>&1
                echo "[rc $? at ${SECONDS}s] $2 --apply"; grep -E "$4" "$OUT/$3.log"
                cp qwen_mtp/ops/linear.py "$OUT/linear.py"; }
b32_mixed() { for mixed in false true; do
                bench_27b 100 "bench-b32-mixed-$mixed" --set 'bench.batch_sizes=[32]' --set cache.mixed_steps=$mixed
              done; }
# graphed_profile [NAME [ARGS...]]: the 27B step's GPU time by kernel kind under CUDA graphs, B1 and B32, plain and
# K=3, into $OUT/NAME.json (default profile-graphed); ARGS go to profile_step.py (e.g. --set model.synthetic=...).
graphed_profile() { local name=${1:-profile-graphed}; shift || true
                    timeout 200 python3 benchmarks/profile_step.py recipes/bench-27b.yaml --graphed 1 32 --k 3 "$@" \
                      --out "$OUT/$name.json" 2>&1 | grep -v Warn | tail -80; echo "[at ${SECONDS}s] $name"; }
if [[ "$STAGE" == all || "$STAGE" == tests ]]; then
  # -rA: the summary line (pyproject's -q plus this -q would hide it)
  python3 -m pytest -q -rA tests/ops tests/gpu -k "not compiled" 2>&1 | tee "$OUT/gpu-tests.log" | grep -E "PASSED|FAILED|passed|failed" | tail -80
fi
if [[ "$STAGE" == compile ]]; then  # torch.compile (inductor) + graphs on the 8-layer fixture
  # With py-spy on the PATH (carry its wheel), stacks every DUMP_EVERY s (not pytest's faulthandler_timeout:
  # its dump segfaulted inside dynamo's frame shim on Python 3.12). Not TORCH_LOGS=inductor: its INFO line for
  # each custom-op fallback prints the op's IR arguments, which nest every earlier write to the same pool, so
  # the text grows exponentially with the layers (the compile never finishes).
  TORCHINDUCTOR_COMPILE_THREADS="${TORCHINDUCTOR_COMPILE_THREADS:-1}" \
    timeout -s INT -k 20 "${COMPILE_TIMEOUT:-300}" python3 -m pytest -q -rA tests/gpu -k compiled >"$OUT/compile.log" 2>&1 &
  runner=$!
  if command -v py-spy >/dev/null; then
    for i in 1 2 3 4 5 6 7 8; do
      sleep "${DUMP_EVERY:-45}"; kill -0 "$runner" 2>/dev/null || break
      pid=$(pgrep -f "python3 -m pytest.*tests/gpu -k compiled" | tail -1)
      [[ -n "$pid" ]] && py-spy dump --native --subprocesses --pid "$pid" >"$OUT/compile-stack-$i.txt" 2>&1
    done
  fi
  wait "$runner"; grep -E "PASSED|FAILED|passed|failed|Error" "$OUT/compile.log" | tail -20
fi
if [[ "$STAGE" == all || "$STAGE" == kernels ]]; then
  python3 benchmarks/gemm_vs_cublas.py 2>&1 | tee "$OUT/kernels.log"
  python3 benchmarks/prefill.py 2>&1 | tee "$OUT/prefill.log"
fi
if [[ "$STAGE" == sweep ]]; then  # slow (minutes): only when asked
  python3 benchmarks/gemm_sweep.py qwen3.5-27b "${SWEEP_FILTER:-}" 2>/dev/null | tee "$OUT/gemm-sweep.log"
fi
if [[ "$STAGE" == family ]]; then  # the GEMM family sweep per preset (1-2 min each), then its plans into TUNED
  for preset in ${FAMILY_PRESETS:-qwen3.5-27b qwen3.5-9b qwen3.5-0.8b}; do
    python3 benchmarks/gemm_sweep.py "$preset" --family --out "$OUT/gemm-family-${preset#qwen3.5-}.json" \
      >"$OUT/gemm-family-${preset#qwen3.5-}.log" 2>&1
    sed -n '/^Best invariant plan/,$p' "$OUT/gemm-family-${preset#qwen3.5-}.log" | grep -v "^    (" | head -40
  done
  [[ -n "${APPLY_PLANS:-}" ]] && python3 benchmarks/apply_plans.py "$OUT"/gemm-family-*.json
fi
if [[ "$STAGE" == fp8family ]]; then  # the W8A16 plan family at a preset's FP8 shapes (~2-3 min), then into TUNED_FP8
  preset="${FP8_PRESET:-qwen3.5-27b}"; report="$OUT/gemm-fp8-family-${preset#qwen3.5-}"
  python3 benchmarks/gemm_fp8.py "$preset" "${FP8_FILTER:-}" --family --out "$report.json" >"$report.log" 2>&1 \
    || tail -20 "$report.log"
  sed -n '/^Best W8A16 plan/,$p' "$report.log"
  if [[ -n "${APPLY_PLANS:-}" ]]; then  # the tuned table, for the rest of this call and back in $OUT
    python3 benchmarks/apply_plans.py --fp8 "$report.json" && cp qwen_mtp/ops/linear.py "$OUT/linear.py"
  fi
fi
if [[ "$STAGE" == longprefill ]]; then  # TTFT of a long prompt per prefill chunk size, with a GPU time split
  python3 benchmarks/long_prefill.py "${1:-recipes/bench-27b.yaml}" --length "${LENGTH:-32768}" \
    --out "$OUT/long-prefill.json" 2>&1 | tee "$OUT/long-prefill.log"
fi
if [[ "$STAGE" == verify ]]; then  # one device call (~7 min): the GPU exactness subset after decode-path changes
  run() { local limit=$1 log=$2; shift 2; timeout "$limit" "$@" >"$OUT/$log" 2>&1; echo "[rc $? at ${SECONDS}s] $log"
          grep -E "^(PASSED|FAILED|ERROR)|passed|failed" "$OUT/$log" | tail -12; }
  run 190 verify-exact.log python3 -m pytest -q -rA tests/gpu/test_cuda_exactness.py -k "(mtp_equals_plain_bf16 and graphs) or stress"
  run 90 verify-long.log python3 -m pytest -q -rA "tests/gpu/test_cuda_exactness.py::test_mtp_equals_plain_long_context_graphs[3]" \
    tests/gpu/test_cuda_exactness.py::test_prefill_kernels_as_accurate_as_hf
  run 120 verify-fp8.log python3 -m pytest -q -rA tests/gpu/test_fp8.py -k "mtp_equals_plain and w8a8"
  run 60 verify-draft-head.log python3 -m pytest -q -rA tests/gpu/test_draft_lm_head_cuda.py
  run 60 verify-packed.log python3 -m pytest -q -rA tests/gpu/test_mixed_steps_cuda.py -k "varlen or depend_on_packing"
  run 45 verify-conv.log python3 -m pytest -q -rA tests/ops/test_conv.py
fi
if [[ "$STAGE" == prefill ]]; then  # one device call (~8 min): the GPU checks after prefill-path changes
  counted 150 prefill-ops.log python3 -m pytest -q -rA tests/ops/test_prefill_attention.py tests/ops/test_conv.py \
    tests/ops/test_backend.py tests/ops/test_linear.py::test_prefill_plan_rows_never_depend_on_m
  counted 240 prefill-packed.log python3 -m pytest -q -rA tests/gpu/test_mixed_steps_cuda.py \
    tests/gpu/test_cuda_exactness.py::test_prefill_kernels_as_accurate_as_hf
  counted 150 prefill-long.log python3 -m pytest -q -rA "tests/gpu/test_cuda_exactness.py::test_mtp_equals_plain_long_context_graphs[1]" \
    "tests/gpu/test_cuda_exactness.py::test_mtp_equals_plain_long_context_graphs[4]"
  timeout 130 python3 benchmarks/mixed_steps.py recipes/bench-27b.yaml --k 2 --set cache.max_step_tokens=16384 \
    --gemm-rows 4096 --itl-tokens 384 --arrivals 4 --out "$OUT/mixed-steps.json" \
    >"$OUT/mixed-steps.log" 2>&1
  grep -E "^(TTFT|ITL|gemm M)|^ +M=" "$OUT/mixed-steps.log"
fi
if [[ "$STAGE" == attention ]]; then  # one device call (~6 min): after decode / verify attention kernel changes
  counted 90 attention-ops.log python3 -m pytest -q -rA tests/ops/test_split_kv_attention.py tests/ops/test_paged_attention.py
  timeout 90 python3 benchmarks/decode_attention.py --engine-plan-only --contexts 8192 32768 131072 \
    --out "$OUT/decode-attention.json" 2>&1 | sed -n '/^ B /,$p'
  counted 220 attention-exact.log python3 -m pytest -q -rA "tests/gpu/test_cuda_exactness.py::test_mtp_equals_plain_bf16_batch_1_8_32[3-graphs-batches6]" \
    "tests/gpu/test_cuda_exactness.py::test_mtp_equals_plain_long_context_graphs[3]" \
    "tests/gpu/test_cuda_exactness.py::test_stress_changing_batch_mix[2-graphs]"
  bench_27b 120 bench-32k-b8 --set 'bench.prompt_len=[32768]' --set 'bench.batch_sizes=[8]'
fi
if [[ "$STAGE" == context ]]; then  # one device call (~8 min): issue #24's context sweep, 27B bf16, K=3 at oracle 0.8
  bench_27b 220 bench-context --set 'bench.prompt_len=[128,2048,8192,32768]' --set mtp.draft_vocab_file=first \
    --set 'bench.draft_vocabs=[0,32768]'
  bench_27b 130 bench-32k-b8 --set 'bench.prompt_len=[32768]' --set 'bench.batch_sizes=[8]'
  bench_27b 150 bench-128k --set 'bench.prompt_len=[131072]'
  rm -f "$OUT"/bench-32k-b8/bench.png "$OUT"/bench-128k/bench.png  # one point each
  counted 90 context-exact.log python3 -m pytest -q -rA \
    "tests/gpu/test_cuda_exactness.py::test_mtp_equals_plain_long_context_graphs[2]"
fi
if [[ "$STAGE" == ttft ]]; then  # one device call (~3 min): TTFT of the packed bursts (with a profile), and at 32k
  timeout 120 python3 benchmarks/mixed_steps.py recipes/bench-27b.yaml --k 2 --set cache.max_step_tokens=16384 \
    --gemm-rows 4096 --itl-tokens 384 --arrivals 4 --profile --out "$OUT/mixed-steps.json" >"$OUT/mixed-steps.log" 2>&1
  grep -E "^(TTFT|ITL|packed 32x128 profile)|^ +[0-9.]+ ms" "$OUT/mixed-steps.log"
  timeout 80 python3 benchmarks/long_prefill.py recipes/bench-27b.yaml --length 32768 --chunks 8192 \
    --out "$OUT/long-prefill.json" 2>&1 | grep -v Warn | tee "$OUT/long-prefill.log" | tail -16
fi
if [[ "$STAGE" == verifybench ]]; then  # one device call (~5 min): the 27B rows behind the sixth session's open claims
  common=(--set 'bench.accept_rates=[0.8]' --set bench.head=false)
  fp8=(--set model.synthetic=qwen3.5-27b-fp8 "${common[@]}" --set bench.output_len=48)
  timeout 90 python3 -m qwen_mtp.cli bench recipes/bench-27b.yaml "${fp8[@]}" --set mtp.draft_vocab_file=first \
    --set 'bench.ks=[3]' --set 'bench.draft_vocabs=[0,32768]' --set 'bench.draft_lm_heads=[bf16,fp8]' \
    --set "bench.out_dir=$OUT/bench-draft-head" >"$OUT/bench-draft-head.log" 2>&1; cat "$OUT/bench-draft-head/bench.txt"
  timeout 80 python3 -m qwen_mtp.cli bench recipes/bench-27b.yaml "${fp8[@]}" --set 'bench.batch_sizes=[64]' \
    --set 'bench.ks=[auto]' --set "bench.out_dir=$OUT/bench-b64-auto" >"$OUT/bench-b64-auto.log" 2>&1
  cat "$OUT/bench-b64-auto/bench.txt"
  timeout 120 python3 -m qwen_mtp.cli bench recipes/bench-27b.yaml "${common[@]}" --set 'bench.prompt_len=[8192,32768]' \
    --set 'bench.ks=[3]' --set bench.output_len=32 --set "bench.out_dir=$OUT/bench-long" >"$OUT/bench-long.log" 2>&1
  cat "$OUT/bench-long/bench.txt"
fi
if [[ "$STAGE" == probe ]]; then  # one device call (~8 min): row-tile buckets of the GEMM, graphed step splits
  timeout 330 python3 benchmarks/gemm_buckets.py qwen3.5-27b --set "${BUCKET_SET:-tiles}" --out "$OUT/gemm-buckets.json" \
    >"$OUT/gemm-buckets.log" 2>&1
  echo "[rc $? at ${SECONDS}s] gemm_buckets"; grep -v "^ *$" "$OUT/gemm-buckets.log" | cut -c1-170
  [[ -n "${BUCKETS_ONLY:-}" ]] && exit 0
  graphed_profile
  timeout 100 python3 benchmarks/decode_attention.py --contexts 8192 32768 --out "$OUT/decode-attention.json" 2>&1 \
    | sed -n '/^ B /,$p' | head -40
fi
if [[ "$STAGE" == buckets ]]; then  # one device call (~8 min): tune and apply the GEMM row buckets, then the batch bench
  for preset in ${BUCKET_PRESETS-qwen3.5-27b qwen3.5-0.8b}; do  # BUCKET_PRESETS="": none (W8A8 alone)
    log="$OUT/gemm-buckets-${preset#qwen3.5-}"
    timeout 200 python3 benchmarks/gemm_buckets.py "$preset" --set buckets --apply --out "$log.json" >"$log.log" 2>&1
    echo "[rc $? at ${SECONDS}s] gemm_buckets $preset"; sed -n '/^Row buckets chosen/,$p' "$log.log" | cut -c1-200
  done
  if [[ -n "${W8A8_BUCKETS:-}" ]]; then  # the W8A8 kernel's buckets at the 27B FP8 shapes too
    timeout 200 python3 benchmarks/gemm_buckets.py qwen3.5-27b --kind w8a8 --set buckets --apply \
      --out "$OUT/gemm-buckets-w8a8-27b.json" >"$OUT/gemm-buckets-w8a8-27b.log" 2>&1
    echo "[rc $? at ${SECONDS}s] gemm_buckets w8a8"; sed -n '/^Row buckets chosen/,$p' "$OUT/gemm-buckets-w8a8-27b.log" | cut -c1-200
  fi
  cp qwen_mtp/ops/linear.py "$OUT/linear.py"  # the applied tables, back for the commit
  counted 120 bucket-test.log python3 -m pytest -q -rA tests/ops/test_linear.py -k "bucket or sums or row_plan"
  if [[ -n "${W8A8_BUCKETS:-}" ]]; then  # carry .whl (torchao: the FP8 models quantize on load)
    counted 200 bucket-fp8-test.log python3 -m pytest -q -rA tests/ops/test_linear_w8a8.py \
      tests/gpu/test_fp8.py -k "bucket or (mtp_equals_plain and w8a8)"
  fi
  timeout 420 python3 -m qwen_mtp.cli bench recipes/bench-27b.yaml --set 'bench.accept_rates=[0.8]' --set bench.head=false \
    --set bench.output_len=64 --set 'bench.ks=[2,3]' --set "bench.batch_sizes=[${BATCHES:-1,8,32,64}]" \
    --set "bench.out_dir=$OUT/bench-batch" ${BENCH_SETS:-} >"$OUT/bench-batch.log" 2>&1
  echo "[rc $? at ${SECONDS}s] bench"; cat "$OUT/bench-batch/bench.txt" 2>/dev/null || tail -20 "$OUT/bench-batch.log"
fi
if [[ "$STAGE" == smallkernels ]]; then  # one device call (~6 min)
  counted 150 small-ops.log python3 -m pytest -q -rA tests/ops/test_norm.py tests/ops/test_rope.py \
    tests/ops/test_split_kv_attention.py tests/ops/test_backend.py
  timeout 150 python3 benchmarks/small_kernels.py --out "$OUT/small-kernels.json" 2>&1 | grep -vi warn
  echo "[at ${SECONDS}s] small kernels (W8A8 activation quantization, conv update)"
  timeout 200 python3 benchmarks/decode_attention.py --contexts ${CONTEXTS:-128 8192 32768 131072} \
    --out "$OUT/decode-attention.json" 2>&1 | sed -n '/^ B /,$p' | head -60; echo "[at ${SECONDS}s] decode attention"
  graphed_profile
fi
if [[ "$STAGE" == stepbench ]]; then  # one device call (~9 min)
  counted 60 step-ops.log python3 -m pytest -q -rA tests/ops/test_norm.py tests/ops/test_rope.py
  counted 200 step-exact.log python3 -m pytest -q -rA tests/gpu/test_cuda_exactness.py \
    -k "(mtp_equals_plain_bf16 and graphs) or stress"
  bench_27b 150 bench-b1-b32 --set 'bench.batch_sizes=[1,32]'
  bench_27b 200 bench-context --set 'bench.prompt_len=[8192,32768]'
fi
if [[ "$STAGE" == longcontext ]]; then  # one device call (~10 min)
  bench_27b 170 bench-128k --set 'bench.prompt_len=[131072]'
  counted 330 long-exact.log python3 -m pytest -q -rA tests/gpu/test_cuda_exactness.py -k long_context_graphs
  bench_27b 100 bench-32k-b8 --set 'bench.prompt_len=[32768]' --set 'bench.batch_sizes=[8]'
  rm -f "$OUT"/bench-32k-b8/bench.png "$OUT"/bench-128k/bench.png  # one point each
fi
if [[ "$STAGE" == lookahead ]]; then  # one device call (~8 min)
  counted 200 lookahead-syncs.log python3 -m pytest -q -rA tests/gpu/test_host_syncs.py
  counted 300 lookahead-exact.log python3 -m pytest -q -rA tests/gpu/test_cuda_exactness.py \
    -k "(mtp_equals_plain_bf16 and graphs) or stress or lookahead"
  for on in false true; do
    timeout 170 python3 -m qwen_mtp.cli bench recipes/bench-27b.yaml --set 'bench.accept_rates=[0.8]' \
      --set bench.head=false --set bench.output_len=64 --set 'bench.ks=[3]' --set 'bench.batch_sizes=[1,8,32]' \
      --set cache.lookahead=$on --set "bench.out_dir=$OUT/bench-lookahead-$on" >"$OUT/bench-lookahead-$on.log" 2>&1
    echo "[rc $? at ${SECONDS}s] lookahead $on"; cat "$OUT/bench-lookahead-$on/bench.txt" 2>/dev/null
  done
fi
if [[ "$STAGE" == ladefault ]]; then  # two device calls (~9 min each)
  if [[ "${PART:-1}" == 1 ]]; then
    counted 330 la-exact.log python3 -m pytest -q -rA tests/gpu/test_cuda_exactness.py -k "graphs or stress"
    counted 150 la-sampling.log python3 -m pytest -q -rA tests/gpu/test_sampling_cuda.py tests/gpu/test_host_syncs.py
  elif [[ "${PART:-1}" == features ]]; then  # what PART=1 and 2 run that no earlier call ran with the lookahead
    counted 150 la-sampling.log python3 -m pytest -q -rA tests/gpu/test_sampling_cuda.py tests/gpu/test_host_syncs.py
    counted 300 la-features.log python3 -m pytest -q -rA tests/gpu/test_moe_exactness.py \
      tests/gpu/test_prefix_cache_cuda.py tests/gpu/test_mixed_steps_cuda.py tests/gpu/test_draft_lm_head_cuda.py
    counted 120 la-fp8.log python3 -m pytest -q -rA tests/gpu/test_fp8.py -k "mtp_equals_plain"
  else
    counted 300 la-features.log python3 -m pytest -q -rA tests/gpu/test_moe_exactness.py \
      tests/gpu/test_prefix_cache_cuda.py tests/gpu/test_mixed_steps_cuda.py tests/gpu/test_draft_lm_head_cuda.py
    counted 120 la-fp8.log python3 -m pytest -q -rA tests/gpu/test_fp8.py -k "mtp_equals_plain"
    bench_27b 150 bench-la-default --set 'bench.batch_sizes=[1,8,32]'
  fi
fi
if [[ "$STAGE" == pdl ]]; then  # one device call (~9 min)
  counted 120 pdl-ops.log python3 -m pytest -q -rA tests/ops/test_pdl.py tests/ops/test_swiglu.py
  timeout 60 python3 benchmarks/pdl_launch.py --out "$OUT/pdl-launch.json"; echo "[at ${SECONDS}s] pdl_launch"
  exact="(mtp_equals_plain_bf16 and graphs) or stress or programmatic"
  if [[ "${LOOKAHEAD:-0}" == 1 ]]; then
    exact="$exact or lookahead"
    counted 150 pdl-syncs.log python3 -m pytest -q -rA tests/gpu/test_host_syncs.py
  fi
  counted 300 pdl-exact.log python3 -m pytest -q -rA tests/gpu/test_cuda_exactness.py -k "$exact"
  QWEN_MTP_PDL=0 bench_27b 150 bench-no-pdl --set 'bench.batch_sizes=[1,32]'
  bench_27b 150 bench-pdl --set 'bench.batch_sizes=[1,32]'
  if [[ "${LOOKAHEAD:-0}" == 1 ]]; then
    bench_27b 150 bench-pdl-lookahead --set 'bench.batch_sizes=[1,32]' --set cache.lookahead=true
  fi
  if [[ "${FP8:-0}" == 1 ]]; then
    QWEN_MTP_PDL=0 bench_27b 150 bench-fp8-no-pdl --set model.synthetic=qwen3.5-27b-fp8 --set 'bench.batch_sizes=[1]'
    bench_27b 150 bench-fp8-pdl --set model.synthetic=qwen3.5-27b-fp8 --set 'bench.batch_sizes=[1]'
  fi
fi
if [[ "$STAGE" == prefillgemm ]]; then  # one device call (~9 min)
  apply=(); [[ "${APPLY:-1}" == 1 ]] && apply=(--apply)
  timeout 300 python3 benchmarks/gemm_prefill.py --preset "${PRESET:-qwen3.5-27b}" --out "$OUT/gemm-prefill.json" \
    "${apply[@]}" 2>&1 | grep -v Warn
  echo "[at ${SECONDS}s] gemm_prefill"; sed -n '/^PREFILL_TUNED/,/^}/p' qwen_mtp/ops/linear.py
  counted 120 prefillgemm-ops.log python3 -m pytest -q -rA tests/ops/test_linear.py -k "prefill or tma"
  counted 90 prefillgemm-packed.log python3 -m pytest -q -rA tests/gpu/test_mixed_steps_cuda.py -k "varlen or depend_on_packing"
  timeout 140 python3 benchmarks/mixed_steps.py recipes/bench-27b.yaml --k 2 --set cache.max_step_tokens=16384 \
    --gemm-rows 4096 --itl-tokens 384 --arrivals 4 --out "$OUT/mixed-steps.json" >"$OUT/mixed-steps.log" 2>&1
  echo "[rc $? at ${SECONDS}s] mixed_steps"; grep -E "^(TTFT|ITL|gemm M)" "$OUT/mixed-steps.log"
fi
if [[ "$STAGE" == prefillgraphs ]]; then  # one device call (~9 min): compile.prefill_graphs, tested and measured
  # the GPU test (graphed full chunks == eager chunks, plain and K=2), then the mixed-steps benchmark (TTFT of the
  # bursts, ITL of running requests while long prompts arrive) without and with prefill graphs, in the same call
  counted 150 prefillgraphs-test.log python3 -m pytest -vv -p no:cacheprovider tests/gpu/test_prefill_graphs_cuda.py
  for graphs in false true; do
    itl_27b "prefill-graphs-$graphs" 512 --set compile.prefill_graphs=$graphs
  done
  # a decode-only step runs the same code with mixed steps on and off; B32=0: not in this call
  [[ "${B32:-1}" == 1 ]] && b32_mixed
fi
if [[ "$STAGE" == issue20 ]]; then  # one device call (~8 min; carry torchao): issue #20's H200 figures together
  # the packed stress run (200 prompts, 1..2048 tokens, staggered: packed == alone, MTP-on == MTP-off) and packing
  # invariance; the bursts' TTFT and the ITL under arrivals, packing off and on, 27B bf16 then FP8; B32 decode
  # throughput with mixed steps off and on (STRESS=0: without the packed stress run, ~3 min)
  [[ "${STRESS:-1}" == 1 ]] && counted 220 mixed-steps-test.log python3 -m pytest -vv -p no:cacheprovider tests/gpu/test_mixed_steps_cuda.py
  itl_27b qwen3.5-27b 512
  itl_27b qwen3.5-27b-fp8 "" --set model.synthetic=qwen3.5-27b-fp8  # the GEMM timings are bf16's: none
  b32_mixed
fi
if [[ "$STAGE" == mixeddefault ]]; then  # one device call (~8 min): the GPU suites that run default engines, for a
  # change of an engine default (run for mixed steps on by default on CUDA, twentieth session)
  counted 380 exactness.log python3 -m pytest -vv -p no:cacheprovider tests/gpu/test_cuda_exactness.py \
    -k "(mtp_equals_plain_bf16 and graphs) or stress"
  counted 100 prefix.log python3 -m pytest -vv -p no:cacheprovider tests/gpu/test_prefix_cache_cuda.py
  counted $((570 - SECONDS)) sampling.log python3 -m pytest -vv -p no:cacheprovider tests/gpu/test_sampling_cuda.py
fi
if [[ "$STAGE" == newdefaults ]]; then  # one device call (~9 min): the long-context rows (prefills packed by default
  # since the twentieth session, with the bench's bounded warm-up), then the GPU tests no call had run with mixed
  # steps on by default: prefill graphs, host syncs, the draft lm_head, and the op tests
  bench_27b 200 bench-128k --set 'bench.prompt_len=[131072]'
  bench_27b 150 bench-32k-b8 --set 'bench.prompt_len=[32768]' --set 'bench.batch_sizes=[8]'
  rm -f "$OUT"/bench-32k-b8/bench.png "$OUT"/bench-128k/bench.png  # one point each
  counted 120 features.log python3 -m pytest -vv -p no:cacheprovider tests/gpu/test_prefill_graphs_cuda.py \
    tests/gpu/test_host_syncs.py tests/gpu/test_draft_lm_head_cuda.py
  counted $((580 - SECONDS)) ops.log python3 -m pytest -vv -p no:cacheprovider tests/ops
fi
if [[ "$STAGE" == splits ]]; then  # one device call (~2 min; carry torchao): the N = 5120 shapes (o_proj / out_proj,
  # mlp down) cut into more K splits, the engine's launch (its plan and row buckets, all cut at the same points) at
  # M = 1..256 against cuBLAS, a row's bits checked across M; bf16 and W8A8. The family sweep of every plan at every
  # split count ran out of 150 s a shape (twenty-third session): this times only the plans the engine runs.
  for kind in ${KINDS:-bf16 w8a8}; do
    for shape in ${SHAPES:-o_proj down}; do
      timeout 150 python3 benchmarks/gemm_buckets.py qwen3.5-27b "$shape" --set splits --kind $kind \
        --splits "${SPLITS:-3,4,5,6,8,12}" --out "$OUT/gemm-splits-$kind-$shape.json" >"$OUT/gemm-splits-$kind-$shape.log" 2>&1
      rc=$?; echo "[rc $rc at ${SECONDS}s] $kind $shape"
      grep -v "^ *$" "$OUT/gemm-splits-$kind-$shape.log" | grep -v Warn | tail -9
      [[ $rc == 0 ]] && rm -f "$OUT/gemm-splits-$kind-$shape.log"  # printed above; a call brings back few files
    done
  done
fi
if [[ "$STAGE" == normcosts ]]; then  # one device call (~1 min): the quantizing norm, one program a row against
  # 5..40 programs a row (norm_costs.py: bytes compared with the one-program kernel's)
  timeout 200 python3 benchmarks/norm_costs.py --out "$OUT/norm-costs.json" 2>&1 | grep -v Warn
fi
if [[ "$STAGE" == splitcosts ]]; then  # one device call (~2 min; carry .whl): where the N = 5120 shapes' gap to cuBLAS
  # at 64-128 rows goes (the same launch with the engine's split reduction, none, one shared by the splits, ...:
  # gemm_split_costs.py), a stream-K partition of them at one row (gemm_stream_k.py), and what a one-row launch
  # costs to start (launch_floor.py: an empty kernel, o_proj's plan over K, the read floor; PDL on and off), and
  # the one-row W8A8 launch taken apart (w8a8_costs.py, the tile-major weight copy included)
  timeout 300 python3 benchmarks/gemm_split_costs.py --out "$OUT/gemm-split-costs.json" 2>&1 | grep -v Warn
  timeout 200 python3 benchmarks/gemm_stream_k.py --out "$OUT/gemm-stream-k.json" 2>&1 | grep -v Warn
  for pdl in 1 0; do
    QWEN_MTP_PDL=$pdl timeout 120 python3 benchmarks/launch_floor.py --out "$OUT/launch-floor-pdl$pdl.json" 2>&1 | grep -v Warn
  done
  # the one-row W8A8 launch rebuilt and taken apart, against the read floor of its bytes (w8a8_costs.py)
  timeout 170 python3 benchmarks/w8a8_costs.py --out "$OUT/w8a8-costs.json" 2>&1 | grep -v Warn
fi
if [[ "$STAGE" == penalties ]]; then  # one device call (~8 min): penalties and logit bias on the GPU
  counted 120 penalty-ops.log python3 -m pytest -vv -p no:cacheprovider tests/ops/test_penalties.py \
    tests/ops/test_backend.py tests/ops/test_pdl.py
  counted 200 sampling.log python3 -m pytest -vv -p no:cacheprovider tests/gpu/test_sampling_cuda.py
  timeout 60 python3 benchmarks/sampler.py --rows 1 4 32 128 >"$OUT/sampler-penalties.log" 2>&1
  echo "[rc $? at ${SECONDS}s] sampler"; grep "R=" "$OUT/sampler-penalties.log"
  bench_27b 80 bench-unpenalized --set 'bench.batch_sizes=[1,32]'
  bench_27b 80 bench-penalized --set 'bench.batch_sizes=[1,32]' --set bench.repetition_penalty=1.1 \
    --set bench.frequency_penalty=0.3
fi
if [[ "$STAGE" == structured ]]; then  # one device call (~5 min; carry .whl, llguidance installed): structured outputs
  counted 300 structured.log python3 -m pytest -vv -p no:cacheprovider tests/gpu/test_structured_cuda.py
  counted 200 structured-cpu-suite.log python3 -m pytest -vv -p no:cacheprovider tests/test_structured.py
fi
if [[ "$STAGE" == structuredsteps ]]; then  # one device call (~5 min; carry .whl, llguidance installed): what a
  # constrained step costs at 27B (benchmarks/structured_steps.py: free, one line of text, JSON records; plain and K=3
  # at oracle 0.8, B = 1, 8, 32; MTP-on == MTP-off per row; the masks' host time per step)
  timeout 500 python3 benchmarks/structured_steps.py recipes/bench-27b.yaml --batch ${BATCHES:-1 8 32} \
    --out "$OUT/structured-steps-27b.json" >"$OUT/structured-steps.log" 2>&1
  echo "[rc $? at ${SECONDS}s] structured_steps"; grep -vE "^\s*$|Warn" "$OUT/structured-steps.log" | tail -14
fi
if [[ "$STAGE" == conv ]]; then  # one device call (~9 min): the conv update's kernels: the op tests, each launch
  # choice timed (small_kernels.py), the fastest "columns" choice at B32 T1 against the default in the 27B bf16 bench
  # (B1, B32; QWEN_MTP_CONV_UPDATE switches it in this tree), then the bf16 exactness subset with that choice
  counted 150 conv-ops.log python3 -m pytest -vv -p no:cacheprovider tests/ops/test_conv.py
  timeout 150 python3 benchmarks/small_kernels.py --out "$OUT/small-kernels.json" 2>&1 | grep -vi warn | grep conv
  echo "[at ${SECONDS}s] small_kernels"
  timeout 120 python3 benchmarks/decode_attention.py --same-sums-only --contexts 160 2048 --batches 1 32 \
    --out "$OUT/decode-attention-launch.json" >"$OUT/decode-attention-launch.log" 2>&1
  echo "[rc $? at ${SECONDS}s] decode_attention (launch choices)"; grep -E "^check|^ ?[0-9]+ +[0-9]+ +[0-9]+ \||bitwise" "$OUT/decode-attention-launch.log"
  pick=$(python3 - "$OUT/small-kernels.json" <<'PY'
import json, sys
case = next(c for c in json.load(open(sys.argv[1]))["conv"] if c["b"] == 32 and c["t"] == 1)
ok = {label: us for label, us in case["us"].items() if label.startswith("columns") and label not in case["differs"]}
_, block, warps = min(ok, key=ok.get).split()
print(f"{block[1:]},{warps[1:]},columns")
PY
)
  echo "columns choice at B32 T1: ${pick:=1024,8,columns}"
  bench_27b 110 bench-conv-default --set 'bench.batch_sizes=[1,32]'
  QWEN_MTP_CONV_UPDATE=$pick bench_27b 110 bench-conv-columns --set 'bench.batch_sizes=[1,32]'
  QWEN_MTP_CONV_UPDATE=$pick counted 300 exactness-conv.log python3 -m pytest -vv -p no:cacheprovider \
    tests/gpu/test_cuda_exactness.py -k "(mtp_equals_plain_bf16 and graphs) or stress"
fi
if [[ "$STAGE" == drafthead ]]; then  # one device call (~8 min; carry torchao): the FP8 draft lm_head (issues #14,
  # #16): the W8A8 plan family at the lm_head's shape (its best plan for TUNED_W8A8), then the 27B FP8 B1 K=3 bench
  # with the bf16 and the FP8 draft lm_head, over the whole vocabulary and 32k ids (VOCABS); FAMILY=0: the bench only
  if [[ "${FAMILY:-1}" == 1 ]]; then
    timeout "${FAMILY_LIMIT:-180}" python3 benchmarks/gemm_w8a8.py qwen3.5-27b --family --draft-lm-head --choice-m "${CHOICE_M:-1,8}" \
    --out "$OUT/gemm-w8a8-draft-lm-head.json" >"$OUT/gemm-w8a8-draft-lm-head.log" 2>&1
    echo "[rc $? at ${SECONDS}s] W8A8 family, draft lm_head"; grep -vE "^\s*$|Warn" "$OUT/gemm-w8a8-draft-lm-head.log" | tail -42
    # the family's best plan into this copy's TUNED_W8A8 (the bench below runs it; linear.py comes back in $OUT)
    python3 - "$OUT/gemm-w8a8-draft-lm-head.json" <<'PY'
import json, re, sys
from pathlib import Path
sys.path.insert(0, "benchmarks")
from apply_plans import plan_text
from qwen_mtp.ops.linear import GemmPlan
entry = next(iter(json.load(open(sys.argv[1]))["shapes"].values()))
if entry["best"] is not None:
    plan = plan_text(GemmPlan(**entry["plans"][entry["best"]]["plan"]))
    line = f"    ({entry['n']}, {entry['k']}): {plan},  # the FP8 draft lm_head: {entry['best']}\n"
    path = Path("qwen_mtp/ops/linear.py")
    text = re.sub(r"(^TUNED_W8A8: dict\[tuple\[int, int\], GemmPlan\] = \{\n)", lambda m: m.group(1) + line, path.read_text(), flags=re.M)
    path.write_text(text)
    print("applied:", line.strip())
PY
    cp qwen_mtp/ops/linear.py "$OUT/linear.py"
  fi
  bench_27b "${BENCH_LIMIT:-330}" bench-fp8-draft-head --set model.synthetic=qwen3.5-27b-fp8 --set 'bench.batch_sizes=[1]' \
    --set 'bench.draft_lm_heads=[bf16,fp8]' --set mtp.draft_vocab_file=first --set "bench.draft_vocabs=${VOCABS:-[0,32768]}"
fi
if [[ "$STAGE" == targets ]]; then  # one device call (~4 min, ~8 with the GEMM tables' first compiles; carry .whl):
  # the open issues' H200 figures in one call: the bf16 exactness subset, then #13's 27B bf16 rows (B1, B8, B32; K=2
  # and K=3 at oracle 0.8), #14's and #16's 27B FP8 B1 rows (plain, K=3 with the bf16 and the FP8 draft lm_head, over
  # the whole vocabulary and 32k ids), then the bf16 and W8A8 GEMM launches against cuBLAS (gemm_buckets.py --set
  # dispatch)
  nvidia-smi --query-gpu=name --format=csv,noheader
  counted 250 exactness-targets.log python3 -m pytest -vv -p no:cacheprovider tests/gpu/test_cuda_exactness.py \
    -k "(mtp_equals_plain_bf16 and graphs) or stress"
  bench_27b 200 bench-targets-bf16 --set 'bench.batch_sizes=[1,8,32]' --set 'bench.ks=[2,3]'
  bench_27b 110 bench-targets-fp8 --set model.synthetic=qwen3.5-27b-fp8 --set 'bench.batch_sizes=[1]' \
    --set 'bench.draft_lm_heads=[bf16,fp8]' --set mtp.draft_vocab_file=first --set 'bench.draft_vocabs=[0,32768]'
  for kind in bf16 w8a8; do  # #13's and #14's GEMM tables: the engine's launch against cuBLAS, M = 1..256
    timeout 150 python3 benchmarks/gemm_buckets.py qwen3.5-27b --set dispatch --kind $kind \
      --out "$OUT/gemm-dispatch-$kind.json" >"$OUT/gemm-dispatch-$kind.log" 2>&1
    echo "[rc $? at ${SECONDS}s] gemm dispatch $kind"; sed -n '/^The launch as the engine/,$p' "$OUT/gemm-dispatch-$kind.log"
  done
fi
if [[ "$STAGE" == kauto ]]; then  # one device call (~8 min; AUTO_ONLY=1: ~3 min): `mtp.k: auto`'s chained steps, 27B
  # bf16 B1 / B8 / B32 at oracle 0.8, max_k 3: the exactness subset, then plain, K=3 and k auto with the lookahead (on
  # by default); AUTO_ONLY=1 runs k auto with cache.lookahead=false instead (its steps unchained, as before they chained)
  if [[ "${AUTO_ONLY:-0}" == 1 ]]; then
    bench_27b 240 bench-kauto-unchained --set 'bench.batch_sizes=[1,8,32]' --set 'bench.ks=[auto]' --set mtp.max_k=3 \
      --set cache.lookahead=false
  else
    counted 300 exactness-kauto.log python3 -m pytest -vv -p no:cacheprovider tests/gpu/test_cuda_exactness.py \
      -k "(mtp_equals_plain_bf16 and graphs) or stress or k_auto"
    bench_27b 330 bench-kauto-chained --set 'bench.batch_sizes=[1,8,32]' --set 'bench.ks=[3,auto]' --set mtp.max_k=3
  fi
fi
if [[ "$STAGE" == ksweep ]]; then  # three device calls (~9 min each): #16's k auto sweep, a few batch sizes a call
  # (OUTPUT_LEN: tokens a request, default 256: at 64 the oracle's draws alone put the K that is best in expectation
  # more than 3% behind the best fixed K in 10-40% of sweeps at B1-B32; benchmarks/oracle_spread.py)
  preset=qwen3.5-27b; [[ "${MODEL:-fp8}" == fp8 ]] && preset=qwen3.5-27b-fp8
  batches=${BATCHES:-1,2,4}
  bench_27b 570 "bench-ksweep-${MODEL:-fp8}-b${batches//,/-}" --set model.synthetic=$preset \
    --set "bench.batch_sizes=[$batches]" --set 'bench.ks=[1,2,3,4,auto]' --set mtp.max_k=4 \
    --set "bench.output_len=${OUTPUT_LEN:-256}"
fi
if [[ "$STAGE" == serve ]]; then  # one device call (~5 min; carry .whl with the serve wheels in .whl/serve: fastapi,
  # uvicorn, prometheus-client, openai and their dependencies, which the GPU box lacks; docs/development.md)
  counted 240 serve-cuda.log python3 -m pytest -vv -p no:cacheprovider tests/gpu/test_serve_cuda.py
  counted 200 moe-exact.log python3 -m pytest -vv -p no:cacheprovider tests/gpu/test_moe_exactness.py
  counted 100 host-syncs.log python3 -m pytest -vv -p no:cacheprovider tests/gpu/test_host_syncs.py
fi
if [[ "$STAGE" == tp2 || "$STAGE" == tp2serve || "$STAGE" == tp2bench ]]; then  # issue #23: two GPUs, NVLink multicast off as the device asks
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  nvidia-smi topo -m | head -4
fi
if [[ "$STAGE" == tp2 ]]; then  # one device call (~9 min)
  # tp2_tokens LIMIT NAME RECIPE SETS...: benchmarks/tensor_parallel.py tokens into $OUT/tp2-NAME, its summary printed
  tp2_tokens() { local limit=$1 name=$2 recipe=$3; shift 3
                 timeout "$limit" python3 benchmarks/tensor_parallel.py tokens "$recipe" "$@" --out "$OUT/tp2-$name" \
                   >"$OUT/tp2-tokens-$name.log" 2>&1
                 echo "[rc $? at ${SECONDS}s] tp2 tokens $name"; grep -vE "^\s*$|Warn" "$OUT/tp2-tokens-$name.log" | tail -30
                 rm -f "$OUT/tp2-$name"/rank*.json "$OUT/tp2-$name/tp-spec.json"; }
  # the shipped trained model (bf16, graphs): TP=2 against TP=1 on the same weights, and MTP-on == MTP-off
  tp2_tokens 150 small recipes/small.yaml --set model.dtype=bfloat16 \
    --set compile.cuda_graphs=true --set model.device=cuda
  # 27B shapes (MODEL: a synthetic preset): MTP-on == MTP-off; a synthetic model is not compared with TP=1
  model=${MODEL:-qwen3.5-27b}
  tp2_tokens 400 "$model" recipes/bench-27b.yaml --set "model.synthetic=$model"
  [[ "${TESTS:-1}" == 1 ]] && counted 220 tp2-tests.log python3 -m pytest -vv -p no:cacheprovider tests/gpu/test_tp2.py \
    -k "not compiled and not server"
fi
if [[ "$STAGE" == tp2serve ]]; then  # one device call (~3 min): `qwen-mtp serve` at TP=2, MTP on against off
  counted 300 tp2-serve.log python3 -m pytest -vv -p no:cacheprovider tests/gpu/test_tp2.py -k server
fi
if [[ "$STAGE" == tp2bench ]]; then  # one device call (~8 min)
  timeout 90 python3 benchmarks/tensor_parallel.py collectives recipes/bench-27b.yaml --out "$OUT/tp2" \
    --rows 1 2 3 4 5 8 16 24 32 40 >"$OUT/tp2-collectives.log" 2>&1
  echo "[rc $? at ${SECONDS}s] tp2 collectives"; tail -12 "$OUT/tp2-collectives.log"
  rm -f "$OUT/tp2"/collectives-*.json
  for tp in 1 2; do
    bench_27b 200 bench-tp$tp --set parallel.tp=$tp --set 'bench.batch_sizes=[1,8]' --set 'bench.ks=[2,3]'
  done
  python3 benchmarks/tensor_parallel.py summary --tp1 "$OUT/bench-tp1/bench.json" --tpn "$OUT/bench-tp2/bench.json" \
    --collectives "$OUT/tp2/tp-collectives.json" --out "$OUT/tp2/tp-summary.json"
fi
if [[ "$STAGE" == fp8prefill ]]; then  # one device call (~6 min; carry torchao): packed prefill rows of FP8 weights
  # on the W8A8 "tma" plans: their rows across M and the packing invariance of FP8 engines' tokens; the plans swept
  # against scaled_mm and the W8A16 "grid" plan, the best applied to this copy's ops/linear.py (back in $OUT); the
  # 27B FP8 bursts' TTFT and the ITL under arrivals, packing off and on, with the applied plans
  counted 240 fp8-prefill-test.log python3 -m pytest -vv -p no:cacheprovider tests/gpu/test_fp8.py \
    tests/gpu/test_mixed_steps_cuda.py -k "w8a8_prefill_rows or tokens_do_not_depend_on_packing"
  sweep_apply 200 gemm_prefill_fp8.py gemm-prefill-fp8 "^one forward|best|ERROR"
  itl_27b qwen3.5-27b-fp8-w8a8-prefill "" --set model.synthetic=qwen3.5-27b-fp8
fi
if [[ "$STAGE" == prefillbuckets ]]; then  # one device call (~6 min): prefill row buckets, swept, applied, measured
  # mixed_steps.py with the shipped prefill plans; the sweep (candidates per M, the bucketed dispatch's bits and
  # times against cuBLAS) applied to this copy's ops/linear.py (back in $OUT); mixed_steps.py again
  itl_27b shipped-plans ""
  sweep_apply 240 gemm_prefill.py gemm-prefill-buckets "bucketed|one forward"
  itl_27b prefill-buckets ""  # its "packed alone-exact": packed == alone at 27B with the new tables
fi
if [[ "$STAGE" == tmaloads ]]; then  # one device call (~9 min)
  if [[ "${SWEEP:-1}" == 1 ]]; then  # APPLY=1: the winners into TMA_LOAD_BUCKETS for the rest of this call
    timeout 200 python3 benchmarks/gemm_tma_loads.py --out "$OUT/gemm-tma-loads.json" $([[ "${APPLY:-0}" == 1 ]] && echo --apply) \
      >"$OUT/gemm-tma-loads.log" 2>&1
    echo "[rc $? at ${SECONDS}s] gemm_tma_loads"; grep -E "M=  1|M= 32|M=128|False|row buckets" "$OUT/gemm-tma-loads.log"
  fi
  # The benches with no TMA loads (QWEN_MTP_TMA_LOADS=0), then as the engine picks them (TMA_LOAD_BUCKETS)
  for loads in 0 table; do
    QWEN_MTP_TMA_LOADS=${loads/table/} bench_27b 120 "bench-loads-$loads" --set "bench.batch_sizes=${BF16_BATCHES:-[1,32]}"
  done
  if [[ "${FP8:-0}" == 1 ]]; then  # carry torchao
    for loads in 0 table; do
      QWEN_MTP_TMA_LOADS=${loads/table/} bench_27b 150 "bench-fp8-loads-$loads" --set model.synthetic=qwen3.5-27b-fp8 \
        --set "bench.batch_sizes=${FP8_BATCHES:-[1]}"
    done
  fi
  # The exactness subset with every decode plan loading by TMA (the 0.8B fixture's shapes are in no table; TMA and
  # pointer loads give the same bits, so any mix of them is exact when both are), each test's line as it ends
  QWEN_MTP_TMA_LOADS=1 counted "${EXACT_LIMIT:-300}" tma-exact.log python3 -m pytest -vv -p no:cacheprovider \
    tests/gpu/test_cuda_exactness.py -k "(mtp_equals_plain_bf16 and graphs) or stress"
fi
if [[ "$STAGE" == prefetch ]]; then  # one device call (~9 min): `GemmPlan.l2_prefetch` engine-wide, and A/B trees
  # The 27B bench (K=3 at oracle 0.8, BATCHES, contexts PROMPT_LENS: e.g. [128,2048]) per MODELS (bf16, fp8: carry
  # torchao) and per SETTINGS: a number N runs this tree with QWEN_MTP_L2_PREFETCH=N (0: none; N: every decode plan
  # asks L2 for its first N K blocks before the PDL wait; the default is 2); "baseline" runs the qwen_mtp under
  # BASELINE (carried: e.g. `git archive <commit> qwen_mtp | tar -x -C .baseline`) with the tables, "tree:DIR" the
  # qwen_mtp under DIR, both with their own default prefetch (QWEN_MTP_L2_PREFETCH unset: until the thirty-seventh
  # session they ran with 0, so their A/Bs against "2" also switched the prefetch); "env:NAME=VALUE[,NAME=VALUE]" runs
  # this tree with those variables set (e.g. env:QWEN_MTP_PDL=0). A setting that comes again writes
  # to its own folder (bench-MODEL-SETTING-run2, ...); `benchmarks/ab_table.py` then prints every run side by side
  # (ab-table.md). Then, with EXACT=1, the W8A8 MTP-on == MTP-off tests (fp8 in
  # MODELS) and the exactness subset with PREFETCH_EXACT blocks, each test's line as it ends.
  declare -A runs=()
  for model in ${MODELS:-bf16 fp8}; do
    sets=(); [[ $model == fp8 ]] && sets=(--set model.synthetic=qwen3.5-27b-fp8)
    for setting in ${SETTINGS:-0 2 4 8}; do
      path="$PYTHONPATH" blocks=$setting assignments=
      [[ $setting == baseline ]] && path="$PWD/${BASELINE:-.baseline}:$PYTHONPATH" blocks=
      [[ $setting == tree:* ]] && path="$PWD/${setting#tree:}:$PYTHONPATH" blocks= setting=${setting//[^A-Za-z0-9_-]/}
      [[ $setting == env:* ]] && assignments=${setting#env:} blocks= setting=${setting//[^A-Za-z0-9_-]/}
      runs[$model-$setting]=$(( ${runs[$model-$setting]:-0} + 1 ))
      name="bench-$model-$setting"; (( runs[$model-$setting] > 1 )) && name+="-run${runs[$model-$setting]}"
      # PYTHONSAFEPATH: `python3 -m` would put the working directory (this tree) ahead of PYTHONPATH, so a
      # "baseline" run would run this tree; the bench JSON's "package" names the tree that ran.
      (
        unset QWEN_MTP_L2_PREFETCH; [[ -n $blocks ]] && export QWEN_MTP_L2_PREFETCH=$blocks
        for assignment in ${assignments//,/ }; do export "$assignment"; done
        PYTHONSAFEPATH=1 PYTHONPATH="$path" bench_27b 100 "$name" "${sets[@]}" \
          --set "bench.batch_sizes=${BATCHES:-[1]}" --set "bench.prompt_len=${PROMPT_LENS:-128}"
      )
    done
  done
  # every run side by side, each setting against the first (SKIP_FIRST: settings whose first run was a cold warm-up)
  python3 benchmarks/ab_table.py "$OUT" --settings ${SETTINGS:-0 2 4 8} ${SKIP_FIRST:+--skip-first $SKIP_FIRST} \
    | tee "$OUT/ab-table.md"
  if [[ "${EXACT:-1}" == 1 ]]; then
    if [[ " ${MODELS:-bf16 fp8} " == *" fp8 "* ]]; then
      QWEN_MTP_L2_PREFETCH=${PREFETCH_EXACT:-2} counted 150 prefetch-fp8.log python3 -m pytest -vv -p no:cacheprovider \
        tests/gpu/test_fp8.py -k "mtp_equals_plain and w8a8"
    fi
    QWEN_MTP_L2_PREFETCH=${PREFETCH_EXACT:-2} counted "${EXACT_LIMIT:-300}" prefetch-exact.log python3 -m pytest -vv \
      -p no:cacheprovider tests/gpu/test_cuda_exactness.py -k "(mtp_equals_plain_bf16 and graphs) or stress"
  fi
fi
if [[ "$STAGE" == w8a8 ]]; then  # one device call (~5-9 min): kernel benchmarks of two trees
  # Each of MICRO (default: gemm_w8a8, the W8A8 GEMM at the 27B FP8 shapes, M = 1..128, against W8A16, our bf16 and
  # cuBLAS; also gdn_recurrent, the GDN decode / verify kernel per B and T) with this tree, and first with the
  # qwen_mtp under BASELINE when it is set (carried); FAMILY=1 then sweeps the W8A8 plan family with this tree
  # (FAMILY_ARGS: e.g. "--choice-m 1,8,16 --keep-splits", plans for M <= 16 that keep the row buckets valid).
  for micro in ${MICRO:-gemm_w8a8}; do
    for tree in ${BASELINE:+baseline} here; do
      path="$PYTHONPATH"; [[ $tree == baseline ]] && path="$PWD/$BASELINE:$PYTHONPATH"
      PYTHONPATH="$path" timeout 200 python3 "benchmarks/$micro.py" $([[ $micro == gemm_w8a8 ]] && echo qwen3.5-27b) \
        --out "$OUT/$micro-$tree.json" >"$OUT/$micro-$tree.log" 2>&1
      echo "[rc $? at ${SECONDS}s] $micro $tree"; grep -vE "^\s*$|Warn" "$OUT/$micro-$tree.log" | tail -40 | cut -c1-160
    done
  done
  if [[ "${FAMILY:-0}" == 1 ]]; then
    timeout 300 python3 benchmarks/gemm_w8a8.py qwen3.5-27b --family ${FAMILY_ARGS:-} --out "$OUT/gemm-w8a8-family.json" \
      >"$OUT/gemm-w8a8-family.log" 2>&1
    echo "[rc $? at ${SECONDS}s] gemm_w8a8 --family"; sed -n '/^Best W8A8 plan/,$p' "$OUT/gemm-w8a8-family.log"
  fi
fi
if [[ "$STAGE" == all || "$STAGE" == profile ]]; then
  python3 benchmarks/profile_step.py "${1:-recipes/bench-27b.yaml}" 2>&1 | tee "$OUT/profile.log" | tail -30
fi
if [[ "$STAGE" == all || "$STAGE" == bench ]]; then
  recipe="${1:-recipes/bench-27b.yaml}"; shift || true
  python3 -m qwen_mtp.cli bench "$recipe" --set "bench.out_dir=$OUT/bench" "$@" 2>&1 | tee "$OUT/bench.log"
fi

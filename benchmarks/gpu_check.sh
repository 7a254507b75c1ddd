#!/usr/bin/env bash
# Every GPU check in one script, for a lent GPU machine (one H200: torch 2.11, triton 3.6, no
# internet). Finishes in under 8 minutes (the timeouts sum to 22: run it under an outer timeout); results land in $OUT (or benchmarks/results).
#   0. bf16 GEMM and attention TFLOP/s at a few shapes beside the cost model's values
#      (benchmarks/gpu_efficiency.py)
#   1. the Triton kernels on real CUDA: correctness against fp32 references, then their
#      benchmark against SDPA-flash and eager linear + cross-entropy   (benchmarks/kernels.py)
#   2. a profile of the GPU: layer times of llama-1b at the shapes a 1-GPU plan runs
#   3. an emitted program on nccl: plan llama-1b for this one GPU with that profile, emit,
#      run 20 steps in bf16 mixed precision (the plan's dtype), compare predicted and measured;
#      the same layout with the other attention kernel (SDPA or autopar's flash kernel, whichever
#      the plan did not choose), with the fused loss and with the activations offloaded to the
#      host (recompute=offload), each priced as given (autopar evaluate) and run 12 steps
#   4. the same with float8 linears and compiled blocks (--fp8 tensorwise --compile; needs
#      torchao on the machine, else the run says so in one line), then each of the two alone
#      (the first run, 2026-12-04, measured both together no faster than bf16 and 0.9 GiB larger)
# First run on one H200 on 2026-12-04 (2 min 50 s; benchmarks/measured/gpu_check_h200_2026-12-04.json);
# the second, with every variant run 20 steps, 8 min 25 s (benchmarks/measured/gpu_check_h200_2026-12-04b.json).
# PACK=1: at the end, everything it wrote under $OUT except the runs' folders goes into one
# $OUT/gpu_check.tar.gz (the device tool brings back a limited number of files: the second run's
# came back 8 of 24), and those files are removed from $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:${PYTHONPATH:-}" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
PY=$(command -v python || command -v python3)  # the GPU image has python3 only
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" \
  | tee "$OUT/gpu_env.txt"

echo "== 0. GEMM and attention efficiency, measured beside the GPU kernel model"
timeout 60 "$PY" -m benchmarks.gpu_efficiency --out "$OUT/gpu_efficiency.json" 2>&1 | tee "$OUT/gpu_efficiency.log"

echo "== 1. kernels: correctness + benchmark"
timeout 200 "$PY" -m benchmarks.kernels --out "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.log"

# one GPU of the h200-8x preset (the preset file itself, one device per node)
sed -e 's/^name = .*/name = "h200x1"/' -e 's/^devices_per_node = .*/devices_per_node = 1/' \
  cost_models/presets/h200-8x.toml > "$OUT/h200x1.toml"

echo "== 2. profile of the GPU (layers of llama-1b, seq 2048)"
timeout 60 "$PY" -m torch.distributed.run --nproc-per-node 1 -m cost_models.profiler --cluster "$OUT/h200x1.toml" \
  --model llama-1b --seq-len 2048 --batches 1,2 --repeats 5 -o "$OUT/profile_h200.json" 2>&1 | tail -5

# plan_and_run TAG [PLAN FLAGS...]: plan llama-1b for the one GPU (with the step-2 profile), run it 20 steps
plan_and_run() {
  local tag=$1; shift
  timeout 60 "$PY" -m planner.entry.cli plan --model llama-1b --cluster "$OUT/h200x1.toml" --global-batch 8 \
    --seq-len 2048 "${PROFILE[@]}" "$@" --force -o "$OUT/plan_$tag.json" 2>&1 | tail -15
  run_plan "$tag" 120
}

# run_plan TAG LIMIT_S [STEPS]: run plan_TAG.json STEPS (20) steps, its log kept as train_log_TAG.jsonl
run_plan() {
  timeout "$2" "$PY" -m planner.entry.cli run "$OUT/plan_$1.json" --steps "${3:-20}" --dir "$OUT/run_$1" 2>&1 | tail -8
  cp "$OUT/run_$1/train_log.jsonl" "$OUT/train_log_$1.jsonl" 2>/dev/null || true
}

# run_variants TAG KEY=VALUE...: plan_TAG.json's configuration with each change, priced as given
# (autopar evaluate), then run
run_variants() {
  local tag=$1 config variant cfg
  shift
  config=$("$PY" -c "import json, sys; print(json.load(open(sys.argv[1]))['config'])" "$OUT/plan_$tag.json" 2>/dev/null)
  [ -n "$config" ] || return 0
  for variant in "$@"; do
    cfg=$(echo "$config" | sed -e "s/${variant%%=*}=[a-z0-9-]*/$variant/")
    timeout 60 "$PY" -m planner.entry.cli evaluate --model llama-1b --cluster "$OUT/h200x1.toml" --global-batch 8 \
      --seq-len 2048 "${PROFILE[@]}" --config "$cfg" --force -o "$OUT/plan_${tag}_${variant//=/_}.json" 2>&1 | tail -2
    run_plan "${tag}_${variant//=/_}" 100 12
  done
}

PROFILE=()
[ -s "$OUT/profile_h200.json" ] && PROFILE=(--profile "$OUT/profile_h200.json")  # uncalibrated roofline if step 2 failed

echo "== 3. plan -> emit -> run on nccl; then the same layout with SDPA attention, the fused loss, offload"
plan_and_run h200
other=$("$PY" -c "import json, sys; print('flash' if 'attention=eager' in json.load(open(sys.argv[1]))['config'] else 'eager')" \
  "$OUT/plan_h200.json" 2>/dev/null)
run_variants h200 "attention=${other:-eager}" "loss=fused" "recompute=offload"

echo "== 4. plan -> emit -> run with float8 linears and compiled blocks; then each alone on the same layout"
plan_and_run h200_fp8 --fp8 tensorwise --compile
run_variants h200_fp8 "fp8=none" "compile=off"  # which of the two moved time and memory

if [ "${PACK:-0}" = 1 ]; then  # one archive instead of many files (header)
  (cd "$OUT" && find . -maxdepth 1 -type f ! -name gpu_check.tar.gz ! -name .packed -printf '%P\n' > .packed \
    && tar czf gpu_check.tar.gz -T .packed && xargs rm -f < .packed && rm -f .packed && rm -rf run_*)
  ls -la "$OUT"
fi

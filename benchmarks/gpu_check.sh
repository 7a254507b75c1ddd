#!/usr/bin/env bash
# Every GPU check in one script, for a lent GPU machine (one H200: torch 2.11, triton 3.6, no
# internet). Finishes in under 8 minutes (the timeouts sum to 11); results land in $OUT (or benchmarks/results).
#   0. bf16 GEMM and attention TFLOP/s at a few shapes beside the cost model's values
#      (benchmarks/gpu_efficiency.py)
#   1. the Triton kernels on real CUDA: correctness against fp32 references, then their
#      benchmark against SDPA-flash and eager linear + cross-entropy   (benchmarks/kernels.py)
#   2. a profile of the GPU: layer times of llama-1b at the shapes a 1-GPU plan runs
#   3. an emitted program on nccl: plan llama-1b for this one GPU with that profile, emit,
#      run 10 steps in bf16 mixed precision (the plan's dtype), compare predicted and measured
#   4. the same with float8 linears and compiled blocks (--fp8 tensorwise --compile; needs
#      torchao on the machine, else the run says so in one line)
# Not yet run on a GPU (no machine was lent when it was written).
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

echo "== 3. plan -> emit -> run on nccl"
PROFILE=()
[ -s "$OUT/profile_h200.json" ] && PROFILE=(--profile "$OUT/profile_h200.json")  # uncalibrated roofline if step 2 failed
timeout 60 "$PY" -m planner.entry.cli plan --model llama-1b --cluster "$OUT/h200x1.toml" --global-batch 8 --seq-len 2048 \
  "${PROFILE[@]}" --force -o "$OUT/plan_h200.json" 2>&1 | tail -15
timeout 100 "$PY" -m planner.entry.cli run "$OUT/plan_h200.json" --steps 10 --dir "$OUT/run_h200" 2>&1 | tail -15
cp "$OUT/run_h200/train_log.jsonl" "$OUT/train_log_h200.jsonl" 2>/dev/null || true

echo "== 4. plan -> emit -> run with float8 linears and compiled blocks"
timeout 60 "$PY" -m planner.entry.cli plan --model llama-1b --cluster "$OUT/h200x1.toml" --global-batch 8 --seq-len 2048 \
  "${PROFILE[@]}" --fp8 tensorwise --compile --force -o "$OUT/plan_h200_fp8.json" 2>&1 | tail -15
timeout 120 "$PY" -m planner.entry.cli run "$OUT/plan_h200_fp8.json" --steps 10 --dir "$OUT/run_h200_fp8" 2>&1 | tail -15
cp "$OUT/run_h200_fp8/train_log.jsonl" "$OUT/train_log_h200_fp8.jsonl" 2>/dev/null || true

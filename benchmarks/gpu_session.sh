#!/usr/bin/env bash
# Every check that needs a GPU, on one CUDA machine: bash benchmarks/gpu_session.sh [PART ...]
#   bash ../shared/gpu/prepare.sh      # here, once: the wheels the GPU image lacks, into .gpu/
#   bash benchmarks/gpu_session.sh fit planner moe    # there, from the project root, .gpu/ carried
# PARTs (default: all, in this order; over 14 minutes on an H200, so a 10-minute call takes a few;
# the times are the H200 session of 2026-11-28, benchmarks/results/gpu/session3):
#   models   python -m benchmarks.gpu --only models,fit: our GPT per attention x recompute, eager and
#            compiled, plain PyTorch, and cli.py fit's path vs a plain loop (gpu.md/.json; about 7
#            minutes: every 1.2B model is drawn on the CPU, ~18 s)
#   fit      python cli.py fit --config configs/gpu_1b.yaml, 30 steps, no checkpoint (60 s)
#   planner  calibrate and step-check of configs/gpu_1b.yaml (gpu_1b_cluster.yaml, step_check.json;
#            25 s + 34 s)
#   moe      python -m benchmarks.gpu --only moe (moe_gpu_bf16.md/.json; 21 s)
#   speed    side by side on this card: our GPT (sdpa; recompute none and selective; dropout 0) eager
#            and compiled per layer, plain PyTorch SDPA eager and compiled, cli.py fit vs a plain
#            loop (speed/gpu.md), then the MLP's GEMMs in bf16 and FP8 tensorwise / rowwise, ours
#            and torchao's, eager and compiled (fp8_gpu.md; torchao among .gpu/'s wheels); the
#            models alone took over 180 s, so its fit section was cut: run fitloop for it
#   fitloop  python -m benchmarks.gpu --only fit: cli.py fit's path vs a plain loop over the same
#            module (speed/gpu.md; never measured on a GPU yet)
#   profile  python -m benchmarks.step_profile: one micro-batch of Megatron-LM's published 1.7B row
#            (and gpu_1b's) on this card by kernel kind beside the step-time model on h200, eager
#            and with the layers compiled (a fused stack's stand-in; step_profile.md/.json; the
#            three eager cases took 37 s, the two compiled ones are unmeasured: limit 240 s)
#   fp8      python -m benchmarks.fp8_step: the 1.2B GPT's training step with its linears in bf16,
#            FP8 tensorwise and FP8 rowwise (fp8_step.md/.json: tokens/s, the ratio to bf16 with a
#            95% CI, the first loss, bytes kept per layer vs the formula); 90 s; without
#            CUDA it exits 2 with one line
# Results go to $OUT (default benchmarks/results/gpu), everything printed to $OUT/session.log. Each
# step has its own limit (SIGABRT at the limit: Python prints every thread's stack), cut to what is
# left of $BUDGET seconds (560), so one that fails or hangs leaves the others' results.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/gpu}
BUDGET=${BUDGET:-560}
PARTS=${*:-models fit planner moe speed fitloop profile fp8}
mkdir -p "$OUT"
log="$OUT/session.log"
[ -f .gpu/setup-on-gpu.sh ] && source .gpu/setup-on-gpu.sh >>"$log" 2>&1
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
step() {  # step SECONDS NAME COMMAND...
  local limit=$1 name=$2; shift 2
  local left=$((BUDGET - SECONDS - 5))
  ((left < limit)) && limit=$left
  if ((limit < 20)); then echo "=== $name: skipped, ${left}s left" | tee -a "$log"; return; fi
  echo "=== $(date +%T) $name: $* (limit ${limit}s)" | tee -a "$log"
  local start=$SECONDS
  timeout -s ABRT -k 10 "$limit" "$@" >>"$log" 2>&1
  echo "=== $(date +%T) $name: exit $? after $((SECONDS - start)) s" | tee -a "$log"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a "$log"
for part in $PARTS; do
  case $part in
    models) step 450 "benchmarks.gpu" python -m benchmarks.gpu --only models,fit --out "$OUT" \
      --warmup 2 --steps 6 ;;
    fit) step 150 "fit gpu_1b" python cli.py fit --config configs/gpu_1b.yaml --trainer.max_steps 30 \
      --trainer.val_check_interval 30 --trainer.default_root_dir /tmp/fit_1b \
      --trainer.enable_checkpointing false ;;
    planner)
      step 60 "calibrate" python cli.py calibrate --config configs/gpu_1b.yaml --base h200 \
        --seconds 0.05 --out "$OUT/gpu_1b_cluster.yaml"
      step 150 "step-check" python cli.py step-check --config configs/gpu_1b.yaml \
        --cluster "$OUT/gpu_1b_cluster.yaml" --seconds 0.5 --out "$OUT/step_check.json" ;;
    moe) step 70 "moe layer, bf16" python -m benchmarks.gpu --only moe --out "$OUT" ;;
    speed)
      step 240 "compile + plain + fit" python -m benchmarks.gpu --only models,fit --backends sdpa \
        --policies none,selective --dropout 0 --out "$OUT/speed" --warmup 2 --steps 6
      step 90 "fp8 GEMMs" python -m benchmarks.fp8_gpu --out "$OUT" ;;
    fitloop) step 240 "fit vs plain loop" python -m benchmarks.gpu --only fit --out "$OUT/speed" \
      --warmup 2 --steps 6 ;;
    profile) step 240 "step profile" python -m benchmarks.step_profile --out "$OUT" ;;
    fp8) step 150 "fp8 GPT step" python -m benchmarks.fp8_step --out "$OUT" ;;
    *) echo "unknown part $part (models, fit, planner, moe, speed, fitloop, profile, fp8)"; exit 2 ;;
  esac
done
grep -av "it/s\]" "$log" | grep -a "===\|MFU\|TFLOP\|ratio\|wrote\|rror" | tail -40

#!/usr/bin/env bash
# LoRA on the full Qwen3-30B-A3B (48 layers, random init, seq 4096, micro-batch 1, real routing, bf16 compute,
# rank 16 on attention and experts): moe_tune against Transformers + PEFT (its parameter adapters on the fused
# experts, FSDP2), both from the same adapter init, 12 steps, medians of steps 5-12.
#   NPROC=1: no activation checkpointing (eager and compiled), then full activation checkpointing (AC=none, AC=full
#   in the table; SKIP_AC_NONE=1 runs only the second).
#   NPROC=2: EP=2 (eager and compiled) against PEFT + FSDP2 over the 2 GPUs, with AC=none and AC=full.
#   OUT=<results directory> NPROC=1|2 bash benchmarks/lora_h200.sh [overrides...]
set -euo pipefail
OUT=${OUT:?OUT=<results directory>}
NPROC=${NPROC:-1}
TIMEOUT=${TIMEOUT:-300}
workload=(experiment=qwen3_30b_a3b_lora_1gpu "$@")
opts=(--nproc "$NPROC" --baselines grouped_mm --timeout-s "$TIMEOUT")
mkdir -p "$OUT"
export PYTHONPATH="$(pwd):${PYTHONPATH:-}"
if [ "$NPROC" = 1 ]; then
  [ -n "${SKIP_AC_NONE:-}" ] || python -m moe_tune.bench "${workload[@]}" "${opts[@]}" \
    --variants "lora:;lora_compile:kernels.compile=true" --out "$OUT/ac_none"
  python -m moe_tune.bench "${workload[@]}" parallel.activation_checkpointing=full "${opts[@]}" \
    --variants "lora:;lora_compile:kernels.compile=true" --out "$OUT/ac_full"
else
  ep2="lora_ep2:parallel.ep=2;lora_ep2_compile:parallel.ep=2,kernels.compile=true"
  [ -n "${SKIP_AC_NONE:-}" ] || python -m moe_tune.bench "${workload[@]}" "${opts[@]}" --variants "$ep2" \
    --out "$OUT/ep2_ac_none"
  python -m moe_tune.bench "${workload[@]}" parallel.activation_checkpointing=full "${opts[@]}" --variants "$ep2" \
    --out "$OUT/ep2_ac_full"
fi
python benchmarks/rows_table.py "$OUT"

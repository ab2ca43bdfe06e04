#!/usr/bin/env bash
# LoRA on a quantized frozen base (issue 34), one H200: the bf16 base against peft.quantize_base=fp8 and nf4 (and
# those with bf16 adapters), in one moe-tune-bench run:
#   PART=speed: the LoRA workload of lora_h200.sh's committed rows (the full Qwen3-30B-A3B, 48 layers, random init,
#     seq 4096, micro-batch 1, data=random, real routing, rank 16 on attention and experts, bf16_fp32_master), full
#     activation checkpointing, compiled; 12 steps, medians of steps 5-12; beside Transformers + PEFT on
#     bitsandbytes 4-bit linears (BASELINES, default bnb4: needs bitsandbytes; none to leave it out).
#   PART=losses: the same model and adapters on 100 steps of the built-in chat records (data=arithmetic: rendered
#     through the chat template, loss on the assistant turns), the same seed and data for both bases.
#   PART=gemms: the expert GEMMs one by one, bf16 against fp8 and nf4 with both kernels.quantized_base values, and
#     the torch paths' pieces (benchmarks/quantized_base_gemms.py).
#   OUT=<dir> PART=speed|losses|gemms [VARIANTS='name:k=v,...;...'] bash benchmarks/quantized_base_h200.sh [overrides...]
set -euo pipefail
OUT=${OUT:?OUT=<results directory>}
PART=${PART:-speed}
# The three bases with fp32 master adapters (the committed rows), then fp8 and nf4 with bf16 adapters
# (train.precision=bf16: stochastic rounding, no fp32 copy; moe-tune-plan predicts 37.5 and 24.8 GiB against 41.6
# and 28.9). VARIANTS='...;lora_nf4_base_triton:peft.quantize_base=nf4,kernels.quantized_base=triton' adds the
# triton GEMMs (slower on an H100 at 6b985af).
default_variants='lora_bf16_base:;lora_fp8_base:peft.quantize_base=fp8;lora_nf4_base:peft.quantize_base=nf4'
default_variants+=';lora_fp8_base_bf16:peft.quantize_base=fp8,train.precision=bf16'
default_variants+=';lora_nf4_base_bf16:peft.quantize_base=nf4,train.precision=bf16'
workload=(experiment=qwen3_30b_a3b_lora_1gpu parallel.activation_checkpointing=full kernels.compile=true)
opts=(--nproc 1 --timeout-s "${TIMEOUT:-420}"
      --variants "${VARIANTS:-$default_variants}")
export PYTHONPATH="$(pwd):${PYTHONPATH:-}"
case $PART in
  speed) python -m moe_tune.bench "${workload[@]}" "$@" "${opts[@]}" --baselines "${BASELINES:-bnb4}" \
           --out "$OUT/speed" ;;
  losses) python -m moe_tune.bench "${workload[@]}" data=arithmetic data.num_samples=16384 train.steps=100 \
            train.warmup_steps_excluded=10 "$@" "${opts[@]}" --baselines none --out "$OUT/losses" ;;
  gemms) python benchmarks/quantized_base_gemms.py "$OUT/gemms" ;;
  *) echo "quantized_base_h200.sh: PART=$PART is not speed, losses or gemms" >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# Issue 6's precision table on one H200 per workload: fp32 unfused vs bf16 with fused kernels, per kernel set
# (torch, te, te + FP8), 100 steps of the built-in arithmetic data, real routing, micro-batch 1 x 4096 tokens.
#   bash benchmarks/precision_h200.sh qwen3 OUT_DIR   Qwen3-30B-A3B shapes, 8 layers
#   bash benchmarks/precision_h200.sh small OUT_DIR   a small MoE: 4 layers, hidden 1024, 32 experts top-4
# ROWS=fused: every row but the slow fp32 one; ROWS=fp32: the fp32 row, then the reference again (so the two halves
# can run side by side on two GPUs, CUDA_VISIBLE_DEVICES=0 / 1, and be joined by precision_table.py a.json,b.json);
# ROWS=bounds: the reference, the noise-floor row and the rows the issue bounds (te, every FP8 recipe), for repeats
# with EXTRA='train.lr=3e-5 train.seed=N'.
# ROW_TIMEOUT_S: seconds per row (180; 600 where the fp32 row runs). VARIANTS='name:k=v;...' runs those rows instead; EXTRA='k=v k=v' adds overrides to every row
# (e.g. EXTRA='train.lr=3e-5', where rounding alone moves the loss by well under 1%). Needs TransformerEngine for the te rows (they are recorded as errors without it). Loss differences are
# against bf16_torch (bf16 compute, fp32 master weights, kernels=torch).
set -euo pipefail
which=${1:?usage: precision_h200.sh qwen3|small OUT_DIR}; out=${2:?usage: precision_h200.sh qwen3|small OUT_DIR}
common=(experiment=qwen3_30b_a3b_1gpu data=arithmetic data.num_samples=16384 train.steps=100
        train.warmup_steps_excluded=10)
if [ "$which" = small ]; then
  common+=(model.overrides.num_hidden_layers=4 +model.overrides.hidden_size=1024 +model.overrides.num_experts=32
           +model.overrides.num_experts_per_tok=4 +model.overrides.moe_intermediate_size=512
           +model.overrides.intermediate_size=2048 +model.overrides.num_attention_heads=16
           +model.overrides.num_key_value_heads=4 +model.overrides.head_dim=64 +model.overrides.vocab_size=32768)
fi
reference='bf16_torch:kernels=torch'
fp32='fp32_unfused:train.precision=fp32,kernels.fused_loss=false,kernels.experts=loop'
fp8='te_fp8_current:kernels=te,kernels.fp8=current;te_fp8_delayed:kernels=te,kernels.fp8=delayed'
fp8+=';te_fp8_blockwise:kernels=te,kernels.fp8=blockwise'
fp8+=';te_fp8_current_split:kernels=te,kernels.fp8=current,kernels.fp8_fprop_split_accumulator=true'
fp8+=';te_fp8_current_fwd_only:kernels=te,kernels.fp8=current,kernels.fp8_backward=high_precision'
fp8+=';te_fp8_current_e4m3:kernels=te,kernels.fp8=current,kernels.fp8_format=e4m3'
bounded="$reference;torch_unfused_loss:kernels.fused_loss=false;te:kernels=te;$fp8"
fused="$bounded;amp_bf16:train.precision=amp_bf16;torch_pure_bf16:train.precision=bf16"
fused+=';te_pure_bf16:kernels=te,train.precision=bf16'
timeout=180  # per row; the Qwen3 fp32 row takes ~6 min
case ${ROWS:-all} in
  all) variants="$fused;$fp32"; timeout=600 ;;
  fused) variants=$fused ;;
  fp32) variants="$fp32;$reference"; timeout=600 ;;
  bounds) variants=$bounded ;;
  *) echo "precision_h200.sh: ROWS=${ROWS} is not one of all, fused, fp32, bounds" >&2; exit 2 ;;
esac
variants=${VARIANTS:-$variants}
read -r -a extra <<< "${EXTRA:-}"
common+=("${extra[@]}")
exec python3 -m moe_tune.bench "${common[@]}" --nproc 1 --baselines none --reference bf16_torch --timeout-s ${ROW_TIMEOUT_S:-$timeout} \
  --variants "$variants" --out "$out"

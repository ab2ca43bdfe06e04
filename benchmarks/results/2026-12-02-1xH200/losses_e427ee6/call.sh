#!/usr/bin/env bash
# 1 x H200 at e427ee6: loss curves with the loss's Triton kernel against the unfused loss (full fp32 logits and
# PyTorch's cross-entropy), 50 steps of arithmetic data at lr 3e-5, fp32 master weights (deterministic updates);
# fused_chunk1024 adds the fp32-output GEMM accumulation over 4 chunks (and is the summation-order noise row).
set -u
R=$OUT/r; mkdir -p $R
save() { (cd $OUT && tar czf r.tgz r); }
t0=$(date +%s); el() { echo "[$(( $(date +%s)-t0 )) s] $*"; }
python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/base/*.whl > /dev/null 2>&1
cd .gpu/new
export PYTHONPATH=$(pwd):/tmp/site MOE_TUNE_COMMIT=e427ee6
python -m moe_tune.bench experiment=qwen3_30b_a3b_1gpu data=arithmetic data.num_samples=16384 train.steps=50 \
  train.lr=3e-5 train.warmup_steps_excluded=10 --nproc 1 --baselines none --reference unfused --timeout-s 200 \
  --variants 'unfused:kernels.fused_loss=false;fused:;fused_chunk1024:kernels.loss_chunk_size=1024' \
  --out $R/losses > $R/losses.log 2>&1
el losses; grep "\] [0-9]/" $R/losses.log | tail -3; grep "| ok" $R/losses/*.md | cut -c1-320; save

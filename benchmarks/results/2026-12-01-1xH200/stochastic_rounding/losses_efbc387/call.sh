#!/usr/bin/env bash
# 1 x H200 at efbc387: issue 6's precision procedure (100 steps of arithmetic data, lr 3e-5, real routing,
# micro-batch 1) for bf16 + stochastic rounding with the kept Triton kernel (hashed bits) against the reference
# (fp32 master), the noise-floor row and plain bf16: Qwen3 8 layers seeds 0 and 1, the small MoE seed 0.
set -u
R=$OUT/r; mkdir -p $R
save() { (cd $OUT && tar czf r.tgz r); }
t0=$(date +%s); el() { echo "[$(( $(date +%s)-t0 )) s] $*"; }
V='bf16_torch:kernels=torch;torch_unfused_loss:kernels.fused_loss=false;bf16_sr:train.precision=bf16,optim.stochastic_rounding=true;torch_pure_bf16:train.precision=bf16'
for run in "qwen3 0" "small 0" "qwen3 1"; do
  set -- $run
  VARIANTS="$V" EXTRA="train.lr=3e-5 train.seed=$2" ROW_TIMEOUT_S=120 timeout 280 bash benchmarks/precision_h200.sh $1 $R/$1-seed$2 > $R/$1-seed$2.log 2>&1
  el $1-seed$2; grep -h "^| [bt]" $R/$1-seed$2/*.md | cut -d'|' -f2,4,9,14-18; save
done

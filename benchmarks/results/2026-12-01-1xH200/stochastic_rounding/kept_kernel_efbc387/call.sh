#!/usr/bin/env bash
# 1 x H200 at efbc387: the whole GPU suite (kernels moved to module level, launch-counting tests); 8-layer
# bf16 + stochastic rounding (kept kernel: one hash, 1024 elements on 4 warps) against plain bf16 at micro-batch
# 1 and 4, compiled, rows alternating (two bench runs per micro-batch).
set -u
R=$OUT/r; mkdir -p $R
save() { (cd $OUT && tar czf r.tgz r); }
t0=$(date +%s); el() { echo "[$(( $(date +%s)-t0 )) s] $*"; }
timeout 240 python -m pytest -q -m gpu -p no:cacheprovider -rs tests > $R/gpu-tests.log 2>&1; el all-tests; tail -22 $R/gpu-tests.log; save
for MB in 1 4; do
  V="sr:kernels.compile=true,optim.stochastic_rounding=true;bf16:kernels.compile=true;sr2:kernels.compile=true,optim.stochastic_rounding=true;bf16_2:kernels.compile=true"
  timeout 300 python -m moe_tune.bench experiment=qwen3_30b_a3b_1gpu train.precision=bf16 train.micro_batch_size=$MB --nproc 1 \
    --baselines none --timeout-s 120 --out $R/mb$MB --variants "$V" > $R/mb$MB.log 2>&1
  el mb$MB; grep "| ok\|fail" $R/mb$MB/*.md | cut -c1-200; save
done

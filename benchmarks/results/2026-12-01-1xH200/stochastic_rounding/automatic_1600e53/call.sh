#!/usr/bin/env bash
# 1 x H200 at 1600e53: the GPU suite (the fp32-beside-bf16 stochastic-rounding test on CUDA); 8-layer
# train.precision=bf16 with the automatic stochastic rounding (no flag) against optim.stochastic_rounding=false,
# compiled, micro-batch 1, rows alternating.
set -u
R=$OUT/r; mkdir -p $R
save() { (cd $OUT && tar czf r.tgz r); }
t0=$(date +%s); el() { echo "[$(( $(date +%s)-t0 )) s] $*"; }
timeout 240 python -m pytest -q -m gpu -p no:cacheprovider -rs tests > $R/gpu-tests.log 2>&1; el all-tests; tail -12 $R/gpu-tests.log; save
V="auto:kernels.compile=true;nearest:kernels.compile=true,optim.stochastic_rounding=false;auto_2:kernels.compile=true;nearest_2:kernels.compile=true,optim.stochastic_rounding=false"
timeout 300 python -m moe_tune.bench experiment=qwen3_30b_a3b_1gpu train.precision=bf16 train.micro_batch_size=1 --nproc 1 \
  --baselines none --timeout-s 120 --out $R/mb1 --variants "$V" > $R/mb1.log 2>&1
el mb1; grep "| ok\|fail" $R/mb1/*.md | cut -c1-200; grep -c "optim.stochastic_rounding=false with train.precision=bf16" $R/mb1/runs/*/*/stderr.log; save

#!/usr/bin/env bash
# 1 x H200: CompiledAdamW with its hyperparameters passed by value (no per-step host->device copy, which synced
# the host once per step): blocking runtime calls per step, GPU tests, bf16 rows alternating with torch's fused.
set -u
R=$OUT/r; mkdir -p $R
save() { (cd $OUT && tar czf r.tgz r); }
t0=$(date +%s); el() { echo "[$(( $(date +%s)-t0 )) s] $*"; }
python benchmarks/results/2026-12-01-1xH200/optim_host_sync/optsync.py 2>&1 | grep -v Warn | tail -6 > $R/optsync.txt; cat $R/optsync.txt; save
timeout 120 python -m pytest -q -m gpu -p no:cacheprovider tests/optim > $R/gpu-tests-optim.log 2>&1; el tests; tail -1 $R/gpu-tests-optim.log; save
V="fused1:kernels.compile=true,optim.compiled=false;compiled1:kernels.compile=true;fused2:kernels.compile=true,optim.compiled=false;compiled2:kernels.compile=true"
for mb in 1 4; do
  python -m moe_tune.bench experiment=qwen3_30b_a3b_1gpu train.precision=bf16 train.micro_batch_size=$mb --nproc 1 \
    --baselines none --timeout-s 200 --out $R/bf16_mb$mb --variants "$V" > $R/bf16_mb$mb.log 2>&1
  el mb$mb; grep "ok\|fail" $R/bf16_mb$mb.log; save
done

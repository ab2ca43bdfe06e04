#!/usr/bin/env bash
# 1 x H200: CompiledAdamW's step counting through foreach's tensor-list overload (no scalar read to the host):
# blocking runtime calls per step; GPU tests; micro-batch-1 bf16 rows against torch's fused.
set -u
R=$OUT/r; mkdir -p $R
save() { (cd $OUT && tar czf r.tgz r); }
t0=$(date +%s); el() { echo "[$(( $(date +%s)-t0 )) s] $*"; }
python benchmarks/results/2026-12-01-1xH200/optim_host_sync/optsync.py 2>&1 | grep -v Warn | tail -12 > $R/optsync.txt; cat $R/optsync.txt; save
timeout 100 python -m pytest -q -m gpu -p no:cacheprovider tests/optim > $R/gpu-tests-optim.log 2>&1; el tests; tail -1 $R/gpu-tests-optim.log; save
V="compiled1:kernels.compile=true;fused1:kernels.compile=true,optim.compiled=false;compiled2:kernels.compile=true"
python -m moe_tune.bench experiment=qwen3_30b_a3b_1gpu train.precision=bf16 train.micro_batch_size=1 --nproc 1 \
  --baselines none --timeout-s 150 --out $R/bf16_mb1 --variants "$V" > $R/bf16_mb1.log 2>&1
el mb1; grep "ok\|fail" $R/bf16_mb1.log; save

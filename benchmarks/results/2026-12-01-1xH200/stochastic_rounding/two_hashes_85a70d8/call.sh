#!/usr/bin/env bash
# 1 x H200: stochastic rounding with murmur3-finalizer bits in its Triton kernel: GPU tests of the optimizers,
# the optimizer microbenchmark, bf16 + stochastic rounding against plain bf16 at micro-batch 1 and 4.
set -u
R=$OUT/r; mkdir -p $R
save() { (cd $OUT && tar czf r.tgz r); }
t0=$(date +%s); el() { echo "[$(( $(date +%s)-t0 )) s] $*"; }
timeout 150 python -m pytest -q -m gpu -p no:cacheprovider tests/optim > $R/gpu-tests-optim.log 2>&1; el tests; tail -3 $R/gpu-tests-optim.log; save
timeout 120 python .gpu/calls/sr_bench.py > $R/sr_bench.md 2>&1; el micro; cat $R/sr_bench.md; save
for MB in 1 4; do
  V="sr:kernels.compile=true,optim.stochastic_rounding=true;bf16:kernels.compile=true"
  python -m moe_tune.bench experiment=qwen3_30b_a3b_1gpu train.precision=bf16 train.micro_batch_size=$MB --nproc 1 \
    --baselines none --timeout-s 150 --out $R/mb$MB --variants "$V" > $R/mb$MB.log 2>&1
  el mb$MB; grep "ok\|fail" $R/mb$MB.log | tail -3; save
done

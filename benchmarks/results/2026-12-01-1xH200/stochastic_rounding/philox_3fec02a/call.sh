#!/usr/bin/env bash
# 1 x H200: stochastic rounding with Philox bits inside a Triton kernel (3fec02a) against the torch.compile'd
# update with torch.randint bits (cb8cb11): GPU tests of the optimizers, the optimizer microbenchmark, whole
# bf16 + stochastic-rounding rows old/new interleaved at micro-batch 1 and 4, plain bf16 rows for the overhead.
set -u
R=$OUT/r; mkdir -p $R
save() { (cd $OUT && tar czf r.tgz r); }
t0=$(date +%s); el() { echo "[$(( $(date +%s)-t0 )) s] $*"; }
timeout 150 python -m pytest -q -m gpu -p no:cacheprovider tests/optim > $R/gpu-tests-optim.log 2>&1; el tests; tail -3 $R/gpu-tests-optim.log; save
timeout 120 python .gpu/calls/sr_bench.py > $R/sr_bench.md 2>&1; el micro; cat $R/sr_bench.md; save
for MB in 1 4; do
  OLD=.gpu/old OLD_COMMIT=cb8cb11 NEW_COMMIT=3fec02a EXPERIMENT=qwen3_30b_a3b_1gpu NPROC=1 MB=$MB BASELINE=none REPEATS=1 \
    TIMEOUT=150 OUT=$R/sr_mb$MB bash benchmarks/against_commit_h200.sh optim.stochastic_rounding=true > $R/sr_mb$MB.log 2>&1
  el sr_mb$MB; tail -3 $R/sr_mb$MB.log; save
done
python -m moe_tune.bench experiment=qwen3_30b_a3b_1gpu train.precision=bf16 train.micro_batch_size=1 --nproc 1 \
  --baselines none --timeout-s 150 --out $R/bf16_mb1 --variants "bf16_nearest:kernels.compile=true" > $R/bf16_mb1.log 2>&1
el bf16_mb1; grep "ok\|fail" $R/bf16_mb1.log | tail -3; save

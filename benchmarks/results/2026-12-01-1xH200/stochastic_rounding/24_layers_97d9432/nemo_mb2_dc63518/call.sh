#!/usr/bin/env bash
# 1 x H200 at dc63518: issue 14's 24-layer workload, NeMo AutoModel (torch dispatcher) at micro-batch 2 (its
# micro-batch-1 row ran at 97d9432; 2 was not tried). bf16 + stochastic rounding as in every 24-layer row.
set -u
R=$OUT/r; mkdir -p $R
save() { (cd $OUT && tar czf r.tgz r); }
t0=$(date +%s); el() { echo "[$(( $(date +%s)-t0 )) s] $*"; }
python3 -m pip install -q --no-index --no-deps --target /tmp/nemo_site .gpu/nemo/*.whl > /dev/null 2>&1
W="experiment=qwen3_30b_a3b_1gpu model.overrides.num_hidden_layers=24 train.precision=bf16 optim.stochastic_rounding=true"
python -m moe_tune.bench $W train.micro_batch_size=2 --nproc 1 --baselines none --variants none --peer automodel \
  --peer-pythonpath /tmp/nemo_site --timeout-s 500 --out $R/l24_nemo_mb2 > $R/l24_nemo_mb2.log 2>&1
el nemo_mb2; grep "| ok\|| oom\|error" $R/l24_nemo_mb2/*.md | cut -c1-220; tail -3 $R/l24_nemo_mb2.log; save

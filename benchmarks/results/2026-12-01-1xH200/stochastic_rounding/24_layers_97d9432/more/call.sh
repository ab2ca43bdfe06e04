#!/usr/bin/env bash
# 1 x H200: the 24-layer workload (as c16) at micro-batch 2 and 3 without activation checkpointing (the peak of
# micro-batch 1 was the optimizer's 116.2 GiB of state, not activations), Transformers at 2; NeMo AutoModel at 1
# with a longer timeout (its row was still setting up at 200 s).
set -u
R=$OUT/r; mkdir -p $R
save() { (cd $OUT && tar czf r.tgz r); }
t0=$(date +%s); el() { echo "[$(( $(date +%s)-t0 )) s] $*"; }
python3 -m pip install -q --no-index --no-deps --target /tmp/nemo_site .gpu/nemo/*.whl > /dev/null 2>&1
W="experiment=qwen3_30b_a3b_1gpu model.overrides.num_hidden_layers=24 train.precision=bf16 optim.stochastic_rounding=true"
V="moe_tune_mb2:kernels.compile=true;moe_tune_mb3:kernels.compile=true,train.micro_batch_size=3"
python -m moe_tune.bench $W train.micro_batch_size=2 --nproc 1 --baselines grouped_mm_nofsdp --variants "$V" --timeout-s 120 --out $R/l24_mb2 > $R/l24_mb2.log 2>&1
el l24_mb2; grep "ok\|fail\|oom\|error" $R/l24_mb2.log | grep bench; save
python -m moe_tune.bench $W train.micro_batch_size=1 --nproc 1 --baselines none --variants none --peer automodel --peer-pythonpath /tmp/nemo_site \
  --timeout-s 380 --out $R/l24_nemo > $R/l24_nemo.log 2>&1
el nemo; grep "ok\|fail\|oom\|error" $R/l24_nemo.log | grep bench; save

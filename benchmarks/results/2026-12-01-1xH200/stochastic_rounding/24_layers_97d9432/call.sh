#!/usr/bin/env bash
# 1 x H200: issue 14's 24-layer workload (Qwen3-30B-A3B shapes, 24 layers, seq 4096, bf16 parameters with
# stochastic rounding, real routing) on one GPU: Transformers, moe_tune (micro-batch 1 without activation
# checkpointing, micro-batch 2 with full), NeMo AutoModel (torch dispatcher); the same optimizer in every row.
set -u
R=$OUT/r; mkdir -p $R
save() { (cd $OUT && tar czf r.tgz r); }
t0=$(date +%s); el() { echo "[$(( $(date +%s)-t0 )) s] $*"; }
python3 -m pip install -q --no-index --no-deps --target /tmp/nemo_site .gpu/nemo/*.whl > /dev/null 2>&1
W="experiment=qwen3_30b_a3b_1gpu model.overrides.num_hidden_layers=24 train.precision=bf16 optim.stochastic_rounding=true train.micro_batch_size=1"
V="moe_tune_mb1:kernels.compile=true;moe_tune_mb2_ac_full:kernels.compile=true,train.micro_batch_size=2,parallel.activation_checkpointing=full"
python -m moe_tune.bench $W --nproc 1 --baselines grouped_mm_nofsdp --variants "$V" --timeout-s 170 --out $R/l24 > $R/l24.log 2>&1
el l24; grep "ok\|fail\|oom\|error" $R/l24.log | grep bench; save
python -m moe_tune.bench $W --nproc 1 --baselines none --variants none --peer automodel --peer-pythonpath /tmp/nemo_site \
  --timeout-s 200 --out $R/l24_nemo > $R/l24_nemo.log 2>&1
el nemo; grep "ok\|fail\|oom\|error" $R/l24_nemo.log | grep bench; save
nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv > $R/smi.txt

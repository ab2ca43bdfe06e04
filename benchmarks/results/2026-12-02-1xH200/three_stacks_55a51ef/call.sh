#!/usr/bin/env bash
# 1 x H200 at 55a51ef (the fused loss's Triton kernel): the headline three stacks, micro-batch 4 and 1, one
# moe-tune-bench run each; moe_tune's profiles at both; then moe_tune's 24-layer rows (micro-batch 2 and 3).
set -u
R=$OUT/r; mkdir -p $R
save() { (cd $OUT && tar czf r.tgz r); }
t0=$(date +%s); el() { echo "[$(( $(date +%s)-t0 )) s] $*"; }
python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/base/*.whl > /dev/null 2>&1
python3 -m pip install -q --no-index --no-deps --target /tmp/nemo_site .gpu/nemo/*.whl > /dev/null 2>&1
cd .gpu/new
export PYTHONPATH=/tmp/site MOE_TUNE_COMMIT=55a51ef
OUT=$R/three NEMO_SITE=/tmp/nemo_site MBS="4 1" NPROC=1 bash benchmarks/three_stacks_h200.sh > $R/three.log 2>&1
el three; tail -7 $R/three.log; save
export PYTHONPATH=$(pwd):/tmp/site
for mb in 1 4; do
  python -m moe_tune experiment=qwen3_30b_a3b_1gpu train.precision=bf16 train.micro_batch_size=$mb kernels.compile=true \
    train.steps=10 train.profile=true output_dir=/tmp/p$mb checkpoint.export_hf=false > $R/p$mb.log 2>&1
  cp /tmp/p$mb/profile_rank0.txt $R/profile_mb$mb.txt; cp /tmp/p$mb/profile_rank0.json $R/profile_mb$mb.json
  echo "== mb$mb"; head -9 $R/profile_mb$mb.txt | grep -E "wall|busy|kernels"
  el prof$mb; save
done
W="experiment=qwen3_30b_a3b_1gpu model.overrides.num_hidden_layers=24 train.precision=bf16 optim.stochastic_rounding=true"
python -m moe_tune.bench $W train.micro_batch_size=2 --nproc 1 --baselines none \
  --variants 'moe_tune_mb2:kernels.compile=true;moe_tune_mb3:kernels.compile=true,train.micro_batch_size=3' \
  --timeout-s 150 --out $R/l24 > $R/l24.log 2>&1
el l24; grep "\] [0-9]/" $R/l24.log | tail -3; save

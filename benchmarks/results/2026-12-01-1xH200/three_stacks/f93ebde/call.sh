#!/usr/bin/env bash
# 1 x H200: the headline three stacks at HEAD (optim.compiled now the default; the baseline and NeMo rows run
# torch's fused AdamW), micro-batch 4 and 1; then moe_tune's micro-batch-1 and -4 profiles.
set -u
R=$OUT/r; mkdir -p $R
save() { (cd $OUT && tar czf r.tgz r); }
t0=$(date +%s); el() { echo "[$(( $(date +%s)-t0 )) s] $*"; }
python3 -m pip install -q --no-index --no-deps --target /tmp/nemo_site .gpu/nemo/*.whl > /dev/null 2>&1
OUT=$R/three NEMO_SITE=/tmp/nemo_site MBS="4 1" NPROC=1 bash benchmarks/three_stacks_h200.sh > $R/three.log 2>&1
el three; tail -8 $R/three.log; save
for mb in 1 4; do
  python -m moe_tune experiment=qwen3_30b_a3b_1gpu train.precision=bf16 train.micro_batch_size=$mb kernels.compile=true \
    train.steps=10 train.profile=true output_dir=/tmp/p$mb checkpoint.export_hf=false > $R/p$mb.log 2>&1
  cp /tmp/p$mb/profile_rank0.txt $R/profile_mb$mb.txt
  echo "== mb$mb"; head -9 $R/profile_mb$mb.txt | grep -E "wall|busy|kernels"
  el prof$mb; save
done

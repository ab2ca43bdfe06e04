#!/usr/bin/env bash
# 1 x H200: GPU tests at HEAD; optim.compiled (Triton kernel only for params >= 2^24, torch fused for the rest)
# against torch's fused AdamW in whole bf16 runs, alternating pairs; CUDA-event times of the update at mb1 and mb4.
# (run as .gpu/calls/opt_events.py, the same file as the path below; opt_events.py moved beside this script from
# host_syncs_2a62e95/triton_adamw_d44881e/ when that folder left the tree, see commit 3e9656f)
set -u
R=$OUT/r; mkdir -p $R
save() { (cd $OUT && tar czf r.tgz r); }
t0=$(date +%s); el() { echo "[$(( $(date +%s)-t0 )) s] $*"; }
timeout 150 python -m pytest -q -m gpu -p no:cacheprovider tests > $R/gpu-tests.log 2>&1; el tests; tail -1 $R/gpu-tests.log; save
for mb in 1 4; do
  for v in false true; do
    python benchmarks/results/2026-12-01-1xH200/optim_compiled_0990593/opt_events.py experiment=qwen3_30b_a3b_1gpu train.precision=bf16 train.micro_batch_size=$mb \
      kernels.compile=true optim.compiled=$v train.steps=10 output_dir=/tmp/o$mb$v checkpoint.export_hf=false 2>&1 \
      | grep -E "OPT_EVENTS|Error" | tail -2 | sed "s/^/mb$mb optim.compiled=$v  /" >> $R/opt_events.txt
  done
  el events$mb; save
done
cat $R/opt_events.txt
V="fused1:kernels.compile=true;hybrid1:kernels.compile=true,optim.compiled=true;fused2:kernels.compile=true;hybrid2:kernels.compile=true,optim.compiled=true"
for mb in 1 4; do
  python -m moe_tune.bench experiment=qwen3_30b_a3b_1gpu train.precision=bf16 train.micro_batch_size=$mb --nproc 1 \
    --baselines none --timeout-s 200 --out $R/bf16_mb$mb --variants "$V" > $R/bf16_mb$mb.log 2>&1
  el mb$mb; grep "ok\|fail" $R/bf16_mb$mb.log; save
done

# 1 x H100 (device tool), commit 0aadc2d: .gpu/callOne.sh (in ../quantized_base_0aadc2d/call.sh) ran cols and l8 here:
# cols/ and cols.log: benchmarks/fp8_group_columns.py OUT 1 3 (per group against row tiles); tiles_decision.txt the
# rule's answer, tiles.txt the flag the l8 rows ran with (COLUMNS_BY_ROW_TILES = True, set by sed on the machine);
# l8/: .gpu/callS.sh PART=l8, below. profiles_mb4/: two calls later on the same warm machine:
#   sed -i 's/^COLUMNS_BY_ROW_TILES = False/COLUMNS_BY_ROW_TILES = True/' moe_tune/kernels/fp8_grouped.py
#   python -m moe_tune.bench experiment=qwen3_30b_a3b_1gpu train.precision=bf16 kernels.compile=true \
#     train.micro_batch_size=4 train.profile=true --nproc 1 --baselines none \
#     --variants 'fp8_tiles:kernels.experts=grouped_mm_fp8;bf16:kernels.experts=grouped_mm' --timeout-s 140 --out /tmp/prof
# (the Chrome traces are left out: 12 MB each).

# ---- .gpu/callS.sh
#!/usr/bin/env bash
# 1 x H200, issue 36. PART (any of, in order): cols = benchmarks/fp8_group_columns.py (both column quantizations,
# checked equal, timed); l8 = the 8-layer workload compiled, bf16 against grouped_mm_fp8 at MBS (default "4 1");
# l8tiles = the grouped_mm_fp8 rows again with fp8_grouped.COLUMNS_BY_ROW_TILES=True (run last).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export MOE_TUNE_COMMIT=${COMMIT:-wip}
R=$OUT/r; mkdir -p $R
t0=$(date +%s); el() { echo "[$(( $(date +%s)-t0 )) s] $*"; }
save() { (cd $OUT && tar czf "r_${PART// /_}.tgz" --exclude='*/checkpoints' --exclude='*.pt' --exclude='*trace*' r); }
python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/base/*.whl > /dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv > $R/gpu.txt
export PYTHONPATH=/tmp/site:$(pwd)
cols() {
  (cd benchmarks && python fp8_group_columns.py $R/cols 1 3) > $R/cols.log 2>&1; echo "rc=$?" >> $R/cols.log
  el cols; cat $R/cols.log | cut -c1-150; save
}
l8() {
  OUT=$R/l8 PART=speed MBS="${MBS:-4 1}" MB24=none TIMEOUT=110 bash benchmarks/fp8_experts_compiled_h200.sh > $R/l8.log 2>&1
  el l8; grep "bench\] [0-9]" $R/l8.log | grep -v running | tail -4; save
}
l8tiles() {
  sed -i 's/^COLUMNS_BY_ROW_TILES = False/COLUMNS_BY_ROW_TILES = True/' moe_tune/kernels/fp8_grouped.py
  grep "^COLUMNS_BY_ROW_TILES" moe_tune/kernels/fp8_grouped.py > $R/tiles.txt
  for mb in ${MBS:-4 1}; do
    python -m moe_tune.bench experiment=qwen3_30b_a3b_1gpu train.precision=bf16 kernels.compile=true \
      train.micro_batch_size=$mb --nproc 1 --baselines none --variants "fp8_tiles:kernels.experts=grouped_mm_fp8" \
      --timeout-s 110 --out $R/l8tiles_mb$mb > $R/l8tiles_mb$mb.log 2>&1
    grep "bench\] [0-9]" $R/l8tiles_mb$mb.log | grep -v running | tail -1
  done
  el l8tiles; save
  git checkout moe_tune/kernels/fp8_grouped.py 2>/dev/null
}
export -f cols l8 l8tiles el save; export R t0 PART
timeout ${LIMIT:-570} bash -c "for p in $PART; do \$p; done"
save; rm -rf $R; ls -la $OUT

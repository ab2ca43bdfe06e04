# 1 x H100 (device tool, no kind named: an H100 came), commit 0aadc2d, carry .gpu/base .gpu/uns and the three scripts
# below as .gpu/callOne.sh, .gpu/callS.sh, .gpu/callQ.sh:
#   COMMIT=0aadc2d bash .gpu/callOne.sh
# This folder holds its issue 34 part (speed_bnb4/: PART=bases BASES_BL=bnb4 BASES_ARGS=train.steps=12) and the next
# call on the same warm machine (losses/: .gpu/callL.sh, below, with LIMIT=420).

# ---- .gpu/callOne.sh
#!/usr/bin/env bash
# Both issues' owed H200 rows in one call (about 470 s). Issue 36: the column kernels timed and checked equal
# (cols); where the row tiles win at every weight-gradient operand of micro-batch 3, COLUMNS_BY_ROW_TILES=True for
# the 8-layer rows (l8: bf16 against grouped_mm_fp8, micro-batch 4 and 1). Issue 34: the bases beside bitsandbytes'.
# carry: .gpu/base .gpu/uns .gpu/callS.sh .gpu/callQ.sh .gpu/callOne.sh; needs_h200. COMMIT=<sha> bash .gpu/callOne.sh
set -u
export MOE_TUNE_COMMIT=${COMMIT:-wip} NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p $OUT/r && python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/base/*.whl > /dev/null 2>&1
(cd benchmarks && PYTHONPATH=/tmp/site:$(cd .. && pwd) timeout 120 python fp8_group_columns.py $OUT/r/cols 1 3) \
  > $OUT/cols.log 2>&1; echo "rc=$?" >> $OUT/cols.log; cut -c1-150 $OUT/cols.log
python3 - "$OUT/r/cols/fp8_group_columns.json" > $OUT/tiles_decision.txt 2>&1 <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
wg = [r for r in rows if r["micro_batch"] == 3 and r["case"].startswith("weight grad")]
win = all(r["equal"] for r in rows) and wg and all(r["by_row_tiles"]["ms"] < r["per_group"]["ms"] for r in wg)
print("tiles" if win else "per_group")
PY
cat $OUT/tiles_decision.txt
if [ "$(tail -1 $OUT/tiles_decision.txt)" = tiles ]; then
  sed -i 's/^COLUMNS_BY_ROW_TILES = False/COLUMNS_BY_ROW_TILES = True/' moe_tune/kernels/fp8_grouped.py
fi
grep "^COLUMNS_BY_ROW_TILES" moe_tune/kernels/fp8_grouped.py | tee $OUT/tiles.txt
PART="l8" LIMIT=${LIMIT_S:-250} bash .gpu/callS.sh 2>&1 | grep -v "^total\|^d\|^-" | tail -8
git checkout moe_tune/kernels/fp8_grouped.py 2>/dev/null
PART=bases SKIP_GEMMS=1 BASES_BL=bnb4 BASES_ARGS="train.steps=12" LIMIT=${LIMIT_Q:-235} bash .gpu/callQ.sh 2>&1 | tail -8
ls -la $OUT

# ---- .gpu/callQ.sh
#!/usr/bin/env bash
# 1 x H200, issue 34. PART=bases: quantized_base_gemms.py (every expert GEMM and piece, NF4's two dequantize
# stores), then the bf16, fp8 and nf4 bases (bf16 adapters on the quantized ones) over 30 steps, medians of steps
# 11-30, with train.profile=true and the GPU's clocks logged every second (the fp8 base's 0.58x at b5cd2fd).
# PART=unsloth: Unsloth's 48-layer QLoRA row.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export MOE_TUNE_COMMIT=${COMMIT:-wip}
R=$OUT/r; mkdir -p $R
save() { (cd $OUT && tar czf "r_${PART// /_}.tgz" --exclude='*/checkpoints' --exclude='*.pt' --exclude='*trace*' --exclude='profile_rank*.json' r); }
t0=$(date +%s); el() { echo "[$(( $(date +%s)-t0 )) s] $*"; }
python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/base/*.whl > /dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv > $R/gpu.txt
export PYTHONPATH=/tmp/site:$(pwd)
bases() {
  if [ "${JOINED:-0}" = 1 ] && grep -q "^rc=0" $R/nf4_gpu_tests.txt 2>/dev/null; then
    sed -i 's/^DEQUANT_JOINED = False/DEQUANT_JOINED = True/' moe_tune/kernels/nf4_frozen.py
  fi
  grep "^DEQUANT_JOINED" moe_tune/kernels/nf4_frozen.py | tee $R/joined.txt
  [ -z "${SKIP_GEMMS:-}" ] && gemms
  if [ "${BASES_BL:-none}" = bnb4 ]; then
    mkdir -p /tmp/uns_site /tmp/bnb && tar xzf .gpu/uns/uns_site.tgz -C /tmp/uns_site
    ln -sf /tmp/uns_site/bitsandbytes /tmp/bnb/ && ln -sf /tmp/uns_site/bitsandbytes-0.50.2.dist-info /tmp/bnb/
  fi
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu \
    --format=csv -l 1 > $R/clocks.csv 2>&1 &
  smi=$!
  V='lora_bf16_base:;lora_fp8_base_bf16:peft.quantize_base=fp8,train.precision=bf16'
  V+=';lora_nf4_base_bf16:peft.quantize_base=nf4,train.precision=bf16'
  [ -n "${BASES_V:-}" ] && V="$BASES_V"
  PYTHONPATH=/tmp/bnb:$PYTHONPATH VARIANTS="$V" OUT=$R TIMEOUT=150 PART=speed BASELINES=${BASES_BL:-none} \
    bash benchmarks/quantized_base_h200.sh \
    ${BASES_ARGS:-train.steps=30 train.warmup_steps_excluded=10 train.profile=true} > $R/bases.log 2>&1
  kill $smi
  el bases; grep "bench\] [0-9]" $R/bases.log | grep -v running | tail -4; save
}
nf4old() {  # the nf4 row as at 3ed0131: two stores, the input gradient dequantizing again under full checkpointing
  sed -i 's/^DEQUANT_JOINED = True/DEQUANT_JOINED = False/' moe_tune/kernels/nf4_frozen.py
  sed -i 's/                    module.recomputed = True/                    pass/' moe_tune/distributed/activation_checkpoint.py
  grep -c "module.recomputed = True" moe_tune/distributed/activation_checkpoint.py > $R/nf4old_check.txt
  VARIANTS='lora_nf4_base_bf16_old:peft.quantize_base=nf4,train.precision=bf16' OUT=$R/old TIMEOUT=150 PART=speed \
    BASELINES=none bash benchmarks/quantized_base_h200.sh train.steps=30 train.warmup_steps_excluded=10 > $R/nf4old.log 2>&1
  el nf4old; grep "bench\] [0-9]" $R/nf4old.log | grep -v running | tail -2; save
  git checkout moe_tune/kernels/nf4_frozen.py moe_tune/distributed/activation_checkpoint.py 2>/dev/null
}
gemms() {
  python benchmarks/quantized_base_gemms.py $R/gemms > $R/gemms.log 2>&1
  el gemms; grep -iE "nf4 dequantize|fp8|total" $R/gemms.log | tail -14 | cut -c1-160; save
}
unsloth() {
  mkdir -p /tmp/uns_site && tar xzf .gpu/uns/uns_site.tgz -C /tmp/uns_site
  timeout 400 python benchmarks/unsloth_qlora.py --site /tmp/uns_site --layers 48 --steps 12 --out $R/unsloth_48l.json \
    > $R/unsloth_48l.txt 2>&1
  grep -v "it/s\]" $R/unsloth_48l.txt | tail -12 | cut -c1-300; el unsloth; save
  rm -rf /dev/shm/qwen3_moe_*
}
nf4t() {
  timeout 120 python -m pytest -q -m gpu -p no:cacheprovider -o addopts="" tests/kernels/test_nf4_frozen.py \
    tests/kernels/test_fp8_frozen.py tests/kernels/test_frozen_gemm.py > $R/nf4_gpu_tests.txt 2>&1
  echo "rc=$?" >> $R/nf4_gpu_tests.txt; tail -4 $R/nf4_gpu_tests.txt; el nf4t; save
}
export -f nf4t bases gemms unsloth nf4old el save; export R t0 PART
timeout ${LIMIT:-570} bash -c "for p in $PART; do \$p; done"
pkill -f 'nvidia-smi --query' 2>/dev/null; rm -rf /dev/shm/qwen3_moe_*
save; rm -rf $R; ls -la $OUT

# ---- .gpu/callL.sh
#!/usr/bin/env bash
# 1 x H200, issue 34: 100-step losses of the bf16, fp8 and nf4 bases (bf16 adapters on the quantized ones) on the
# built-in chat records, one moe-tune-bench run. carry: .gpu/base .gpu/callL.sh. COMMIT=<sha> bash .gpu/callL.sh
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export MOE_TUNE_COMMIT=${COMMIT:-wip}
python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/base/*.whl > /dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv > $OUT/gpu.txt
export PYTHONPATH=/tmp/site:$(pwd)
V='lora_bf16_base:;lora_fp8_base_bf16:peft.quantize_base=fp8,train.precision=bf16'
V+=';lora_nf4_base_bf16:peft.quantize_base=nf4,train.precision=bf16'
VARIANTS="$V" TIMEOUT=175 OUT=$OUT PART=losses timeout ${LIMIT:-570} bash benchmarks/quantized_base_h200.sh \
  > $OUT/losses.log 2>&1
echo "rc=$?" >> $OUT/losses.log
rm -rf $OUT/losses/runs/*/*/checkpoints; find $OUT -name '*.pt' -delete
grep "bench\] [0-9]" $OUT/losses.log | grep -v running | tail -4; tail -3 $OUT/losses.log; cat $OUT/losses/*.md 2>/dev/null | grep "^| lora"

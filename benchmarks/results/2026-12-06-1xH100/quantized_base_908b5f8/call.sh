#!/usr/bin/env bash
# 1 x H200, issue 34. PART=bases: quantized_base_gemms.py (every expert GEMM and piece, NF4's two dequantize
# stores), then the bf16, fp8 and nf4 bases (bf16 adapters on the quantized ones) over 30 steps, medians of steps
# 11-30, with train.profile=true and the GPU's clocks logged every second (the fp8 base's 0.58x at b5cd2fd).
# PART=unsloth: Unsloth's 48-layer QLoRA row.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export MOE_TUNE_COMMIT=${COMMIT:-wip}
R=$OUT/r; mkdir -p $R
save() { (cd $OUT && tar czf r_$PART.tgz --exclude='*/checkpoints' --exclude='*.pt' r); }
t0=$(date +%s); el() { echo "[$(( $(date +%s)-t0 )) s] $*"; }
python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/base/*.whl > /dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv > $R/gpu_$PART.txt
export PYTHONPATH=/tmp/site:$(pwd)
bases() {
  python benchmarks/quantized_base_gemms.py $R/gemms > $R/gemms.log 2>&1
  el gemms; grep -iE "nf4 dequantize|fp8|total" $R/gemms.log | tail -14 | cut -c1-160; save
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu \
    --format=csv -l 1 > $R/clocks.csv 2>&1 &
  smi=$!
  V='lora_bf16_base:;lora_fp8_base_bf16:peft.quantize_base=fp8,train.precision=bf16'
  V+=';lora_nf4_base_bf16:peft.quantize_base=nf4,train.precision=bf16'
  VARIANTS="$V" OUT=$R TIMEOUT=150 PART=speed BASELINES=none bash benchmarks/quantized_base_h200.sh \
    train.steps=30 train.warmup_steps_excluded=10 train.profile=true > $R/bases.log 2>&1
  kill $smi
  el bases; grep "bench\] [0-9]" $R/bases.log | grep -v running | tail -4; save
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
export -f bases gemms unsloth el save; export R t0 PART
timeout ${LIMIT:-570} bash -c $PART
pkill -f 'nvidia-smi --query' 2>/dev/null; rm -rf /dev/shm/qwen3_moe_*
save; rm -rf $R; ls -la $OUT

export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
pip install -q --no-deps --target /tmp/site .gpu/base/*.whl >/dev/null 2>&1
mkdir -p /tmp/uns_site && tar xzf .gpu/uns/uns_site.tgz -C /tmp/uns_site
mkdir -p /tmp/bnb && ln -sf /tmp/uns_site/bitsandbytes /tmp/bnb/ && ln -sf /tmp/uns_site/bitsandbytes-0.50.2.dist-info /tmp/bnb/
export MOE_TUNE_COMMIT=${COMMIT:-wip}
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv > $R/gpu.txt
work() {
  t0=$(date +%s)
  PYTHONPATH=/tmp/site:$(pwd) OUT=$R/fp8_24l PART=speed MBS=" " MB24=3 TIMEOUT=140 bash benchmarks/fp8_experts_compiled_h200.sh > $R/fp8_24l.log 2>&1
  grep "\[bench\]" $R/fp8_24l.log | tail -4; echo "fp8 24l $(( $(date +%s)-t0 ))s"
  V='lora_bf16_base:;lora_fp8_base_bf16:peft.quantize_base=fp8,train.precision=bf16'
  V+=';lora_nf4_base_bf16:peft.quantize_base=nf4,train.precision=bf16'
  PYTHONPATH=/tmp/site:/tmp/bnb:$(pwd) VARIANTS="$V" OUT=$R/q TIMEOUT=120 PART=speed BASELINES=bnb4 bash benchmarks/quantized_base_h200.sh > $R/q_speed.log 2>&1
  grep "\[bench\]" $R/q_speed.log | tail -8; echo "speed $(( $(date +%s)-t0 ))s"
  rm -rf /dev/shm/qwen3_moe_*
}
export -f work; export R
timeout 470 bash -c work
rm -rf /dev/shm/qwen3_moe_*
cd $OUT && find r -name "*.pt" -delete; tar czf results.tgz --exclude='*/checkpoints' r && rm -rf r && ls -la

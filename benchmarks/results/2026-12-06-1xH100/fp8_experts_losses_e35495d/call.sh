export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
pip install -q --no-deps --target /tmp/site .gpu/base/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$(pwd) MOE_TUNE_COMMIT=${COMMIT:-wip}
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv > $R/gpu.txt
work() {
  t0=$(date +%s)
  OUT=$R/fp8_losses PART=losses TIMEOUT=110 bash benchmarks/fp8_experts_compiled_h200.sh > $R/fp8_losses.log 2>&1
  grep "\[bench\]" $R/fp8_losses.log | tail -4; echo "losses $(( $(date +%s)-t0 ))s"
}
export -f work; export R
timeout 250 bash -c work
cd $OUT && find r -name "*.pt" -delete; tar czf results.tgz --exclude='*/checkpoints' r && rm -rf r && ls -la

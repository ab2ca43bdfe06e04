export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
pip install -q --no-deps --target /tmp/site .gpu/base/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$(pwd) MOE_TUNE_COMMIT=${COMMIT:-wip}
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv > $R/gpu.txt
work() {
  t0=$(date +%s)
  OUT=$R/check PART=check timeout 220 bash benchmarks/small_step_h200.sh > $R/check.log 2>&1; tail -6 $R/check.log | cut -c1-300
  echo "check $(( $(date +%s)-t0 ))s"
  OUT=$R/speed PART=speed MBS="1 4" TIMEOUT=130 bash benchmarks/small_step_h200.sh > $R/speed.log 2>&1
  grep "\[bench\]" $R/speed.log | tail -8; echo "speed $(( $(date +%s)-t0 ))s"
}
export -f work; export R
timeout 575 bash -c work
cd $OUT && find r -name "*.pt" -delete; tar czf results.tgz --exclude='*/checkpoints' r && rm -rf r && ls -la

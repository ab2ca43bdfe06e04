# run (device tool, one H200, carry .gpu/base .gpu/nemo): COMMIT=5f0532b PART="nf4t three" LIMIT=575 bash call.sh
#!/usr/bin/env bash
# 1 x H200: issue 36's 24-layer rows. PART=three: the three stacks in one moe-tune-bench run (workload micro-batch 2,
# NeMo's best; moe_tune bf16 and grouped_mm_fp8 compiled at micro-batch 3). PART=losses: the 100-step losses at 24
# layers, micro-batch 3, bf16 against FP8, with train.profile=true.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export MOE_TUNE_COMMIT=${COMMIT:-wip}
R=$OUT/r; mkdir -p $R
save() { (cd $OUT && tar czf "r_${PART// /_}.tgz" --exclude='*/checkpoints' --exclude='*.pt' --exclude='*trace*' --exclude='profile_rank*.json' r); }
t0=$(date +%s); el() { echo "[$(( $(date +%s)-t0 )) s] $*"; }
python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/base/*.whl > /dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv > $R/gpu.txt
export PYTHONPATH=/tmp/site:$(pwd)
three() {
  python3 -m pip install -q --no-index --no-deps --target /tmp/nemo_site .gpu/nemo/*.whl > /dev/null 2>&1
  W="experiment=qwen3_30b_a3b_1gpu model.overrides.num_hidden_layers=24 train.precision=bf16 optim.stochastic_rounding=true train.micro_batch_size=2"
  V="bf16_grouped_mm_mb3:kernels.compile=true,train.micro_batch_size=3"
  V="$V;fp8_grouped_mm_mb3:kernels.compile=true,train.micro_batch_size=3,kernels.experts=grouped_mm_fp8"
  python -m moe_tune.bench $W --nproc 1 --baselines grouped_mm_nofsdp --peer automodel --peer-pythonpath /tmp/nemo_site \
    --variants "$V" --timeout-s 300 --out $R/l24_three > $R/l24_three.log 2>&1
  el three; grep "bench\] [0-9]" $R/l24_three.log | grep -v running | tail -6; save
}
losses() {
  OUT=$R/l24_losses PART=losses TIMEOUT=240 bash benchmarks/fp8_experts_compiled_h200.sh \
    model.overrides.num_hidden_layers=24 train.micro_batch_size=3 optim.stochastic_rounding=true train.profile=true \
    > $R/l24_losses.log 2>&1
  el losses; grep "bench\] [0-9]" $R/l24_losses.log | grep -v running | tail -4; save
}
nf4t() {
  timeout 120 python -m pytest -q -m gpu -p no:cacheprovider -o addopts="" tests/kernels/test_nf4_frozen.py \
    tests/kernels/test_fp8_frozen.py tests/kernels/test_frozen_gemm.py > $R/nf4_gpu_tests.txt 2>&1
  echo "rc=$?" >> $R/nf4_gpu_tests.txt; tail -4 $R/nf4_gpu_tests.txt; el nf4t; save
}
export -f nf4t three losses el save; export R t0 PART
timeout ${LIMIT:-570} bash -c "for p in $PART; do \$p; done"
nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv > $R/smi.txt
save; rm -rf $R; ls -la $OUT

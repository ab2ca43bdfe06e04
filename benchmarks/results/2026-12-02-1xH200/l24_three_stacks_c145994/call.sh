#!/usr/bin/env bash
# 1 x H200 at c145994: issue 14's 24-layer workload (Qwen3-30B-A3B shapes, 24 layers, seq 4096, bf16 parameters
# with stochastic rounding in every row, real routing), the three stacks in one moe-tune-bench run at micro-batch
# MB (2: NeMo's best micro-batch, moe_tune at 2 and 3; 1: Transformers' best); then the one-rank test on this box.
set -u
MB=${MB:?}
R=$OUT/r; mkdir -p $R
save() { (cd $OUT && tar czf r.tgz r); }
t0=$(date +%s); el() { echo "[$(( $(date +%s)-t0 )) s] $*"; }
python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/base/*.whl > /dev/null 2>&1
python3 -m pip install -q --no-index --no-deps --target /tmp/nemo_site .gpu/nemo/*.whl > /dev/null 2>&1
cd .gpu/new
export PYTHONPATH=/tmp/site MOE_TUNE_COMMIT=c145994
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
W="experiment=qwen3_30b_a3b_1gpu model.overrides.num_hidden_layers=24 train.precision=bf16 optim.stochastic_rounding=true train.micro_batch_size=$MB"
V="moe_tune_mb$MB:kernels.compile=true"
[ "$MB" = 2 ] && V="$V;moe_tune_mb3:kernels.compile=true,train.micro_batch_size=3"
python -m moe_tune.bench $W --nproc 1 --baselines grouped_mm_nofsdp --peer automodel --peer-pythonpath /tmp/nemo_site \
  --variants "$V" --timeout-s 300 --out $R/l24_mb$MB > $R/l24_mb$MB.log 2>&1
el l24; grep "bench\] [0-9]" $R/l24_mb$MB.log | grep -v running; save
PYTHONPATH=$(pwd):/tmp/site timeout 60 python -m pytest -q -p no:cacheprovider \
  tests/parallel/test_parallel_model.py::test_world_size_one_same_code_path > $R/one_rank_test.log 2>&1
el "one-rank test: $(tail -1 $R/one_rank_test.log)"
nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv > $R/smi.txt; save

#!/usr/bin/env bash
# 1 x H200 at 3febf3c: the loss's weight-gradient accumulation and chunk size (exploration); the gloo tests with
# the GPU visible (harness hides GPUs from gloo ranks since 7ea4d13); the GPU suite.
set -u
R=$OUT/r; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/base/*.whl > /dev/null 2>&1
cp .gpu/calls/loss_variants.py /tmp/
cd .gpu/new
export PYTHONPATH=$(pwd):/tmp/site MOE_TUNE_COMMIT=3febf3c
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,memory.used --format=csv > $R/smi.txt
timeout 240 python /tmp/loss_variants.py $R/loss_variants.json > $R/loss_variants.log 2>&1; echo "loss variants rc=$?"
timeout 120 python -m pytest -q -p no:cacheprovider tests/optim/test_adamw.py -k fsdp2_sharded > $R/fsdp2.log 2>&1
echo "fsdp2 gloo (GPU visible): $(tail -1 $R/fsdp2.log)"
timeout 200 python -m pytest -q -p no:cacheprovider -m dist tests/parallel > $R/dist_parallel.log 2>&1
echo "tests/parallel -m dist: $(tail -1 $R/dist_parallel.log)"
timeout 150 python -m pytest -q -p no:cacheprovider -m gpu tests > $R/gpu_suite.log 2>&1
echo "gpu suite: $(tail -1 $R/gpu_suite.log)"
cd $OUT && tar czf r.tgz r && rm -rf r
tar xzf $OUT/r.tgz -C /tmp && cat /tmp/r/loss_variants.log | tail -30

#!/usr/bin/env bash
# 1 x H200 at a8fd150: the GPU suite after the session's fixes (model building, checkpoints, CLI), and the CPU
# suite's dist tests of tests/parallel with the GPU visible.
set -u
R=$OUT/r; mkdir -p $R
save() { (cd $OUT && tar czf r.tgz r); }
python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/base/*.whl > /dev/null 2>&1
cd .gpu/new
export PYTHONPATH=$(pwd):/tmp/site MOE_TUNE_COMMIT=a8fd150
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
timeout 200 python -m pytest -q -p no:cacheprovider -m gpu tests > $R/gpu_suite.log 2>&1
echo "gpu suite: $(tail -1 $R/gpu_suite.log)"; save
timeout 200 python -m pytest -q -p no:cacheprovider -m dist tests/parallel > $R/dist_parallel.log 2>&1
echo "tests/parallel -m dist: $(tail -1 $R/dist_parallel.log)"; save

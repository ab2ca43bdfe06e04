#!/usr/bin/env bash
# The house reorganisation (issue 37) against the commit before it, on one H200: the GPU tests, then the headline
# workload (Qwen3-30B-A3B shapes, 8 layers, seq 4096, bf16, micro-batch 4, compiled, real routing) through both
# trees, rows interleaved old, new, old, new. Run on the device from a clean export of the new commit (.clean) with
# the old commit's tree at .gpu/old (git archive 3e9656f) and the wheels of ../shared/gpu/prepare.sh base in .gpu/base.
set -e
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/base/*.whl .gpu/trl/*.whl
export PYTHONPATH=/tmp/site
cd .clean
python -m pytest -q -p no:cacheprovider -m gpu tests > "$OUT/gpu_tests.txt" 2>&1
OLD=$PWD/../.gpu/old OLD_COMMIT=3e9656f NEW_COMMIT=${NEW_COMMIT:?} NPROC=1 EXPERIMENT=qwen3_30b_a3b_1gpu MB=4 REPEATS=2 \
  BASELINE=none TIMEOUT=200 OUT=/tmp/against bash benchmarks/against_commit_h200.sh

#!/usr/bin/env bash
# 1 x H200 at 80f4ce0: the fused loss's Triton kernel. GPU tests of the loss, the loss alone (kernel vs PyTorch
# ops), then whole 8-layer runs against b36eccb (rows interleaved old/new), micro-batch 4 and 1, compiled.
set -u
R=$OUT/r; mkdir -p $R
save() { (cd $OUT && tar czf r.tgz r); }
t0=$(date +%s); el() { echo "[$(( $(date +%s)-t0 )) s] $*"; }
python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/base/*.whl > /dev/null 2>&1
ROOT=$(pwd)
cd .gpu/new
export PYTHONPATH=$(pwd):/tmp/site MOE_TUNE_COMMIT=80f4ce0
python -m pytest -q -p no:cacheprovider tests/kernels/test_loss.py tests/optim > $R/gpu-tests.log 2>&1; el tests; tail -3 $R/gpu-tests.log
python benchmarks/loss_kernel_h200.py --out $R/loss_kernel > $R/loss_kernel.log 2>&1; el micro; tail -6 $R/loss_kernel.log; save
for MB in 4 1; do
  OLD=$ROOT/.gpu/old OLD_COMMIT=b36eccb NEW_COMMIT=80f4ce0 OUT=$R/against_b36eccb_mb$MB NPROC=1 \
    EXPERIMENT=qwen3_30b_a3b_1gpu MB=$MB BASELINE=none REPEATS=2 bash benchmarks/against_commit_h200.sh \
    > $R/against_mb$MB.log 2>&1
  el mb$MB; tail -5 $R/against_mb$MB.log; save
done

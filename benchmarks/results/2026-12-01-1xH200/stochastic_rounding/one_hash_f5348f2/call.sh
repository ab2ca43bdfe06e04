#!/usr/bin/env bash
# 1 x H200: the stochastic-rounding kernel with one hash per element: block/warps sweep; the whole GPU suite.
set -u
R=$OUT/r; mkdir -p $R
save() { (cd $OUT && tar czf r.tgz r); }
t0=$(date +%s); el() { echo "[$(( $(date +%s)-t0 )) s] $*"; }
timeout 150 python -m pytest -q -m gpu -p no:cacheprovider tests/optim > $R/gpu-tests-optim.log 2>&1; el tests; tail -1 $R/gpu-tests-optim.log; save
timeout 150 python .gpu/calls/sr_sweep.py > $R/sr_sweep.md 2>&1; el sweep; cat $R/sr_sweep.md; save
timeout 300 python -m pytest -q -m gpu -p no:cacheprovider -rs tests > $R/gpu-tests.log 2>&1; el all-tests; tail -25 $R/gpu-tests.log; save

#!/usr/bin/env bash
# 1 x H200 at 0c2c855: is the FSDP2 gloo test's SIGSEGV on this machine (torch 2.11) deterministic? Three runs, and
# the neighbouring gloo tests once.
set -u
R=$OUT/r; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/base/*.whl > /dev/null 2>&1
cd .gpu/new
export PYTHONPATH=$(pwd):/tmp/site MOE_TUNE_COMMIT=0c2c855
for i in 1 2 3; do
  timeout 120 python -m pytest -q -p no:cacheprovider tests/optim/test_adamw.py -k fsdp2_sharded > $R/fsdp2_$i.log 2>&1
  echo "run $i: $(tail -1 $R/fsdp2_$i.log)"
done
CUDA_VISIBLE_DEVICES= timeout 120 python -m pytest -q -p no:cacheprovider tests/optim/test_adamw.py -k fsdp2_sharded > $R/fsdp2_nocuda.log 2>&1
echo "no CUDA visible: $(tail -1 $R/fsdp2_nocuda.log)"
timeout 200 python -m pytest -q -p no:cacheprovider -m dist tests/parallel > $R/dist_parallel.log 2>&1
echo "tests/parallel -m dist: $(tail -1 $R/dist_parallel.log)"
grep -h "Fatal\|Segmentation\|SIGSEGV" $R/*.log | head -5

export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
pip install -q --no-deps --target /tmp/site .gpu/base/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$(pwd) MOE_TUNE_COMMIT=${COMMIT:-wip}
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt
python -c "import torch, transformers, peft; print(torch.__version__, transformers.__version__, peft.__version__)" >> $R/gpu.txt
timeout ${LIMIT:-400} python -m pytest -q -m gpu -p no:cacheprovider -o addopts="" tests --durations=10 > $R/gpu_tests.txt 2>&1
echo "rc=$?" >> $R/gpu_tests.txt
tail -25 $R/gpu_tests.txt
cat $R/gpu.txt
# torchrun's agent killed with SIGKILL under NCCL on one GPU: does the rank save and exit?
R=$1; run=$R/killrun; rm -rf $run
python -m torch.distributed.run --standalone --nproc-per-node 1 -m moe_tune output_dir=$run train.steps=100000 checkpoint.export_hf=false > $R/kill_agent.log 2>&1 &
agent=$!
for i in $(seq 1 240); do [ -f $run/metrics.jsonl ] && [ $(wc -l < $run/metrics.jsonl) -ge 2 ] && break; sleep 0.5; done
ranks=$(cat /proc/$agent/task/$agent/children); kill -9 $agent
for i in $(seq 1 120); do alive=0; for p in $ranks; do [ -d /proc/$p ] && ! grep -q '^State:.*Z' /proc/$p/status && alive=1; done; [ $alive = 0 ] && break; sleep 1; done
echo "kill_agent: ranks=$ranks alive_after=${alive} waited=${i}s complete=$(ls $run/checkpoints/*/COMPLETE 2>/dev/null | wc -l)" | tee -a $R/kill_agent.log
for p in $ranks; do kill -9 $p 2>/dev/null; done
grep -E "launcher|stopped by|Traceback|Error" $R/kill_agent.log | head -5

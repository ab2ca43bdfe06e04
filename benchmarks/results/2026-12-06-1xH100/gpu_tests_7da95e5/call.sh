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

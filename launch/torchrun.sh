#!/bin/bash
# moe_tune on one node, one rank per GPU (all of them, or NPROC_PER_NODE), through `python -m moe_tune.launch`:
# torchrun that exits 128 + the signal when stopped (the ranks saved a checkpoint) and with the first failed
# rank's own exit code otherwise (2: a value to fix). Every argument is a Hydra override.
#
#   launch/torchrun.sh model=hf model.path=/ckpt/Qwen3-30B-A3B parallel.ep=8 train.steps=1000 output_dir=runs/qwen3
#   NPROC_PER_NODE=2 launch/torchrun.sh parallel.ep=2          # CPU: 2 ranks on gloo
set -euo pipefail

if [[ -z ${NPROC_PER_NODE:-} ]]; then
  NPROC_PER_NODE=$(nvidia-smi --list-gpus 2>/dev/null | grep -c "^GPU" || true)
  NPROC_PER_NODE=$((NPROC_PER_NODE > 0 ? NPROC_PER_NODE : 1))
fi
# Each rank gets its share of the cores for its CPU threads (data loading, the optimizer's host work).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(($(nproc) / NPROC_PER_NODE > 0 ? $(nproc) / NPROC_PER_NODE : 1))}
# A collective that fails or times out on one rank takes that rank down (torchrun then stops the others) instead of
# leaving the job hanging until Slurm's time limit.
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
# comm=symm_mem without NVLink multicast, as moe-tune-env probes it (NVSHMEM's multicast needs fabric-manager support).
export NVSHMEM_DISABLE_NVLS=${NVSHMEM_DISABLE_NVLS:-1}

exec python -m moe_tune.launch --standalone --nproc-per-node "$NPROC_PER_NODE" "$@"

#!/usr/bin/env bash
# Issue 14's rows on 2 x H200, in two calls of under 10 minutes each:
#   PART=1: moe-tune-env, and the three stacks at micro-batch 4 and 1 (EP=2 + FSDP2, bf16 parameters; moe_tune
#           all_to_all compiled, with and without comm.overlap, and deepep compiled where DeepEP is importable;
#           NeMo AutoModel with its torch dispatcher).
#   PART=2: moe_tune with fp32 master weights at micro-batch 1; profiles of moe_tune at micro-batch 1 and 4 (GPU
#           busy, exposed all-to-all).
#   PART=4: the 24-layer workload (bf16 + stochastic rounding in every row) against Transformers + FSDP2 and NeMo,
#           moe_tune at micro-batch 2 and 4 (one H200 fit 2, without activation checkpointing; EP=2 halves the
#           experts' 116 GiB of weights and optimizer state per GPU). NeMo's row took ~4 minutes to set up on one
#           H200, hence its own run with a longer timeout.
# NeMo's DeepEP row also needs TransformerEngine and DeepEP (three_stacks_h200.sh with PEER_DEEPEP=1, later call).
#   PART=3: comm.dedup (one row per token and ep rank) against one row per routed expert: the NCCL contract test,
#           then the three stacks at micro-batch 4 and 1 with comm.dedup false (the default) and true, and at
#           micro-batch 1 dedup with parallel.reshard_after_forward=false (no backward all-gather of the dense layers).
#   NEMO_SITE=<dir with nemo_automodel> OUT=<results directory> PART=1|2|3|4 bash benchmarks/issue14_2xh200.sh
set -euo pipefail
OUT=${OUT:?OUT=<results directory>}
NEMO_SITE=${NEMO_SITE:?NEMO_SITE=<directory where nemo_automodel is installed>}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$(pwd):${PYTHONPATH:-}"
PART=${PART:?PART=1, 2, 3 or 4}
mkdir -p "$OUT"
if [ "$PART" = 1 ]; then
python -m moe_tune.env > "$OUT/env.txt" 2>&1 || true
VARIANTS='moe_tune_compile:kernels.compile=true;overlap_compile:kernels.compile=true,comm.overlap=true'
# moe_tune's deepep dispatcher too, where DeepEP is importable (it is built on the machine, not shipped).
if python -c 'import deep_ep' 2>/dev/null; then VARIANTS="$VARIANTS;deepep_compile:comm=deepep,kernels.compile=true"; fi
VARIANTS="$VARIANTS" \
  NEMO_SITE="$NEMO_SITE" OUT="$OUT/three_stacks" MBS="4 1" NPROC=2 TIMEOUT=200 bash benchmarks/three_stacks_h200.sh
elif [ "$PART" = 3 ]; then
timeout 150 python -m pytest -q -p no:cacheprovider tests/moe/dispatch/test_contract.py -k all_to_all_nccl \
  > "$OUT/gpu_tests.log" 2>&1 || true
tail -3 "$OUT/gpu_tests.log"
bench=(python -m moe_tune.bench experiment=qwen3_30b_a3b_ep2_fast train.precision=bf16 --nproc 2 --baselines grouped_mm
       --peer automodel --peer-pythonpath "$NEMO_SITE" --timeout-s 200)
"${bench[@]}" train.micro_batch_size=4 --out "$OUT/mb4" \
  --variants 'moe_tune_compile:kernels.compile=true;dedup_compile:kernels.compile=true,comm.dedup=true'
"${bench[@]}" train.micro_batch_size=1 --out "$OUT/mb1" --variants \
  'moe_tune_compile:kernels.compile=true;dedup_compile:kernels.compile=true,comm.dedup=true;dedup_no_reshard_compile:kernels.compile=true,comm.dedup=true,parallel.reshard_after_forward=false'
elif [ "$PART" = 4 ]; then
python -m moe_tune.bench experiment=qwen3_30b_a3b_24l_ep2 --nproc 2 --baselines grouped_mm --timeout-s 200 \
  --variants 'moe_tune_24l_mb2:;moe_tune_24l_mb4:train.micro_batch_size=4' --out "$OUT/24_layers"
python -m moe_tune.bench experiment=qwen3_30b_a3b_24l_ep2 --nproc 2 --baselines none --variants none \
  --peer automodel --peer-pythonpath "$NEMO_SITE" --timeout-s 420 --out "$OUT/24_layers_nemo"
else
python -m moe_tune.bench experiment=qwen3_30b_a3b_ep2_fast train.micro_batch_size=1 --nproc 2 --baselines grouped_mm \
  --variants 'fp32_master_compile:kernels.compile=true' --timeout-s 200 --out "$OUT/fp32_master_mb1"
for mb in 1 4; do
  torchrun --nproc-per-node 2 -m moe_tune experiment=qwen3_30b_a3b_ep2_fast train.precision=bf16 \
    train.micro_batch_size="$mb" train.steps=10 train.profile=true output_dir="/tmp/profile_mb$mb" > "$OUT/profile_mb$mb.log" 2>&1
  cp "/tmp/profile_mb$mb/profile_rank0.txt" "/tmp/profile_mb$mb/profile_rank0.json" "$OUT/" 2>/dev/null || true
  mv "$OUT/profile_rank0.json" "$OUT/profile_mb$mb.json" 2>/dev/null || true
  mv "$OUT/profile_rank0.txt" "$OUT/profile_mb$mb.txt" 2>/dev/null || true
done
fi
python benchmarks/rows_table.py "$OUT"
for mb in 1 4; do
  echo "profile mb$mb: $(cat "$OUT/profile_mb$mb.json" 2>/dev/null || echo missing)"
done

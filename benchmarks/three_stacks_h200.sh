#!/usr/bin/env bash
# The headline table: plain Transformers (+ FSDP2 on more than one GPU), NeMo AutoModel and moe_tune, one
# moe-tune-bench run per micro-batch so that the three stacks share the machine, the workload and the report.
# Qwen3-30B-A3B shapes with 8 layers (EXPERIMENT), seq 4096, bf16 parameters, real routing, 20 steps, medians of
# steps 6-20.
#   NPROC=1: experiment=qwen3_30b_a3b_1gpu; Transformers without FSDP2 (what one GPU runs); NeMo with ep=1 and its
#   torch dispatcher (its recipe wraps FSDP2 even on one GPU).
#   NPROC=2: experiment=qwen3_30b_a3b_ep2_fast (EP=2, all_to_all, compile); NeMo with ep=2, torch dispatcher, and
#   (PEER_DEEPEP=1, with DeepEP and TransformerEngine importable) its deepep dispatcher too.
#   NEMO_SITE=<dir with nemo_automodel, transformers 5.18, torchao> OUT=<results directory> MBS="4 1" \
#     NPROC=1|2 bash benchmarks/three_stacks_h200.sh [overrides...]
set -euo pipefail
OUT=${OUT:?OUT=<results directory>}
NEMO_SITE=${NEMO_SITE:?NEMO_SITE=<directory where nemo_automodel is installed>}
NPROC=${NPROC:-1}
MBS=${MBS:-4 1}
TIMEOUT=${TIMEOUT:-240}
VARIANTS=${VARIANTS:-moe_tune_compile:kernels.compile=true}
if [ "$NPROC" = 1 ]; then experiment=qwen3_30b_a3b_1gpu baseline=grouped_mm_nofsdp
else experiment=qwen3_30b_a3b_ep2_fast baseline=grouped_mm; fi
BASELINE=${BASELINE:-$baseline}
EXPERIMENT=${EXPERIMENT:-$experiment}
export PYTHONPATH="$(pwd):${PYTHONPATH:-}"
mkdir -p "$OUT"
for mb in $MBS; do
  peer=(--peer automodel --peer-pythonpath "$NEMO_SITE")
  python -m moe_tune.bench experiment="$EXPERIMENT" train.precision=bf16 train.micro_batch_size="$mb" "$@" \
    --nproc "$NPROC" --baselines "$BASELINE" "${peer[@]}" --variants "$VARIANTS" --timeout-s "$TIMEOUT" \
    --out "$OUT/mb$mb"
  if [ -n "${PEER_DEEPEP:-}" ]; then
    python -m moe_tune.bench experiment="$EXPERIMENT" train.precision=bf16 train.micro_batch_size="$mb" "$@" \
      --nproc "$NPROC" --baselines none "${peer[@]}" --peer-dispatcher deepep --variants none --timeout-s "$TIMEOUT" \
      --out "$OUT/mb${mb}_deepep"
  fi
done
python benchmarks/rows_table.py "$OUT"

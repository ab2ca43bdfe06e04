#!/usr/bin/env bash
# Issue 36, item 2 (micro-batch 1 at 300 TFLOP/s), one Hopper GPU: the committed 8-layer workload
# (experiment=qwen3_30b_a3b_1gpu: Qwen3-30B-A3B shapes, seq 4096, bf16 parameters with stochastic rounding,
# data=random, real routing), compiled, against the step's GPU-only variant optim.overlap_forward=true (the AdamW
# update on a side stream beside the next forward, layer by layer):
#   PART=check: its GPU tests (the losses, gradient norms and routing counts equal to the plain compiled step's,
#     step by step, with and without activation checkpointing).
#   PART=speed: one moe-tune-bench run per micro-batch of MBS (default "1 4"), the plain compiled row and the
#     variant; medians of steps 6-20.
#   PART=profile: train.profile=true at micro-batch 1 for both, steps 7-9: the profile tables, the Chrome traces
#     (gzipped) and `trace_summary.py --gaps 15` of each (where the GPU idles, and whether the host launched late).
#   OUT=<dir> PART=check|speed|profile [MBS="1 4"] bash benchmarks/small_step_h200.sh [overrides...]
set -euo pipefail
OUT=${OUT:?OUT=<results directory>}
PART=${PART:-speed}
MBS=${MBS:-1 4}
common=(experiment=qwen3_30b_a3b_1gpu train.precision=bf16 kernels.compile=true)
variant=optim.overlap_forward=true
export PYTHONPATH="$(pwd):${PYTHONPATH:-}"
mkdir -p "$OUT"
case $PART in
  check)
    python -m pytest -q -p no:cacheprovider tests/train/test_gpu_step_variants.py tests/optim/test_overlap.py \
      2>&1 | tee "$OUT/gpu_tests.txt" ;;
  speed)
    for mb in $MBS; do
      python -m moe_tune.bench "${common[@]}" train.micro_batch_size="$mb" "$@" --nproc 1 --baselines none \
        --variants "compiled:;overlap_forward:$variant" --timeout-s "${TIMEOUT:-240}" --out "$OUT/mb$mb"
    done ;;
  profile)
    for name in plain overlap_forward; do
      extra=()
      [[ $name == plain ]] || extra=("$variant")
      run=/tmp/small_step_profile_$name
      rm -rf "$run"
      python -m moe_tune "${common[@]}" train.micro_batch_size=1 train.steps=11 train.profile=true "${extra[@]}" \
        checkpoint.every=0 checkpoint.export_hf=false output_dir="$run" "$@" > "$OUT/profile_$name.log" 2>&1
      cp "$run/profile_rank0.txt" "$OUT/profile_mb1_$name.txt"
      python benchmarks/trace_summary.py --gaps 15 "$run/trace_rank0.json" > "$OUT/gaps_mb1_$name.json"
      gzip -c "$run/trace_rank0.json" > "$OUT/trace_mb1_$name.json.gz"
    done ;;
  *) echo "small_step_h200.sh: PART=$PART is not check, speed or profile" >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# Issue 36, item 2 (micro-batch 1 at 300 TFLOP/s), one Hopper GPU: the committed 8-layer workload
# (experiment=qwen3_30b_a3b_1gpu: Qwen3-30B-A3B shapes, seq 4096, bf16 parameters with stochastic rounding,
# data=random, real routing), compiled, with the step's two GPU-only variants:
#   kernels.cuda_graphs=true      each compiled layer replayed as CUDA graphs (no per-kernel launches)
#   optim.overlap_forward=true    the AdamW update on a side stream beside the next forward, layer by layer
#   PART=check: their GPU tests (each variant's losses, gradient norms and routing counts equal to the plain
#     compiled step's, step by step, with and without activation checkpointing).
#   PART=speed: one moe-tune-bench run per micro-batch of MBS (default "1 4"), the plain compiled row and each
#     variant alone and together; medians of steps 6-20.
#   PART=profile: train.profile=true at micro-batch 1 for the plain row and VARIANT (default both), steps 7-9: the
#     profile tables, the Chrome traces (gzipped) and `trace_summary.py --gaps 15` of each (where the GPU idles, and
#     whether the host launched late).
#   OUT=<dir> PART=check|speed|profile [MBS="1 4"] bash benchmarks/small_step_h200.sh [overrides...]
set -euo pipefail
OUT=${OUT:?OUT=<results directory>}
PART=${PART:-speed}
MBS=${MBS:-1 4}
common=(experiment=qwen3_30b_a3b_1gpu train.precision=bf16 kernels.compile=true)
# Each variant's overrides, comma-separated: the speed rows' variants and the profile's VARIANT.
declare -A OVERRIDES=([cuda_graphs]=kernels.cuda_graphs=true [overlap_forward]=optim.overlap_forward=true
  [both]=kernels.cuda_graphs=true,optim.overlap_forward=true)
variants='compiled:'
for name in cuda_graphs overlap_forward both; do variants+=";$name:${OVERRIDES[$name]}"; done
export PYTHONPATH="$(pwd):${PYTHONPATH:-}"
mkdir -p "$OUT"
case $PART in
  check)
    python -m pytest -q -p no:cacheprovider tests/train/test_gpu_step_variants.py tests/optim/test_overlap.py \
      2>&1 | tee "$OUT/gpu_tests.txt" ;;
  speed)
    for mb in $MBS; do
      python -m moe_tune.bench "${common[@]}" train.micro_batch_size="$mb" "$@" --nproc 1 --baselines none \
        --variants "${VARIANTS:-$variants}" --timeout-s "${TIMEOUT:-240}" --out "$OUT/mb$mb"
    done ;;
  profile)
    name=${VARIANT:-both}
    if [[ -z ${OVERRIDES[$name]:-} ]]; then
      echo "small_step_h200.sh: VARIANT=$name is not ${!OVERRIDES[*]}" >&2; exit 2
    fi
    for name in plain "$name"; do
      extra=()
      [[ $name == plain ]] || IFS=, read -ra extra <<< "${OVERRIDES[$name]}"
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

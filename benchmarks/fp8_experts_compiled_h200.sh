#!/usr/bin/env bash
# Issue 36, FP8 routed experts compiled (kernels.experts=grouped_mm_fp8 kernels.compile=true), one Hopper GPU:
#   PART=check: the FP8 experts' GPU tests (compiled == eager bit for bit under inductor and aot_eager, the kernel
#     against bf16 and the emulation, the Triton quantization) and benchmarks/fp8_compiled_grad.py (the custom ops
#     and the old autograd.Function, each compiled against eager; the pieces alone), then its --bisect of the old
#     Function's zero compiled gradient.
#   PART=speed: the committed 8-layer workload (experiment=qwen3_30b_a3b_1gpu: Qwen3-30B-A3B shapes, seq 4096,
#     bf16 parameters, data=random, real routing) compiled, bf16 grouped_mm against grouped_mm_fp8, at each
#     micro-batch of MBS (default "4 1"), then 24 layers at micro-batch MB24 (default 3; none skips it); medians
#     of steps 6-20.
#   PART=losses: 100 steps of the built-in chat records at the precision protocol's lr (3e-5), bf16 against FP8.
#   OUT=<dir> PART=check|speed|losses [MBS="4 1"] [MB24=3|none] bash benchmarks/fp8_experts_compiled_h200.sh \
#     [overrides...]
set -euo pipefail
OUT=${OUT:?OUT=<results directory>}
PART=${PART:-check}
MBS=${MBS:-4 1}
MB24=${MB24:-3}
variants='bf16_grouped_mm:kernels.experts=grouped_mm;fp8_grouped_mm:kernels.experts=grouped_mm_fp8'
common=(experiment=qwen3_30b_a3b_1gpu train.precision=bf16 kernels.compile=true)
opts=(--nproc 1 --baselines none --variants "$variants" --timeout-s "${TIMEOUT:-300}")
export PYTHONPATH="$(pwd):${PYTHONPATH:-}"
mkdir -p "$OUT"
case $PART in
  check)
    python -m pytest -q -p no:cacheprovider tests/moe/test_fp8_experts.py tests/kernels/test_fp8_frozen.py \
      2>&1 | tee "$OUT/gpu_tests.txt" || true
    python benchmarks/fp8_compiled_grad.py 2>&1 | tee "$OUT/fp8_compiled_grad.txt"
    python benchmarks/fp8_compiled_grad.py --bisect 2>&1 | tee "$OUT/fp8_compiled_grad_bisect.txt" ;;
  speed)
    for mb in $MBS; do
      python -m moe_tune.bench "${common[@]}" train.micro_batch_size="$mb" "$@" "${opts[@]}" --out "$OUT/8l_mb$mb"
    done
    [[ $MB24 == none ]] || python -m moe_tune.bench "${common[@]}" model.overrides.num_hidden_layers=24 \
      train.micro_batch_size="$MB24" "$@" \
      "${opts[@]}" --out "$OUT/24l_mb$MB24" ;;
  losses)
    python -m moe_tune.bench "${common[@]}" data=arithmetic data.num_samples=16384 train.steps=100 train.lr=3e-5 \
      train.warmup_steps_excluded=10 "$@" "${opts[@]}" --out "$OUT/losses" ;;
  *) echo "fp8_experts_compiled_h200.sh: PART=$PART is not check, speed or losses" >&2; exit 2 ;;
esac

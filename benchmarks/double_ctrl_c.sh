#!/usr/bin/env bash
# A second Ctrl-C while a checkpoint is written in the background, on the CPU: TRIES runs of the default tiny model,
# each interrupted twice 20 ms apart once "step 10 |" (a background save of step 10 starting) is in its log, with
# BUSY busy loops beside them (load made the rare outcome show). Prints each try's exit code; the documented one is
# 130, with the one "interrupted" line. Needs moe-tune on PATH.
#   OUT=<dir> [TRIES=25] [BUSY=2] bash benchmarks/double_ctrl_c.sh
set -uo pipefail
OUT=${OUT:?OUT=<results directory>}
TRIES=${TRIES:-25}
mkdir -p "$OUT"
busy=()
for _ in $(seq 1 "${BUSY:-2}"); do (while :; do :; done) & busy+=($!); done
trap 'kill "${busy[@]}" 2>/dev/null' EXIT
for i in $(seq 1 "$TRIES"); do
  run=$OUT/run$i
  rm -rf "$run"
  PYTHONFAULTHANDLER=1 moe-tune output_dir="$run" train.steps=30 checkpoint.every=5 train.log_every=5 \
    train.precision=fp32 > "$OUT/log$i" 2>&1 &
  pid=$!
  for _ in $(seq 1 1200); do grep -q "step 10 |" "$OUT/log$i" 2>/dev/null && break; sleep 0.05; done
  kill -INT "$pid"; sleep 0.02; kill -INT "$pid"
  wait "$pid"; code=$?
  complete=$(ls "$run"/checkpoints/*/COMPLETE 2>/dev/null | wc -l)
  echo "try $i: exit $code, complete checkpoints $complete, abort line $(grep -c 'terminate called' "$OUT/log$i")"
  rm -rf "$run"
done | tee "$OUT/tries.txt"

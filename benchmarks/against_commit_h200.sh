#!/usr/bin/env bash
# The same moe-tune-bench workload through this tree and through an older commit's tree, rows interleaved
# (old, new, old, new) so that drift on a shared host shows up as the spread between repeats, not as a
# difference between commits. One Transformers + FSDP2 row (with the first new row) anchors both.
#
#   git archive <commit> | tar -x -C .gpu/old          # here, .gpu/ listed in .git/info/exclude
#   OLD=.gpu/old OLD_COMMIT=<commit> OUT=$OUT bash benchmarks/against_commit_h200.sh [overrides...]
#
# Defaults: Qwen3-30B-A3B shapes with 8 layers, seq 4096, bf16 parameters, micro-batch MB=4 per GPU, EP=2 with
# all_to_all and torch.compile (experiment=qwen3_30b_a3b_ep2_fast), real routing, 20 steps, medians of 6-20.
# Needs hydra/omegaconf importable (PYTHONPATH) and NPROC GPUs. Prints one line per row at the end.
set -euo pipefail
OLD=${OLD:?OLD=<directory holding the older commit tree>}
OLD_COMMIT=${OLD_COMMIT:?OLD_COMMIT=<its commit>}
OUT=${OUT:?OUT=<results directory>}
NEW_COMMIT=${NEW_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
REPEATS=${REPEATS:-2}
TIMEOUT=${TIMEOUT:-150}
BASELINE=${BASELINE:-grouped_mm}  # the Transformers row run with the first new row; none to skip it
NPROC=${NPROC:-2}
EXPERIMENT=${EXPERIMENT:-qwen3_30b_a3b_ep2_fast}  # qwen3_30b_a3b_1gpu with NPROC=1
MB=${MB:-4}  # micro-batch per GPU
workload=(experiment="$EXPERIMENT" train.precision=bf16 train.micro_batch_size="$MB" "$@")
new=$(pwd)
old=$(cd "$OLD" && pwd)
mkdir -p "$OUT"

bench() {  # bench <tree> <commit> <label> <baselines>
  (cd "$1" && MOE_TUNE_COMMIT=$2 PYTHONPATH="$1:${PYTHONPATH:-}" python -m moe_tune.bench "${workload[@]}" \
    --nproc "$NPROC" --baselines "$4" --variants "$3:kernels.compile=true" --timeout-s "$TIMEOUT" --out "$OUT/$3")
}

for i in $(seq 1 "$REPEATS"); do
  bench "$old" "$OLD_COMMIT" "old_$i" none
  bench "$new" "$NEW_COMMIT" "new_$i" "$([ "$i" = 1 ] && echo "$BASELINE" || echo none)"
done

python - "$OUT" <<'PY'
import glob, json, sys
rows = []
for path in sorted(glob.glob(f"{sys.argv[1]}/*/bench-*.json")):
    d = json.load(open(path))
    for r in d["rows"]:
        rows.append((r["variant"], d["commit"], r["status"], r.get("tokens_per_s_per_gpu") or 0, r.get("peak_mem_gib") or 0))
print(f"{'row':<16}{'commit':<10}{'status':<8}{'tokens/s/GPU':>14}{'peak GiB':>10}")
for v, c, s, t, m in rows:
    print(f"{v:<16}{c[:9]:<10}{s[:7]:<8}{t:>14,.0f}{m:>10.1f}")
PY

#!/usr/bin/env bash
# Packed chat data against unpacked data of the same length, on one H200: the built-in chat records
# (data=arithmetic, about 40 tokens each, ~100 packed per row of 4096) through the chat template and the varlen
# attention kernel, against uniform random rows (data=random, one sequence per row). Same model (Qwen3-30B-A3B
# shapes, 8 layers), seq 4096, micro-batch 4, bf16 parameters, real routing, 20 steps, medians of 6-20.
# With OLD=<an older tree> (e.g. d4c6fd2, where packed rows ran SDPA with a dense block mask) one more row.
#   OUT=<results directory> [OLD=.gpu/old OLD_COMMIT=d4c6fd2] bash benchmarks/packed_h200.sh [overrides...]
set -euo pipefail
OUT=${OUT:?OUT=<results directory>}
NEW_COMMIT=${NEW_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
TIMEOUT=${TIMEOUT:-200}
workload=(experiment=qwen3_30b_a3b_1gpu train.precision=bf16 train.micro_batch_size=4 "$@")
packed="data=arithmetic,data.num_samples=24000"
mkdir -p "$OUT"

MOE_TUNE_COMMIT=$NEW_COMMIT PYTHONPATH="$(pwd):${PYTHONPATH:-}" python -m moe_tune.bench "${workload[@]}" --nproc 1 \
  --baselines none --variants "packed_chat_varlen:$packed;unpacked_random:data=random" --timeout-s "$TIMEOUT" \
  --out "$OUT/new"
if [ -n "${OLD:-}" ]; then
  (cd "$OLD" && MOE_TUNE_COMMIT=${OLD_COMMIT:?} PYTHONPATH="$(pwd):${PYTHONPATH:-}" python -m moe_tune.bench \
    "${workload[@]}" --nproc 1 --baselines none --variants "packed_dense_mask:$packed" --timeout-s "$TIMEOUT" \
    --out "$OUT/old")
fi
python - "$OUT" <<'PY'
import glob, json, sys
print(f"{'row':<22}{'commit':<10}{'status':<8}{'tokens/s/GPU':>14}{'peak GiB':>10}")
for path in sorted(glob.glob(f"{sys.argv[1]}/*/bench-*.json")):
    d = json.load(open(path))
    for r in d["rows"]:
        t, m = r.get("tokens_per_s_per_gpu") or 0, r.get("peak_mem_gib") or 0
        print(f"{r['variant']:<22}{d['commit'][:9]:<10}{r['status'][:7]:<8}{t:>14,.0f}{m:>10.1f}")
PY

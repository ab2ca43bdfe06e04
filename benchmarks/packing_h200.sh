#!/usr/bin/env bash
# Best-fit against next-fit packing on chat-like records, one H200: text records of lognormal length (median 900
# tokens, sigma 0.7, 3,000 records; the built-in one-character-per-token tokenizer), Qwen3-30B-A3B shapes (8 layers),
# seq 4096, micro-batch 4, bf16, real routing, 20 steps (medians after 5). tokens/s counts real tokens; row_fill and
# TFLOP/s (every position) beside it.
#   OUT=<results directory> bash benchmarks/packing_h200.sh [overrides...]
set -euo pipefail
OUT=${OUT:?OUT=<results directory>}
mkdir -p "$OUT"
python - "$OUT/chat.jsonl" <<'PY'
import json, math, random, sys
rng = random.Random(0)
with open(sys.argv[1], "w") as f:
    for _ in range(3000):
        n = min(4000, max(8, round(rng.lognormvariate(math.log(900), 0.7))))
        f.write(json.dumps({"text": "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(n))}) + "\n")
PY
MOE_TUNE_COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)} python -m moe_tune.bench \
  experiment=qwen3_30b_a3b_1gpu train.precision=bf16 train.micro_batch_size=4 data.path="$OUT/chat.jsonl" "$@" \
  --nproc 1 --baselines none --timeout-s 300 --out "$OUT/bench" \
  --variants "best_fit:data.packing_strategy=best_fit;next_fit:data.packing_strategy=next_fit"
rm -f "$OUT/chat.jsonl"
python - "$OUT" <<'PY'
import glob, json, sys
print(f"{'row':<10}{'status':<8}{'real tok/s':>12}{'row fill':>10}{'TFLOP/s':>9}{'peak GiB':>10}")
for path in sorted(glob.glob(f"{sys.argv[1]}/bench/bench-*.json")):
    for r in json.load(open(path))["rows"]:
        t, f, c, m = (r.get(k) or 0 for k in ("tokens_per_s_per_gpu", "row_fill", "tflops_per_gpu", "peak_mem_gib"))
        print(f"{r['variant']:<10}{r['status'][:7]:<8}{t:>12,.0f}{f:>10.3f}{c:>9.1f}{m:>10.1f}")
PY

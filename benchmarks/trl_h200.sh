#!/usr/bin/env bash
# moe_tune against TRL's SFTTrainer on the same chat records, one H200 (issue 32, item 5): a generated chat set of
# lognormal lengths (benchmarks/chat_lognormal.py: 2,000 records, median 900 tokens, sigma 0.7, one to three
# user/assistant turns; the built-in one-character-per-token tokenizer), Qwen3-30B-A3B shapes (8 layers), seq 4096,
# bf16, real routing, loss on the assistant turns, 25 steps (medians after 5). Rows: TRL 1.16 SFTTrainer (bfd
# packing, padding-free, flex_attention, fused AdamW) at micro-batch 1; moe_tune (best-fit packing, compiled) at
# micro-batch 1 and 4. Same records, same steps, same starting weights; tokens/s counts real (not padding) tokens.
#   OUT=<results directory> bash benchmarks/trl_h200.sh [overrides...]
# Wheels (no network on the machine): made here with `shared/gpu/prepare.sh base .gpu/base` and
#   pip download --no-deps --python-version 3.12 --only-binary=:all: -d .gpu/trl trl==1.16.0 datasets==4.8.5 \
#     dill==0.4.1 multiprocess==0.70.19 xxhash
# and installed below into /tmp/site when trl is not importable. About 5 minutes; each row stops at 170 s.
set -euo pipefail
OUT=${OUT:?OUT=<results directory>}
COMPILE=${COMPILE:-true}
mkdir -p "$OUT"
if ! python3 -c "import trl, hydra" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/base/*.whl .gpu/trl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 benchmarks/chat_lognormal.py "$OUT/chat.jsonl" --records 2000 --median 900 --sigma 0.7 --seq-len 4096
MOE_TUNE_COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)} python3 -m moe_tune.bench \
  experiment=qwen3_30b_a3b_1gpu train.precision=bf16 train.micro_batch_size=1 train.steps=25 \
  data.path="$OUT/chat.jsonl" "$@" --nproc 1 --baselines trl --trl-attn auto --timeout-s 170 --out "$OUT/bench" \
  --variants "moe_tune_mb1:kernels.compile=$COMPILE;moe_tune_mb4:kernels.compile=$COMPILE,train.micro_batch_size=4"
rm -f "$OUT/chat.jsonl"
python3 - "$OUT" <<'PY'
import glob, json, sys
print(f"{'row':<14}{'mb':>3} {'status':<8}{'real tok/s':>11}{'row fill':>9}{'peak GiB':>9}{'loss@1':>8}{'loss@last':>10}")
for path in sorted(glob.glob(f"{sys.argv[1]}/bench/bench-*.json"))[-1:]:  # this run's
    rows = json.load(open(path))["rows"]
    for r in rows:
        t, f, m = (r.get(k) or 0 for k in ("tokens_per_s_per_gpu", "row_fill", "peak_mem_gib"))
        losses = r.get("losses") or [float("nan")]
        mb = r["config"].get("micro_batch_size", "")
        print(f"{r['variant']:<14}{mb:>3} {r['status'][:7]:<8}{t:>11,.0f}{f:>9.3f}{m:>9.1f}{losses[0]:>8.3f}{losses[-1]:>10.3f}")
    ok = {r["variant"]: r for r in rows if r["status"] == "ok"}
    for name in ("moe_tune_mb1", "moe_tune_mb4"):
        if "trl" in ok and name in ok:
            a, b = ok[name], ok["trl"]
            print(f"{name} / trl: {a['tokens_per_s_per_gpu'] / b['tokens_per_s_per_gpu']:.2f}x real tokens/s, "
                  f"{a['peak_mem_gib']:.1f} vs {b['peak_mem_gib']:.1f} GiB peak")
PY

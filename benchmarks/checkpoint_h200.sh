#!/usr/bin/env bash
# Training stall per checkpoint save, synchronous against background (checkpoint.async_save), one H200: the full
# fine-tune state of Qwen3-30B-A3B shapes (8 layers; bf16 parameters and AdamW moments, about 31 GiB), seq 4096,
# micro-batch 4, compiled, real routing. The disk is measured first in the same call: dd of 8 GiB with fsync into
# the directory the checkpoints go to. One save per run (two would not fit on the machine's free disk):
#   sync:  40 steps, a save at step 30 (training waits for the whole write);
#   async: 330 steps, a save at step 200; tokens/s of the steps written during the background write against before.
#   OUT=<results directory> [WORK=<directory on the disk>] [MODES="sync async"] bash benchmarks/checkpoint_h200.sh [overrides...]
set -uo pipefail
OUT=${OUT:?OUT=<results directory>}
WORK=${WORK:-$PWD/checkpoint_bench}
mkdir -p "$OUT" "$WORK"
{ df -h "$WORK" /tmp /dev/shm; free -g; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  git rev-parse --short HEAD; } >"$OUT/machine.txt" 2>&1
dd if=/dev/zero of="$WORK/dd.bin" bs=64M count=128 conv=fsync 2>"$OUT/dd.txt"
rm -f "$WORK/dd.bin"
COMMON=(experiment=qwen3_30b_a3b_1gpu train.precision=bf16 train.micro_batch_size=4 kernels.compile=true
  checkpoint.export_hf=false checkpoint.resume=none train.log_every=10 logger=none "$@")
if [[ " ${MODES:-sync async} " == *" sync "* ]]; then
  python -m moe_tune "${COMMON[@]}" output_dir="$WORK/sync" checkpoint.async_save=false checkpoint.every=30 \
    train.steps=40 >"$OUT/sync.log" 2>&1
  echo "sync rc=$?" >>"$OUT/machine.txt"
  du -sb "$WORK/sync/checkpoints/step_30" >>"$OUT/machine.txt"
  cp "$WORK/sync/metrics.jsonl" "$WORK/sync_metrics.jsonl"
  rm -rf "$WORK/sync"
fi
python -m moe_tune "${COMMON[@]}" output_dir="$WORK/async" checkpoint.async_save=true checkpoint.every=200 \
  train.steps=330 >"$OUT/async.log" 2>&1
echo "async rc=$?" >>"$OUT/machine.txt"
cp "$WORK/async/metrics.jsonl" "$WORK/async_metrics.jsonl"
rm -rf "$WORK/async"
python - "$OUT" "$WORK" <<'PY'
import json, os, re, statistics, sys
out, work = sys.argv[1:3]
dd = open(f"{out}/dd.txt").read()
disk = re.search(r"copied, ([\d.]+) s", dd)
disk_gib_s = 8.0 / float(disk.group(1)) if disk else float("nan")
fields = lambda line: {k: float(v) for k, v in re.findall(r"(\w+)=([\d.]+)", line)}
rows = {}
for mode in ("sync", "async"):
    if not os.path.exists(f"{out}/{mode}.log"):
        continue
    log = open(f"{out}/{mode}.log").read()
    stall = next((fields(l) for l in log.splitlines() if "checkpoint_stall" in l), {})
    written = next((fields(l) for l in log.splitlines() if "checkpoint_written" in l), {})
    metrics = [json.loads(l) for l in open(f"{work}/{mode}_metrics.jsonl")]
    save = int(stall.get("step", 0))
    before = [m["tokens_per_s"] for m in metrics if save - 100 < m["step"] <= save and m["step"] > 10]
    seconds = written.get("total_s", 0.0)
    during, t = [], 0.0
    for m in metrics:
        if m["step"] > save and t < seconds:
            t += m["step_time_s"]
            during.append(m["tokens_per_s"])
    rows[mode] = {
        "save_step": save, "stall_s": stall.get("stall_s"), "staging_s": stall.get("staging_s"),
        "write_s": written.get("write_s"), "manifest_s": written.get("manifest_s"), "gib": written.get("gib"),
        "write_gib_per_s": written.get("write_gib_per_s"),
        "tokens_per_s_before": statistics.median(before) if before else None,
        "tokens_per_s_during_write": statistics.median(during) if during else None, "steps_during_write": len(during),
        "tokens_per_s_by_step": [round(m["tokens_per_s"]) for m in metrics],
    }
result = {"disk_dd_fsync_gib_per_s": disk_gib_s, "rows": rows}
json.dump(result, open(f"{out}/checkpoint_stall.json", "w"), indent=1)
print(f"disk (dd 8 GiB, fsync): {disk_gib_s:.2f} GiB/s")
print(f"{'mode':<7}{'GiB':>7}{'stall s':>9}{'staging s':>10}{'write s':>9}{'GiB/s':>7}{'hash s':>8}{'tok/s before':>14}{'during':>9}")
for mode, r in rows.items():
    g = lambda k, f: format(r[k], f) if r[k] is not None else "-"
    print(f"{mode:<7}{g('gib', '7.1f')}{g('stall_s', '9.2f')}{g('staging_s', '10.2f')}{g('write_s', '9.1f')}"
          f"{g('write_gib_per_s', '7.2f')}{g('manifest_s', '8.1f')}{g('tokens_per_s_before', '14,.0f')}"
          f"{g('tokens_per_s_during_write', '9,.0f')}")
PY
rm -rf "$WORK"

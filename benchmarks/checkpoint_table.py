"""The checkpoint-stall results of ``benchmarks/checkpoint_h200.sh`` as one table: each results folder's
``checkpoint_stall.json`` (its commit from the folder name ``checkpoint_<commit>``, machine and versions from its
``machine.txt``) gets those fields written in, and the folders together give ``checkpoint_stall.md`` and
``checkpoint_stall.png`` (stall per save, and tokens/s by step around the background save) in the parent folder.

    python benchmarks/checkpoint_table.py RESULTS_DIR/checkpoint_<commit> [...]
"""

from __future__ import annotations

import json
import os
import sys


def machine(folder: str) -> dict:
    """Hardware and versions from ``machine.txt`` (nvidia-smi's CSV line, then ``torch X transformers Y``)."""
    path = os.path.join(folder, "machine.txt")
    lines = open(path).read().splitlines() if os.path.exists(path) else []
    gpu = next((line.split(",")[0] for line in lines if line.startswith("NVIDIA")), "NVIDIA H200")
    versions = next((line.split() for line in lines if line.startswith("torch ")), [])
    return {"hardware": f"1 x {gpu}", "versions": dict(zip(versions[::2], versions[1::2]))}


def annotate(folder: str) -> dict:
    path = os.path.join(folder, "checkpoint_stall.json")
    result = json.load(open(path))
    result.update(commit=os.path.basename(folder).removeprefix("checkpoint_"), **machine(folder))
    result["workload"] = (
        "Qwen3-30B-A3B shapes, 8 layers, seq 4096, micro-batch 4, bf16 parameters and AdamW moments, compiled, "
        "real routing; one save per run"
    )
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    return result


def main(folders: list[str]) -> None:
    results = [annotate(f) for f in folders]
    out = os.path.dirname(os.path.abspath(folders[0]))
    lines = [
        "# Training stall per checkpoint save, 1 x H200",
        "",
        results[0]["workload"] + ". Disk: `dd` of 8 GiB with `conv=fsync`, one stream, in the same call.",
        "",
        "| commit | mode | GiB | stall s | of it staging s | write s | write GiB/s | disk GiB/s (dd) | hashing s "
        "| tokens/s before | tokens/s during the write |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        for mode, row in r["rows"].items():
            during = f"{row['tokens_per_s_during_write']:,.0f}" if mode == "async" else "(stopped)"
            lines.append(
                f"| {r['commit']} | {mode} | {row['gib']:.1f} | {row['stall_s']:.2f} | {row['staging_s']:.2f} "
                f"| {row['write_s']:.1f} | {row['write_gib_per_s']:.2f} | {r['disk_dd_fsync_gib_per_s']:.2f} "
                f"| {row['manifest_s']:.1f} | {row['tokens_per_s_before']:,.0f} | {during} |"
            )
    lines += ["", f"versions: {results[-1]['versions']}", ""]
    with open(os.path.join(out, "checkpoint_stall.md"), "w") as f:
        f.write("\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    labels = [f"{r['commit']}\n{mode}" for r in results for mode in r["rows"]]
    stalls = [row["stall_s"] for r in results for row in r["rows"].values()]
    left.bar(labels, stalls, color="tab:red")
    left.set_ylabel("training stopped per save (s)")
    left.set_title("stall per save of 31.3 GiB")
    for r in results:
        row = r["rows"].get("async")
        if row and row.get("tokens_per_s_by_step"):
            series = row["tokens_per_s_by_step"]
            right.plot(range(1, len(series) + 1), series, label=f"{r['commit']} async", linewidth=0.8)
    right.axvline(200, color="gray", linestyle=":", label="save at step 200")
    right.set_xlabel("step")
    right.set_ylabel("tokens/s")
    right.set_title("tokens/s by step (host copy prepared at step 10)")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "checkpoint_stall.png"), dpi=110)


if __name__ == "__main__":
    main(sys.argv[1:])

"""Row fill of moe_tune's packers against TRL's best-fit decreasing on the same chat-like samples (CPU only).

Samples: lognormal lengths (sigma 0.7, medians 300-1,500 tokens, at least 8, at most the row), 4,000 per case, a
fixed seed. Rows: moe_tune next-fit (data.packing_strategy=next_fit), moe_tune best-fit decreasing (in memory, the
default), moe_tune streaming best-fit with data.packing_buffer open rows (8, 64: the default, 256), and
trl.pack_dataset(strategy="bfd") where trl is installed. Fill = real tokens / row positions.

    python benchmarks/packing_fill.py --out benchmarks/results/<dir>
writes packing_fill.json (commit, versions, hardware, rows) and packing_fill.md."""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import subprocess

from moe_tune.data.packing import RowPacker, best_fit_decreasing

CASES = [(2048, 300), (4096, 600), (4096, 1000), (4096, 1500), (8192, 1000), (8192, 1500)]
BUFFERS = (8, 64, 256)


def lengths(n: int, median: int, seq_len: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [min(seq_len, max(8, round(rng.lognormvariate(math.log(median), 0.7)))) for _ in range(n)]


def next_fit(ls: list[int], seq_len: int) -> int:
    packer = RowPacker(seq_len, 0, True, "next_fit")
    return sum(len(packer.add([0] * n, [0] * n)) for n in ls) + len(packer.close())


def streaming(ls: list[int], seq_len: int, open_rows: int) -> int:
    packer = RowPacker(seq_len, 0, True, "best_fit", open_rows)
    return sum(len(packer.add([0] * n, [0] * n)) for n in ls) + len(packer.close())


def trl_bfd(ls: list[int], seq_len: int) -> int | None:
    try:
        import datasets
        from trl import pack_dataset
    except ImportError:
        return None
    ds = datasets.Dataset.from_dict({"input_ids": [[1] * n for n in ls]})
    return len(pack_dataset(ds, seq_len, strategy="bfd"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--samples", type=int, default=4000)
    args = parser.parse_args()
    rows = []
    for seq_len, median in CASES:
        ls = lengths(args.samples, median, seq_len, seed=0)
        counts = {
            "next_fit": next_fit(ls, seq_len),
            "best_fit": len(best_fit_decreasing(ls, seq_len)),
            **{f"streaming_{b}": streaming(ls, seq_len, b) for b in BUFFERS},
            "trl_bfd": trl_bfd(ls, seq_len),
        }
        fills = {k: None if v is None else sum(ls) / (v * seq_len) for k, v in counts.items()}
        rows.append({"seq_len": seq_len, "median": median, "tokens": sum(ls), "rows": counts, "fill": fills})
    versions = {"python": platform.python_version()}
    for name in ("torch", "trl", "datasets"):
        try:
            versions[name] = __import__(name).__version__
        except ImportError:
            versions[name] = None
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    os.makedirs(args.out, exist_ok=True)
    result = {"commit": commit, "versions": versions, "hardware": platform.processor() or platform.machine()}
    with open(os.path.join(args.out, "packing_fill.json"), "w") as f:
        json.dump({**result, "samples": args.samples, "rows": rows}, f, indent=1)
    keys = list(rows[0]["fill"])
    lines = ["| seq_len | median | " + " | ".join(keys) + " |", "|" + " --- |" * (2 + len(keys))]
    for r in rows:
        cells = ["n/a" if r["fill"][k] is None else f"{100 * r['fill'][k]:.2f}%" for k in keys]
        lines.append(f"| {r['seq_len']} | {r['median']} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    with open(os.path.join(args.out, "packing_fill.md"), "w") as f:
        f.write(
            f"Row fill (real tokens / row positions), {args.samples} lognormal samples per case, commit {commit}\n\n"
        )
        f.write(table + "\n")
    print(table)


if __name__ == "__main__":
    main()

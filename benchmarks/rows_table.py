"""One line per row of every ``bench-*.json`` under the given directories (recursively), for the benchmark
scripts' last output: run folder, commit, micro-batch, activation checkpointing, row, status, tokens/s/GPU,
TFLOP/s/GPU, peak GiB and final loss.

    python benchmarks/rows_table.py DIR [DIR ...]
"""

from __future__ import annotations

import glob
import json
import os
import sys


def rows(directory: str) -> list[tuple]:
    out = []
    for path in sorted(glob.glob(os.path.join(directory, "**", "bench-*.json"), recursive=True)):
        d = json.load(open(path))
        w, run = d["workload"], os.path.basename(os.path.dirname(path))
        for r in d["rows"]:
            out.append(
                (
                    run,
                    (d.get("commit") or "")[:9],
                    w.get("micro_batch_size"),
                    w.get("activation_checkpointing"),
                    r["variant"],
                    r["status"][:7],
                    r.get("tokens_per_s_per_gpu") or 0,
                    r.get("tflops_per_gpu") or 0,
                    r.get("peak_mem_gib") or 0,
                    r.get("final_loss") or 0,
                )
            )
    return out


def main(argv: list[str]) -> int:
    print(f"{'run':<22}{'commit':<10}{'mb':>3} {'AC':<10}{'row':<26}{'status':<8}{'tok/s/GPU':>11}{'TFLOP/s':>9}"
          f"{'GiB':>7}{'loss':>9}")  # fmt: skip
    for run, commit, mb, ac, row, status, tps, tflops, gib, loss in (r for d in argv for r in rows(d)):
        print(f"{run:<22}{commit:<10}{mb:>3} {ac:<10}{row:<26}{status:<8}{tps:>11,.0f}{tflops:>9.0f}{gib:>7.1f}"
              f"{loss:>9.4f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

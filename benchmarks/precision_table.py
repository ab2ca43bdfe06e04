"""Issue 6's fp32-versus-AMP table from precision_h200.sh results (moe-tune-bench JSON files).

    python benchmarks/precision_table.py OUT_STEM WORKLOAD=a.json[,b.json ...] [WORKLOAD=...] [--memory bench.json]

Per workload and row: wall time, tokens/s, speed-up over fp32 unfused and over bf16 `torch`, peak memory, the
final loss and the mean of the last 10 losses, and their difference from the bf16 `torch` run, checked against
the issue's bounds (te: 1%, te + FP8: 2%). ``torch_unfused_loss`` differs from bf16 `torch` only in the loss's
summation order, so its difference is the run-to-run noise floor of a rounding-level change. ``--memory``: a
fused/unfused-loss pair, shown as peak memory with and without the fused loss. Writes OUT_STEM.{json,md,png}.

Workloads named ``NAME/SUFFIX`` (e.g. ``qwen3_8_layers/seed1``) are repeats of NAME with another seed: each gets
its own table, and a summary per NAME shows every bounded row's final-loss difference across the repeats and how
often the bound held, beside the noise-floor row's.

A workload may come from several runs of the same workload (rows run side by side on two GPUs): their rows are
joined in order. A row run in more than one file (the reference, so each file's rows can be compared with it)
is taken from the first that ran it to the end, and whether the reruns' losses were bit-identical is reported.
"""

from __future__ import annotations

import argparse
import json

REFERENCE = "bf16_torch"
NOISE = "torch_unfused_loss"
BOUNDS = {
    "te": 0.01,
    "te_fp8_current": 0.02,
    "te_fp8_delayed": 0.02,
    "te_fp8_blockwise": 0.02,
    "te_fp8_current_split": 0.02,
    "te_fp8_current_fwd_only": 0.02,
    "te_fp8_current_e4m3": 0.02,
}


def _tail_mean(losses: list[float], n: int = 10) -> float:
    return sum(losses[-n:]) / min(n, len(losses))


def merge(benches: list[dict]) -> tuple[dict, dict[str, bool]]:
    """One bench result from several runs of the same workload; for rows run more than once, whether every
    rerun's losses equal the first's bit for bit."""
    first = benches[0]
    for b in benches[1:]:
        # The resolved seed is in the workload; an explicit train.seed=0 override equals the default 0.
        for key, get in (("workload", lambda x: x["workload"]), ("common_overrides", lambda x: _without_seed(x)[1])):
            if get(b) != get(first):
                print(f"precision_table: files of one workload differ in {key}: {get(first)} vs {get(b)}")
                raise SystemExit(2)
    rows: dict[str, dict] = {}
    reruns: dict[str, bool] = {}
    for b in benches:
        for r in b["rows"]:
            name = r["variant"]
            if name not in rows or (rows[name]["status"] != "ok" and r["status"] == "ok"):
                rows[name] = r  # a row that failed in one file (e.g. a timeout) and ran in another
            elif r["status"] == "ok" and rows[name]["status"] == "ok":
                reruns[name] = reruns.get(name, True) and r["losses"] == rows[name]["losses"]
    commits = sorted({b["commit"] for b in benches})
    return {**first, "rows": list(rows.values()), "commit": ", ".join(commits)}, reruns


def summarize(bench: dict) -> list[dict]:
    rows = {r["variant"]: r for r in bench["rows"]}
    ref = rows.get(REFERENCE)
    if ref is None or ref["status"] != "ok":
        raise SystemExit(
            f"precision_table: the reference row {REFERENCE!r} is missing or failed; it is what rows compare with"
        )
    fp32 = rows.get("fp32_unfused")
    fp32_tps = fp32["tokens_per_s_per_gpu"] if fp32 and fp32["status"] == "ok" else None
    out = []
    for name, r in rows.items():
        ok = r["status"] == "ok"
        row = {"variant": name, "status": r["status"], "precision": r["config"]["precision"]}
        row["kernels"] = r["config"]["kernels"] + (f"+fp8:{r['config']['fp8']}" if r["config"]["fp8"] != "none" else "")
        if ok:
            final, tail = r["losses"][-1], _tail_mean(r["losses"])
            row.update(
                wall_s=r["wall_s"],
                tokens_per_s_per_gpu=r["tokens_per_s_per_gpu"],
                speedup_vs_fp32=r["tokens_per_s_per_gpu"] / fp32_tps if fp32_tps else None,
                speedup_vs_bf16_torch=r["tokens_per_s_per_gpu"] / ref["tokens_per_s_per_gpu"],
                peak_mem_gib=r["peak_mem_gib"],
                final_loss=final,
                last10_loss=tail,
                final_diff=(final - ref["losses"][-1]) / ref["losses"][-1],
                last10_diff=(tail - _tail_mean(ref["losses"])) / _tail_mean(ref["losses"]),
            )
            bound = BOUNDS.get(name)
            if bound is not None:
                row["bound"] = bound
                row["within_bound_final"] = abs(row["final_diff"]) <= bound
                row["within_bound_last10"] = abs(row["last10_diff"]) <= bound
        out.append(row)
    return out


def _pct(x) -> str:
    return "" if x is None else f"{100 * x:+.2f}%"


def _f(x, fmt: str) -> str:
    return "" if x is None else format(x, fmt)


def markdown(
    tables: dict[str, list[dict]], sources: dict[str, dict], reruns: dict[str, dict], memory: dict | None
) -> str:
    lines = ["# fp32 versus bf16 with fused kernels, per kernel set (issue 6)", ""]
    for workload, rows in tables.items():
        b = sources[workload]
        w = b["workload"]
        lines += [
            f"## {workload}: {w['model']}, {w['num_layers']} layers, seq {w['seq_len']}, micro-batch "
            f"{w['micro_batch_size']}, {w['steps']} steps, lr {w['lr']:g}, {w['routing']} routing ({b['hardware']}, "
            f"commit `{b['commit']}`)",
            "",
            "| row | kernels | precision | wall s | tokens/s | vs fp32 unfused | vs bf16 torch | peak GiB | "
            "final loss | diff | last-10 mean | diff | bound | holds (final / last-10) |",
            "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for r in rows:
            if r["status"] != "ok":
                lines.append(f"| {r['variant']} | {r['kernels']} | {r['precision']} | {r['status']} |||||||||||")
                continue
            holds = ""
            if "bound" in r:
                holds = f"{'yes' if r['within_bound_final'] else 'no'} / {'yes' if r['within_bound_last10'] else 'no'}"
            speed_fp32 = "" if r["speedup_vs_fp32"] is None else f"{r['speedup_vs_fp32']:.2f}x"
            lines.append(
                f"| {r['variant']} | {r['kernels']} | {r['precision']} | {r['wall_s']:.0f} | "
                f"{r['tokens_per_s_per_gpu']:,.0f} | {speed_fp32} | {r['speedup_vs_bf16_torch']:.2f}x | "
                f"{r['peak_mem_gib']:.1f} | {r['final_loss']:.4f} | {_pct(r['final_diff'])} | {r['last10_loss']:.4f} | "
                f"{_pct(r['last10_diff'])} | {_pct(r.get('bound')).lstrip('+')} | {holds} |"
            )
        noise = next((r for r in rows if r["variant"] == NOISE and r["status"] == "ok"), None)
        if noise:
            lines += [
                "",
                f"Noise floor: `{NOISE}` computes the same loss with another summation order and ends "
                f"{_pct(noise['final_diff'])} (last-10 mean {_pct(noise['last10_diff'])}) from bf16 torch.",
            ]
        for name, same in reruns[workload].items():
            lines += [
                "",
                f"`{name}` was run again beside the other file's rows: its {w['steps']} losses were "
                + ("bit-identical." if same else "not bit-identical (the first run's are shown)."),
            ]
        lines.append("")
    lines += repeats_summary(tables, sources)
    if memory:
        lines += ["## Peak memory with and without the fused linear cross-entropy", ""]
        w = memory["workload"]
        lines.append(
            f"{w['model']}, {w['num_layers']} layers, seq {w['seq_len']}, micro-batch {w['micro_batch_size']}, "
            f"precision `{w['precision']}` ({memory['hardware']}, commit `{memory['commit']}`):"
        )
        lines += ["", "| row | peak allocated GiB | peak reserved GiB | tokens/s |", "|---|---:|---:|---:|"]
        for r in memory["rows"]:
            lines.append(
                f"| {r['variant']} | {_f(r['peak_mem_gib'], '.1f')} | {_f(r['peak_reserved_gib'], '.1f')} | "
                f"{_f(r['tokens_per_s_per_gpu'], ',.0f')} |"
            )
        lines.append("")
    return "\n".join(lines)


def _without_seed(bench: dict) -> tuple[dict, list[str]]:
    workload = {k: v for k, v in bench["workload"].items() if k != "seed"}
    return workload, [o for o in bench["common_overrides"] if not o.startswith("train.seed=")]


def repeats_summary(tables: dict[str, list[dict]], sources: dict[str, dict]) -> list[str]:
    """Per workload run more than once (``NAME``, ``NAME/seed1``, ...): each bounded row's and the noise-floor
    row's final-loss difference from bf16 torch in every repeat, and how many repeats held the bound."""
    groups: dict[str, list[str]] = {}
    for name in tables:
        groups.setdefault(name.split("/")[0], []).append(name)
    lines = []
    for base, names in groups.items():
        if len(names) < 2:
            continue
        settings = {n: _without_seed(sources[n]) for n in names}
        for n in names[1:]:
            if settings[n] != settings[names[0]]:
                print(
                    f"precision_table: {n} is not {names[0]} with another seed: {settings[n]} vs {settings[names[0]]}"
                )
                raise SystemExit(2)
        labels = [f"seed {sources[n]['workload']['seed']}" for n in names]
        lines += [
            f"## {base}: final loss vs bf16 torch across {len(names)} repeats",
            "",
            "| row | bound | " + " | ".join(labels) + " | mean abs | held |",
            "|---|---:|" + "---:|" * len(names) + "---:|---|",
        ]
        for variant in [NOISE, *BOUNDS]:
            diffs = []
            for n in names:
                r = next((r for r in tables[n] if r["variant"] == variant and r["status"] == "ok"), None)
                diffs.append(None if r is None else r["final_diff"])
            seen = [d for d in diffs if d is not None]
            if not seen:
                continue
            bound = BOUNDS.get(variant)
            held = "" if bound is None else f"{sum(abs(d) <= bound for d in seen)} of {len(seen)}"
            cells = " | ".join("" if d is None else _pct(d) for d in diffs)
            mean_abs = 100 * sum(abs(d) for d in seen) / len(seen)
            lines.append(f"| {variant} | {_pct(bound).lstrip('+')} | {cells} | {mean_abs:.2f}% | {held} |")
        lines.append("")
    return lines


def chart(tables: dict[str, list[dict]], path: str) -> None:
    """Per workload: tokens/s and the last-10 loss difference of its first run, and the final-loss difference of
    every bounded row (and the noise row) in each repeat, one dot per seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bases = [n for n in tables if "/" not in n]
    fig, axes = plt.subplots(len(bases), 3, figsize=(19, 3.4 * len(bases)), squeeze=False)
    for base, (ax1, ax2, ax3) in zip(bases, axes):
        ok = [r for r in tables[base] if r["status"] == "ok"]
        names = [r["variant"] for r in ok][::-1]
        ax1.barh(names, [r["tokens_per_s_per_gpu"] for r in ok][::-1], color="#1f77b4")
        ax1.set_xlabel(f"{base}: tokens/s per GPU")
        ax2.barh(names, [100 * r["last10_diff"] for r in ok][::-1], color="#ff7f0e")
        ax2.set_xlabel(f"{base}: last-10 mean loss vs bf16 torch, %")
        repeats = [n for n in tables if n == base or n.startswith(base + "/")]
        variants = [NOISE, *BOUNDS][::-1]
        for y, variant in enumerate(variants):
            diffs = [
                100 * r["final_diff"]
                for n in repeats
                for r in tables[n]
                if r["variant"] == variant and r["status"] == "ok"
            ]
            ax3.plot(diffs, [y] * len(diffs), "o", color="#2ca02c", alpha=0.7)
        ax3.set_yticks(range(len(variants)), variants)
        ax3.set_xlabel(f"{base}: final loss vs bf16 torch, %, {len(repeats)} seeds")
        for ax in (ax2, ax3):
            for bound in (1, 2):
                ax.axvline(bound, color="gray", lw=0.7, ls="--")
                ax.axvline(-bound, color="gray", lw=0.7, ls="--")
            ax.set_xlim(-5, 5)
        for ax in (ax1, ax2, ax3):
            ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_stem")
    p.add_argument("workloads", nargs="+", help="NAME=bench.json")
    p.add_argument("--memory", default=None)
    args = p.parse_args(argv)
    sources, reruns = {}, {}
    for spec in args.workloads:
        name, _, paths = spec.partition("=")
        benches = []
        for path in paths.split(","):
            with open(path) as f:
                benches.append(json.load(f))
        sources[name], reruns[name] = merge(benches)
    memory = None
    if args.memory:
        with open(args.memory) as f:
            memory = json.load(f)
    tables = {name: summarize(b) for name, b in sources.items()}
    with open(args.out_stem + ".json", "w") as f:
        json.dump(
            {"sources": {n: a.partition("=")[2] for n, a in zip(sources, args.workloads)}, "tables": tables},
            f,
            indent=2,
        )
    with open(args.out_stem + ".md", "w") as f:
        f.write(markdown(tables, sources, reruns, memory))
    chart(tables, args.out_stem + ".png")
    print(f"wrote {args.out_stem}.json, .md, .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

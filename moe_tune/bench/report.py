"""Hardware naming, MFU, and the Markdown table and PNG chart of a ``moe-tune-bench`` result JSON.

``python -m moe_tune.bench.report <bench-*.json>`` re-renders the table and chart next to a result file.

MFU = achieved TFLOP/s per GPU / the GPU's dense BF16 peak from its datasheet (``PEAK_BF16_TFLOPS``, no
sparsity). The achieved TFLOP/s use the FLOP formula of ``moe_tune.metrics`` (6 x active matmul parameters per token
+ causal attention).
"""

from __future__ import annotations

import argparse
import json
import os
import re

# Dense BF16 tensor-core peak per GPU, TFLOP/s, from NVIDIA's datasheets (the "with sparsity" figures are 2x).
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "B200": 2250.0, "A100": 312.0}


def gpu_name() -> str | None:
    """GPU 0's name from nvidia-smi (no CUDA context in the benchmark's own process: that would take memory on
    GPU 0 from every row), else from torch; None without a GPU."""
    import shutil
    import subprocess

    import torch

    if not torch.cuda.is_available():
        return None
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=20
            )
            if out.returncode == 0 and out.stdout.strip():
                return out.stdout.splitlines()[0].strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return torch.cuda.get_device_name(0)


def hardware_label(num_gpus: int) -> str:
    """Short form for directory names: ``"2xH200"``, or ``"cpu"``."""
    name = gpu_name()
    if not name or num_gpus == 0:
        return "cpu"
    m = re.search(r"[A-Z]+\d+\w*", name.replace("NVIDIA", ""))
    short = m.group(0) if m else re.sub(r"\W+", "", name)
    return f"{num_gpus}x{short}"


def peak_tflops(hardware: str) -> float | None:
    for key, value in PEAK_BF16_TFLOPS.items():
        if key in hardware:
            return value
    return None


# -- Markdown ------------------------------------------------------------------------------------------
def _num(value, fmt: str) -> str:
    return "" if value is None else format(value, fmt)


def _reference(result: dict) -> dict | None:
    ref = result.get("reference_variant")
    return next((r for r in result["rows"] if r["variant"] == ref and r["status"] == "ok"), None)


def _kernels(c: dict) -> str:
    """``te+fp8:current+compile-fused_loss``: the kernel set and what differs from its defaults."""
    name = str(c.get("kernels", ""))
    if c.get("fp8") not in (None, "none"):
        name += f"+fp8:{c['fp8']}"
    if c.get("experts") not in (None, "grouped_mm"):
        name += f"+experts:{c['experts']}"
    if c.get("compile"):
        name += "+compile"
    if c.get("fused_loss") is False:
        name += "-fused_loss"
    if c.get("peft"):  # a Transformers baseline run through PEFT (peft=lora workloads)
        name += "+peft"
    return name


def _medians(steps: int, excluded: int) -> str:
    """Which steps the medians hold: the summary's (moe_tune.metrics) take every step when none is past the excluded."""
    if steps > excluded:
        return f"medians after the first {excluded}"
    return f"medians of all {steps} (none past train.warmup_steps_excluded={excluded}, so none left out)"


def markdown(result: dict) -> str:
    w = result["workload"]
    layers = f"{w['num_layers']} layers" + (
        f" (of {w['published_num_layers']})" if w.get("published_num_layers") not in (None, w["num_layers"]) else ""
    )
    tokens_per_gpu_step = w["global_batch_size"] * w["seq_len"] // max(1, result["world_size"])
    peak = result.get("peak_tflops_per_gpu")
    lines = [
        f"# {w['model']}, {layers}, seq {w['seq_len']}, {result['hardware']}",
        "",
        f"- {result['date']}, commit `{result['commit'][:12]}`{' (uncommitted changes)' if result.get('dirty') else ''}, "
        + ", ".join(
            f"{k} {v}" for k, v in result["versions"].items() if k in ("torch", "transformers", "CUDA", "NCCL")
        ),
        f"- Workload: micro-batch {w['micro_batch_size']} x {w['seq_len']} tokens per rank, global batch "
        f"{w['global_batch_size']} sequences ({tokens_per_gpu_step:,} tokens per GPU per step), precision "
        f"`{w['precision']}`, activation checkpointing `{w['activation_checkpointing']}`, routing `{w['routing']}`, "
        f"{w['steps']} steps, {_medians(w['steps'], w['warmup_steps_excluded'])}.",
        f"- TFLOP/s per GPU = tokens/s per GPU x FLOPs/token, FLOPs/token = {4 if w.get('peft') else 6} x active "
        "matmul parameters + 6 x layers x seq x (heads x head_dim) (causal attention) = "
        f"{_num(result.get('flops_per_token'), '.3g') or 'not counted (no row ran)'}"
        + (
            f"; LoRA {w['peft']}, base frozen (forward + input gradient), adapter FLOPs not counted."
            if w.get("peft")
            else "."
        ),
        f"- MFU against {peak:g} TFLOP/s per GPU ({result.get('peak_source', '')})."
        if peak
        else "- MFU: no peak known for this hardware.",
        "",
        f"Speed-up and loss differences are against `{result['reference_variant']}`; a loss difference is the "
        "largest over all steps (relative: divided by the reference's loss at that step)."
        if result.get("reference_variant")
        else "No reference row ran (no baseline, no --reference): no speed-ups or loss differences.",
        "",
        "| variant | kind | status | comm | kernels | precision | ep | tokens/s/GPU | speed-up | TFLOP/s/GPU | MFU | "
        "peak alloc GiB | peak reserved GiB | wall s | final loss | max loss diff (abs) | max loss diff (rel) |",
        "|---|---|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    ref = _reference(result)
    for r in result["rows"]:
        c = r["config"]
        speedup = ""
        if ref and r["status"] == "ok" and ref["tokens_per_s_per_gpu"]:
            speedup = f"{r['tokens_per_s_per_gpu'] / ref['tokens_per_s_per_gpu']:.2f}x"
        mfu = "" if r.get("mfu") is None else f"{100 * r['mfu']:.1f}%"
        lines.append(
            f"| {r['variant']} | {r['kind']} | {r['status']} | {c.get('comm', '')} | {_kernels(c)} | "
            f"{c.get('precision', '')} | {c.get('ep', '')} | {_num(r['tokens_per_s_per_gpu'], ',.0f')} | {speedup} | "
            f"{_num(r['tflops_per_gpu'], '.1f')} | {mfu} | {_num(r['peak_mem_gib'], '.1f')} | "
            f"{_num(r['peak_reserved_gib'], '.1f')} | {_num(r.get('wall_s'), '.0f')} | {_num(r['final_loss'], '.4f')} | "
            f"{_num(r.get('max_loss_diff_vs_baseline'), '.2e')} | {_num(r.get('max_loss_rel_diff_vs_reference'), '.2%')} |"
        )
    for s in result.get("skipped", []):
        lines.append(f"\nNot run: {s['variant']} ({s['kind']}): {s['reason']}.")
    notes = [f"{r['variant']}: {r['note']}" for r in result["rows"] if r.get("note")]
    if notes:
        lines += ["", *(f"- {n}" for n in notes)]
    lines += ["", "Reproduce:", "", "```", result["command"], "```", ""]
    return "\n".join(lines)


# -- chart ---------------------------------------------------------------------------------------------
def chart(result: dict, path: str) -> None:
    """Two horizontal bar panels: tokens/s per GPU, and peak allocated (solid) / reserved (outline) GiB; a
    third with every row's loss curve when the runs are long enough (10 steps or more) to compare them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    names = [r["variant"] for r in rows]
    colors = {"baseline": "#7f7f7f", "moe_tune": "#1f77b4", "peer": "#ff7f0e"}
    ys = list(range(len(rows)))[::-1]
    curves = [r for r in rows if r["status"] == "ok" and len(r.get("losses") or []) >= 10]
    ncols = 3 if curves else 2
    fig, axes = plt.subplots(1, ncols, figsize=(6 * ncols, 1.2 + 0.45 * max(len(rows), 6)))
    ax1, ax2 = axes[0], axes[1]
    for y, r in zip(ys, rows):
        ok = r["status"] == "ok"
        color = colors.get(r["kind"], "#2ca02c")
        tps = r["tokens_per_s_per_gpu"] or 0.0
        ax1.barh(y, tps if ok else 0, color=color)
        ax1.text(tps if ok else 0, y, f" {tps:,.0f}" if ok else f" {r['status'][:40]}", va="center", fontsize=8)
        alloc, reserved = r["peak_mem_gib"] or 0.0, r["peak_reserved_gib"] or 0.0
        if ok:
            ax2.barh(y, reserved, color="none", edgecolor=color)
            ax2.barh(y, alloc, color=color)
        ax2.text(alloc if ok else 0, y, f" {alloc:.1f}" if ok else " -", va="center", fontsize=8)
    ax1.set_yticks(ys, names)
    ax2.set_yticks(ys, [])
    if curves:
        for r in curves:
            axes[2].plot(range(1, len(r["losses"]) + 1), r["losses"], label=r["variant"], linewidth=1)
        axes[2].set_xlabel("step")
        axes[2].set_ylabel("loss")
        axes[2].set_yscale("log")
        axes[2].legend(fontsize=7)
        axes[2].grid(alpha=0.3)
    ax1.set_xlabel("tokens/s per GPU (median)")
    ax2.set_xlabel("peak memory per GPU, GiB (solid: allocated, outline: reserved)")
    for ax in (ax1, ax2):
        ax.margins(x=0.25)
        ax.grid(axis="x", alpha=0.3)
    w = result["workload"]
    fig.suptitle(
        f"{w['model']} ({w['num_layers']} layers), seq {w['seq_len']}, micro-batch {w['micro_batch_size']}, "
        f"{w['precision']}, routing {w['routing']}: {result['hardware']}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(result: dict, json_path: str) -> tuple[str, str]:
    """Write ``<stem>.md`` and ``<stem>.png`` next to ``json_path``; returns their paths."""
    stem = os.path.splitext(json_path)[0]
    with open(stem + ".md", "w") as f:
        f.write(markdown(result))
    chart(result, stem + ".png")
    return stem + ".md", stem + ".png"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_tune.bench.report", description="re-render a bench result")
    parser.add_argument("json_path", nargs="+")
    args = parser.parse_args(argv)
    for path in args.json_path:
        with open(path) as f:
            print(*write_report(json.load(f), path))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

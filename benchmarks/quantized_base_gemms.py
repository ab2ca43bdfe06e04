"""The quantized base's expert GEMMs one by one against bf16 (issue 34): where ``peft.quantize_base`` spends its time.

Qwen3-30B-A3B's routed experts (128 experts, hidden 2048, expert hidden 768: gate_up [1536, 2048], down [2048, 768])
on 32,768 routed rows (4,096 tokens x top-8), counts from a skewed router (fp8_experts_h200.py's "real-ish": a few
hot experts, a long cold tail). For each weight and direction (forward ``x @ W^T``, input gradient ``dy @ W``):
bf16 ``grouped_mm``; ``fp8`` and ``nf4`` through their custom ops with ``kernels.quantized_base=torch`` and
``=triton``; and the pieces of the torch paths (activation quantization, the FP8 weight's transposed copy, NF4's
dequantization of all experts). Median of 30 timed calls after 5 of warm-up, CUDA events around each; a row whose
kernel fails says so and the rest still run.

    python benchmarks/quantized_base_gemms.py OUT_DIR     ->  OUT_DIR/quantized_base_gemms.{json,md}
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from fp8_experts_h200 import ROWS, E, counts_for
from fp8_experts_h200 import _median_ms as median_ms

from moe_tune.kernels import fp8_frozen, nf4_frozen

WEIGHTS = {"gate_up": (1536, 2048), "down": (2048, 768)}  # [N, K] as stored


def offsets() -> torch.Tensor:
    return counts_for("real").cumsum(0).to(torch.int32).cuda()


def _with_nf4(fn, **settings):
    """``fn`` run with ``nf4_frozen``'s module settings (``DEQUANT_BUDGET_BYTES``, ``DEQUANT_JOINED``) set as given."""

    def run():
        kept = {name: getattr(nf4_frozen, name) for name in settings}
        for name, value in settings.items():
            setattr(nf4_frozen, name, value)
        try:
            return fn()
        finally:
            for name, value in kept.items():
                setattr(nf4_frozen, name, value)

    return run


def cases(N: int, K: int, offs: torch.Tensor) -> dict:
    """name -> (zero-argument call, FLOPs or 0 for a piece that is no GEMM)."""
    w = torch.randn(E, N, K, device="cuda") / K**0.5
    wb = w.bfloat16()
    q, s = fp8_frozen.quantize_weight(w)
    codes, scales = nf4_frozen.quantize_weight(w)
    x = torch.randn(ROWS, K, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(ROWS, N, device="cuda", dtype=torch.bfloat16)
    flop = 2 * ROWS * N * K
    rows = {
        "bf16 forward": (lambda: F.grouped_mm(x, wb.transpose(-2, -1), offs=offs), flop),
        "bf16 input gradient": (lambda: F.grouped_mm(dy, wb, offs=offs), flop),
    }
    for triton in (False, True):
        tag = "triton" if triton else "torch"
        rows[f"fp8 forward ({tag})"] = (lambda t=triton: fp8_frozen.frozen_fp8_grouped_mm(x, q, s, offs, t), flop)
        rows[f"fp8 input gradient ({tag})"] = (
            lambda t=triton: fp8_frozen.frozen_fp8_input_grad(dy, q, s, offs, t),
            flop,
        )
        rows[f"nf4 forward ({tag})"] = (
            lambda t=triton: nf4_frozen.frozen_nf4_grouped_mm(x, codes, scales, offs, t),
            flop,
        )
        rows[f"nf4 input gradient ({tag})"] = (
            lambda t=triton: nf4_frozen.frozen_nf4_input_grad(dy, codes, scales, offs, t),
            flop,
        )
    # The torch path as the H200/H100 rows ran it: passes of 32 experts, the group offsets read on the host per GEMM.
    rows["nf4 forward (torch, passes of 32 experts)"] = (
        _with_nf4(
            lambda: nf4_frozen.frozen_nf4_grouped_mm(x, codes, scales, offs), DEQUANT_BUDGET_BYTES=32 * N * K * 2
        ),
        flop,
    )
    rows["piece: fp8 quantize x per row"] = (lambda: fp8_frozen.quantize_activation_rows(x), 0)
    rows["piece: fp8 weight transposed copy (torch)"] = (lambda: fp8_frozen.transpose_experts(q, False), 0)
    rows["piece: fp8 weight transposed copy (triton)"] = (lambda: fp8_frozen.transpose_experts(q, True), 0)
    rows["piece: nf4 dequantize all experts"] = (
        lambda: nf4_frozen.dequantize_weight(codes, scales, torch.bfloat16),
        0,
    )
    rows["piece: nf4 dequantize all experts (one joined store)"] = (
        _with_nf4(lambda: nf4_frozen.dequantize_weight(codes, scales, torch.bfloat16), DEQUANT_JOINED=True),
        0,
    )
    return rows


def main() -> None:
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
    os.makedirs(out_dir, exist_ok=True)
    offs = offsets()
    results = []
    for weight, (N, K) in WEIGHTS.items():
        for name, (fn, flop) in cases(N, K, offs).items():
            try:
                ms, error = median_ms(fn), None
            except Exception as e:  # a kernel that fails to compile or run: the row says so, the rest still run
                ms, error = None, f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            tflops = flop / ms / 1e9 if ms and flop else None
            results.append({"weight": weight, "N": N, "K": K, "case": name, "ms": ms, "tflops": tflops, "error": error})
            shown = f"{ms:8.3f} ms" + (f" {tflops:6.0f} TFLOP/s" if tflops else "") if ms else error
            print(f"{weight:8s} {name:36s} {shown}", flush=True)
    meta = {
        "commit": os.environ.get("MOE_TUNE_COMMIT", "unknown"),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "rows": ROWS,
        "experts": E,
        "routing": "skewed (fp8_experts_h200.py real-ish counts)",
    }
    with open(os.path.join(out_dir, "quantized_base_gemms.json"), "w") as f:
        json.dump({**meta, "results": results}, f, indent=1)
    lines = [
        f"# Quantized base, expert GEMMs one by one: {meta['gpu']}, commit {meta['commit']}, torch {meta['torch']}",
        "",
        f"{ROWS} routed rows, {E} experts, {meta['routing']}; median of 30 calls after 5 of warm-up.",
        "",
        "| weight | case | ms | TFLOP/s |",
        "|---|---|---:|---:|",
    ]
    for r in results:
        ms = f"{r['ms']:.3f}" if r["ms"] is not None else r["error"]
        lines.append(
            f"| {r['weight']} | {r['case']} | {ms} | {r['tflops']:.0f} |"
            if r["tflops"]
            else f"| {r['weight']} | {r['case']} | {ms} | |"
        )
    with open(os.path.join(out_dir, "quantized_base_gemms.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

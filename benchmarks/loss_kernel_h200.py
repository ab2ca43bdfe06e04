"""The chunked linear cross-entropy on one GPU: Triton kernel against PyTorch's ops, at the lm_head of the
Qwen3-30B-A3B workload (hidden 2048, vocab 151,936, bf16), for micro-batch 1 and 4 at seq 4096 (4,096 and 16,384
rows; chunks of 4,096). Forward + backward of the loss alone, median ms of 20 after 3 warm-up runs, and the peak
memory the loss adds over its inputs.

    python benchmarks/loss_kernel_h200.py --out <dir>      # writes loss_kernel.json and loss_kernel.md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from moe_tune.env.report import versions
from moe_tune.kernels.loss import linear_cross_entropy
from moe_tune.run_record import git_commit, hardware_name

D, V = 2048, 151_936


def time_loss(rows: int, triton: bool, repeats: int = 20) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(rows, D, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (torch.randn(V, D, device="cuda", generator=g) / 32).bfloat16().requires_grad_()
    labels = torch.randint(0, V, (rows,), device="cuda", generator=g)

    def step():
        h.grad = w.grad = None
        loss = linear_cross_entropy(h, w, labels, triton=triton)
        loss.backward()
        return loss

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    return {
        "rows": rows,
        "kernel": "triton" if triton else "pytorch_ops",
        "ms": statistics.median(times),
        "peak_added_gib": peak,
        "loss": loss.item() / rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = parser.parse_args().out
    os.makedirs(out, exist_ok=True)
    rows = [time_loss(n, triton) for n in (4096, 16384) for triton in (False, True)]
    data = {
        "commit": git_commit(),
        "hardware": hardware_name(1, torch.device("cuda")),
        "versions": versions(),
        "shapes": {"hidden": D, "vocab": V, "chunk_rows": 4096},
        "rows": rows,
    }
    with open(os.path.join(out, "loss_kernel.json"), "w") as f:
        json.dump(data, f, indent=2)
    lines = ["| rows | kernel | ms (fwd + bwd) | peak GiB added | loss / row |", "|---:|---|---:|---:|---:|"]
    lines += [
        f"| {r['rows']} | {r['kernel']} | {r['ms']:.2f} | {r['peak_added_gib']:.2f} | {r['loss']:.4f} |" for r in rows
    ]
    with open(os.path.join(out, "loss_kernel.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

"""Optimizer step on the 8-layer Qwen3-30B-A3B bf16 parameter shapes: torch's fused AdamW, CompiledAdamW (Triton,
round to nearest), stochastic rounding with its Triton kernel (bits drawn inside), and stochastic rounding eager
(torch.randint bits, optim.compiled=false); median ms per step after warm-up and the bandwidth of p, g, m, v."""

import sys

sys.path.insert(0, ".gpu/calls")  # sr_common.py, beside this file here
import torch  # noqa: E402
from sr_common import shapes, timed  # noqa: E402

from moe_tune.optim.adamw import CompiledAdamW  # noqa: E402
from moe_tune.optim.stochastic import StochasticRoundingAdamW  # noqa: E402

ps = [torch.nn.Parameter(torch.randn(s, device="cuda", dtype=torch.bfloat16) * 0.02) for s in shapes(8)]
for p in ps:
    p.grad = torch.randn_like(p) * 1e-3
n = sum(p.numel() for p in ps)
moved = n * 2 * 7
rows = [
    ("torch fused AdamW", lambda q: torch.optim.AdamW(q, lr=1e-4, betas=(0.9, 0.95), fused=True)),
    ("CompiledAdamW (nearest)", lambda q: CompiledAdamW(q, lr=1e-4, betas=(0.9, 0.95))),
    ("stochastic rounding, Triton", lambda q: StochasticRoundingAdamW(q, lr=1e-4, betas=(0.9, 0.95))),
    ("stochastic rounding, eager", lambda q: StochasticRoundingAdamW(q, lr=1e-4, betas=(0.9, 0.95), compiled=False)),
]
print(f"bf16, {n / 1e9:.2f} B parameters, 14 bytes per parameter moved by the update")
print("| optimizer | ms per step | TB/s (14 B/param) |\n|---|---:|---:|")
for name, make in rows:
    t = timed(make, ps)
    print(f"| {name} | {t:.2f} | {moved / t / 1e9:.2f} |", flush=True)

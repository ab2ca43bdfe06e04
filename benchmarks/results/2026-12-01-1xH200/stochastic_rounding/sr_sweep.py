"""The stochastic-rounding kernel's block size and warps on the 8-layer bf16 shapes (median ms per step)."""

import sys

sys.path.insert(0, ".gpu/calls")
import torch  # noqa: E402
from sr_common import shapes, timed  # noqa: E402

from moe_tune.optim import kernels  # noqa: E402
from moe_tune.optim.adamw import CompiledAdamW  # noqa: E402
from moe_tune.optim.stochastic import StochasticRoundingAdamW  # noqa: E402

ps = [torch.nn.Parameter(torch.randn(s, device="cuda", dtype=torch.bfloat16) * 0.02) for s in shapes(8)]
for p in ps:
    p.grad = torch.randn_like(p) * 1e-3
n = sum(p.numel() for p in ps)
print("| kernel | BLOCK | warps | ms per step | TB/s (14 B/param) |\n|---|---:|---:|---:|---:|")
t = timed(lambda q: CompiledAdamW(q, lr=1e-4, betas=(0.9, 0.95)), ps)
print(f"| nearest | 4096 | 8 | {t:.2f} | {n * 14 / t / 1e9:.2f} |", flush=True)
for block, warps in ((4096, 8), (2048, 8), (2048, 4), (1024, 4), (1024, 8), (512, 4), (8192, 8), (4096, 16)):
    kernels.STOCHASTIC_BLOCK, kernels.STOCHASTIC_WARPS = block, warps
    t = timed(lambda q: StochasticRoundingAdamW(q, lr=1e-4, betas=(0.9, 0.95)), ps)
    print(f"| stochastic | {block} | {warps} | {t:.2f} | {n * 14 / t / 1e9:.2f} |", flush=True)

"""Which CUDA runtime calls in CompiledAdamW.step block the host (profiler's runtime events, with stacks)."""

import torch
from torch.profiler import ProfilerActivity, profile

from moe_tune.optim.adamw import CompiledAdamW

SYNC = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
ps = [torch.nn.Parameter(torch.randn(n, device="cuda", dtype=torch.bfloat16)) for n in (1 << 24, 1000, 4096)]
for variant in ("compiled", "fused"):
    opt = CompiledAdamW(ps, lr=1e-3) if variant == "compiled" else torch.optim.AdamW(ps, lr=1e-3, fused=True)
    for p in ps:
        p.grad = torch.randn_like(p)
    opt.found_inf, opt.grad_scale = torch.zeros((), device="cuda"), torch.ones((), device="cuda")
    for _ in range(3):
        opt.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        for _ in range(2):
            opt.step()
    torch.cuda.synchronize()
    names = [e for e in prof.events() if any(e.name.startswith(s) for s in SYNC)]
    print(f"== {variant}: {len(names)} blocking runtime calls in 2 steps")
    for e in names:
        stack = [s for s in (e.stack or []) if "moe_tune" in s or "torch/" in s][:6]
        print("  ", e.name, " <- ".join(stack))
    calls = sorted({e.name for e in prof.events() if e.name.startswith("cuda")})
    print("   runtime calls:", calls)

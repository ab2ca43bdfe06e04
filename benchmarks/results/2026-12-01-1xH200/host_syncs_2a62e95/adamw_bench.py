"""torch's fused AdamW against moe_tune's CompiledAdamW on the 8-layer Qwen3-30B-A3B parameter shapes (bf16),
and on 4 layers in fp32; median ms per step after warm-up, and the bandwidth that implies."""

import statistics

import torch

from moe_tune.optim.adamw import CompiledAdamW


def shapes(layers):
    per = [
        (4096, 2048),
        (512, 2048),
        (512, 2048),
        (2048, 4096),
        (128,),
        (128,),
        (2048,),
        (2048,),
        (128, 2048),
        (128, 1536, 2048),
        (128, 2048, 768),
    ]
    return [(151936, 2048), *[s for _ in range(layers) for s in per], (2048,), (151936, 2048)]


def timed(make, params, steps=12, warm=3):
    opt = make(params)
    opt.found_inf = torch.zeros((), device="cuda")
    opt.grad_scale = torch.ones((), device="cuda")
    times = []
    for i in range(steps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        opt.step()
        b.record()
        torch.cuda.synchronize()
        if i >= warm:
            times.append(a.elapsed_time(b))
    del opt
    torch.cuda.empty_cache()
    return statistics.median(times)


for dtype, layers in ((torch.bfloat16, 8), (torch.float32, 4)):
    ps = [torch.nn.Parameter(torch.randn(s, device="cuda", dtype=dtype) * 0.02) for s in shapes(layers)]
    for p in ps:
        p.grad = torch.randn_like(p) * 1e-3
    n = sum(p.numel() for p in ps)
    moved = n * p.element_size() * 7  # read p, g, m, v; write p, m, v
    fused = timed(lambda q: torch.optim.AdamW(q, lr=1e-4, betas=(0.9, 0.95), fused=True), ps)
    comp = timed(lambda q: CompiledAdamW(q, lr=1e-4, betas=(0.9, 0.95)), ps)
    print(
        f"{str(dtype):16s} {n / 1e9:.2f} B params  fused {fused:7.2f} ms ({moved / fused / 1e9:.2f} TB/s)  "
        f"compiled {comp:7.2f} ms ({moved / comp / 1e9:.2f} TB/s)  speed-up {fused / comp:.2f}x",
        flush=True,
    )
    del ps
    torch.cuda.empty_cache()

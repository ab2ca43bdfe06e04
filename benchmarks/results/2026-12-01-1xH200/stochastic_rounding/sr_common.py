import statistics

import torch


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

"""Exploration: how the chunked loss's weight gradient should accumulate, and which chunk size, at hidden 2048,
vocab 151,936 bf16. Variants patch moe_tune.kernels.loss._add_transposed_product."""

import json
import statistics
import sys

import torch

import moe_tune.kernels.loss as L

D, V = 2048, 151_936
orig = L._add_transposed_product


def addmm_new(acc, g, h):  # current: a new fp32 tensor each chunk
    return torch.addmm(acc, g.t(), h, out_dtype=acc.dtype)


def addmm_inplace(acc, g, h):
    return torch.addmm(acc, g.t(), h, out_dtype=acc.dtype, out=acc)


def mm_bf16_add(acc, g, h):
    return acc.add_(g.t() @ h)


VARIANTS = {"addmm_out_dtype": addmm_new, "addmm_out_dtype_inplace": addmm_inplace, "bf16_mm_then_add": mm_bf16_add}


def run(rows, chunk, fn, repeats=15):
    L._add_transposed_product = fn
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(rows, D, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (torch.randn(V, D, device="cuda", generator=g) / 32).bfloat16().requires_grad_()
    labels = torch.randint(0, V, (rows,), device="cuda", generator=g)

    def step():
        h.grad = w.grad = None
        loss = L.linear_cross_entropy(h, w, labels, chunk_size=chunk)
        loss.backward()
        return loss

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    ts = []
    for _ in range(repeats):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        loss = step()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e))
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    # the weight gradient's norm: the variants must agree on it
    gw = w.grad.float()
    return {
        "rows": rows,
        "chunk": chunk,
        "variant": fn.__name__,
        "ms": statistics.median(ts),
        "peak_added_gib": peak,
        "loss": loss.item() / rows,
        "grad_w_norm": gw.norm().item(),
    }


def gemm_alone():
    g = torch.randn(4096, V, device="cuda").bfloat16()
    h = torch.randn(4096, D, device="cuda").bfloat16()
    acc = torch.zeros(V, D, device="cuda")
    out = {}
    for name, fn in [
        ("mm_bf16_out", lambda: g.t() @ h),
        ("addmm_out_dtype", lambda: torch.addmm(acc, g.t(), h, out_dtype=torch.float32)),
        ("addmm_out_dtype_inplace", lambda: torch.addmm(acc, g.t(), h, out_dtype=torch.float32, out=acc)),
        ("mm_out_dtype", lambda: torch.mm(g.t(), h, out_dtype=torch.float32)),
        ("add_bf16_into_fp32", lambda: acc.add_(h.new_empty(V, D))),
    ]:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        ts = []
        for _ in range(10):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            ts.append(s.elapsed_time(e))
        out[name] = statistics.median(ts)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as p:
        torch.addmm(acc, g.t(), h, out_dtype=torch.float32)
        torch.mm(g.t(), h)
        torch.cuda.synchronize()
    print(p.key_averages().table(sort_by="cuda_time_total", row_limit=12))
    return out


if __name__ == "__main__":
    res = {"gemm_alone_ms": gemm_alone(), "rows": []}
    print(json.dumps(res["gemm_alone_ms"], indent=1))
    for rows in (4096, 16384):
        for chunk in sorted({4096, 8192, rows}):
            for fn in VARIANTS.values():
                if chunk >= rows and fn is not addmm_new:
                    continue  # one chunk: no accumulation
                r = run(rows, chunk, fn)
                res["rows"].append(r)
                print(r, flush=True)
                torch.cuda.empty_cache()
    json.dump(res, open(sys.argv[1], "w"), indent=1)

"""Issue 36: ``kernels.experts=grouped_mm_fp8`` under ``torch.compile`` gave input and weight gradients with relative
error 1.0 on an H200 (validation refuses the pair). This bisects where, in one run on one Hopper GPU, comparing
each compiled piece with the same piece in eager mode on the same inputs (Qwen3-30B-A3B's expert dims, uneven
groups, an empty one, padding rows past the last group):

  1. the whole FP8 grouped GEMM (forward, input gradient, weight gradient) under the inductor backend;
  2. the same under ``aot_eager`` (AOTAutograd's graphs run eagerly: no inductor code): if 1 is wrong and 2 right,
     inductor's code is at fault, else the tracing of the autograd.Function;
  3. the quantizations alone under inductor (values and scales, bitwise): ``quantize_rows`` over each axis and
     ``quantize_group_columns`` after ``pad_groups``;
  4. ``torch._scaled_grouped_mm`` alone under inductor, in each of the three layouts the GEMMs use, and whether its
     meta function's output strides (what compiled graphs, aot_eager's too, assume) are the kernel's.

    python benchmarks/fp8_compiled_grad.py [--rows 8192] > <results dir>/fp8_compiled_grad.txt

Prints one line per check: the relative error (or the count of unequal elements) and ok / WRONG against 1e-2
(the FP8 GEMMs' own error is about 5e-2 of bf16's; compiled and eager run the same FP8 arithmetic, so they should
agree far closer than that).
"""

from __future__ import annotations

import argparse

import torch

from moe_tune.kernels import fp8_grouped as f8

TOLERANCE = 1e-2


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()


def report(name: str, error: float) -> None:
    print(f"{name:55s} {error:10.3e}  {'ok' if error < TOLERANCE else 'WRONG'}", flush=True)


def inputs(rows: int, experts: int, K: int, N: int):
    g = torch.Generator(device="cuda").manual_seed(0)
    counts = torch.randint(0, 2 * rows // experts, (experts,), generator=g, device="cuda")
    counts[1] = 0  # an empty group
    counts = (counts * (rows - 16) // counts.sum().clamp(min=1)).clamp(min=0)
    offs = counts.cumsum(0).to(torch.int32)  # the last 16+ rows are a dispatcher's padding
    x = torch.randn(rows, K, device="cuda", generator=g).bfloat16()
    w = (torch.randn(experts, K, N, device="cuda", generator=g) / K**0.5).bfloat16()
    dy = torch.randn(rows, N, device="cuda", generator=g).bfloat16()
    return x, w, offs, dy


def whole(x, w, offs, dy, backend: str | None) -> None:
    def run(fn):
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = fn(xx, ww, offs)
        out.backward(dy)
        return out.detach(), xx.grad, ww.grad

    eager = run(f8.fp8_grouped_mm)
    torch._dynamo.reset()
    compiled = run(torch.compile(f8.fp8_grouped_mm, backend=backend or "inductor"))
    routed = int(offs[-1])  # rows past it are padding, which the GEMMs leave undefined
    for i, (name, rows) in enumerate((("out", routed), ("dx", routed), ("dw", None))):
        report(f"{backend or 'inductor'}: whole FP8 grouped GEMM, {name}", rel(compiled[i][:rows], eager[i][:rows]))


def quantizations(x, w, offs, dy) -> None:
    torch._dynamo.reset()
    cases = {
        "quantize_rows(x) (forward, per token)": lambda: f8.quantize_rows(x),
        "quantize_rows(w^T) (forward, per expert column)": lambda: f8.quantize_rows(w.transpose(-2, -1)),
        "quantize_rows(w) (input gradient, per expert row)": lambda: f8.quantize_rows(w),
        "quantize_rows(dy) (input gradient, per token)": lambda: f8.quantize_rows(dy),
    }
    for name, fn in cases.items():
        (qe, se), (qc, sc) = fn(), torch.compile(fn)()
        unequal = (qe.view(torch.uint8) != qc.view(torch.uint8)).sum().item() + (se != sc).sum().item()
        report(f"inductor: {name}, unequal elements", float(unequal))

    def columns(t):
        dest, group_B, _, P = f8.pad_groups(offs, t.shape[0])
        padded = t.new_zeros(P, t.shape[1]).index_copy_(0, dest, t)
        return f8.quantize_group_columns(padded, group_B, offs.shape[0] + 1)

    (qe, se), (qc, sc) = columns(x), torch.compile(columns)(x)
    unequal = (qe.view(torch.uint8) != qc.view(torch.uint8)).sum().item() + (se != sc).sum().item()
    report("inductor: pad_groups + quantize_group_columns(x), unequal", float(unequal))


def gemms(x, w, offs, dy) -> None:
    xq, sx = f8.quantize_rows(x)
    wq_NK, sw_N = f8.quantize_rows(w.transpose(-2, -1))
    dyq, sdy = f8.quantize_rows(dy)
    wq_KN, sw_K = f8.quantize_rows(w)
    layouts = {
        "forward (2d x 3d)": (xq, wq_NK.transpose(-2, -1), sx, sw_N, offs),
        "input gradient (2d x 3d)": (dyq, wq_KN.transpose(-2, -1), sdy, sw_K, offs),
    }

    def mm(a, b, sa, sb, o):
        return torch._scaled_grouped_mm(a, b, sa, sb, offs=o, out_dtype=torch.bfloat16, use_fast_accum=True)

    seen = []  # the weight gradient's operands, as _weight_grad makes them
    f8._weight_grad(x, dy, offs, lambda *a: seen.append(a[:5]) or mm(*a[:5]), True)
    layouts["weight gradient (2d x 2d)"] = seen[0]
    torch._dynamo.reset()
    for name, args in layouts.items():
        report(f"inductor: _scaled_grouped_mm alone, {name}", rel(torch.compile(mm)(*args), mm(*args)))
        # Compiled graphs (aot_eager too) replay views with the strides the meta function gives: a meta function
        # whose strides differ from the kernel's output would have the real output read wrongly.
        meta = mm(*(torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta") for t in args))
        real = mm(*args)
        print(f"  output strides: kernel {real.stride()}, meta {meta.stride()}", flush=True)
        report(f"_scaled_grouped_mm's meta strides differ, {name}", float(real.stride() != meta.stride()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=8192, help="routed rows (tokens x top-k)")
    args = parser.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        raise SystemExit("fp8_compiled_grad.py: needs a Hopper GPU (torch._scaled_grouped_mm is sm90)")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, rows {args.rows}")
    for K, N in ((2048, 1536), (768, 2048)):  # Qwen3-30B-A3B's gate_up and down
        print(f"-- experts 128, K {K}, N {N}")
        data = inputs(args.rows, 128, K, N)
        whole(*data, None)
        whole(*data, "aot_eager")
        quantizations(*data)
        gemms(*data)


if __name__ == "__main__":
    main()

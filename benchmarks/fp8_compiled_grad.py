"""Issue 36: ``kernels.experts=grouped_mm_fp8`` under ``torch.compile``. As an autograd.Function that dynamo traces,
its compiled input and weight gradients were wrong: relative error 1.0 on an H200 with the kernel in the graph, and
zero on an H100 with the kernel an opaque custom op and only the quantizations traced (bd8ee5d; ``dy`` reaches the
backward as zeros). Its three GEMMs are custom ops with their autograd registered, as the frozen base's are; those
compile to eager's results. This checks them and bisects the old failure, in one run on one Hopper GPU, comparing
each compiled piece with the same piece in eager mode on the same inputs (Qwen3-30B-A3B's expert dims, uneven
groups, an empty one, padding rows past the last group):

  1. ``fp8_grouped_mm`` (the custom ops) under inductor and under ``aot_eager``: expected equal;
  2. ``Traced``, the old autograd.Function over the same pieces, under inductor and ``aot_eager`` (AOTAutograd's
     graphs run eagerly: no inductor code): the minimal reproduction (gradients zero);
  3. the quantizations alone under inductor (values and scales, bitwise): ``quantize_rows`` over each axis and
     ``quantize_group_columns`` after ``pad_groups``;
  4. ``torch._scaled_grouped_mm`` alone under inductor and aot_eager, in each of the three layouts the GEMMs use,
     and whether its meta function's output strides (what compiled graphs, aot_eager's too, assume) are the kernel's.

    python benchmarks/fp8_compiled_grad.py [--rows 8192] > <results dir>/fp8_compiled_grad.txt

Prints one line per check: the relative error (or the count of unequal elements) and ok / WRONG against 1e-2
(the FP8 GEMMs' own error is about 5e-2 of bf16's; compiled and eager run the same FP8 arithmetic, so they should
agree far closer than that).
"""

from __future__ import annotations

import argparse
import itertools

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


class Traced(torch.autograd.Function):
    """The GEMMs as they were when compiled gradients came out wrong: the same pieces, traced through by dynamo."""

    @staticmethod
    def forward(ctx, x_RK, w_eKN, offs_e):
        ctx.save_for_backward(x_RK, w_eKN, offs_e)
        xq_RK, sx_R = f8.quantize_rows(x_RK)
        wq_eNK, sw_eN = f8.quantize_rows(w_eKN.transpose(-2, -1))
        return f8.scaled_grouped_mm(xq_RK, wq_eNK.transpose(-2, -1), sx_R, sw_eN, offs_e, True).to(x_RK.dtype)

    @staticmethod
    def backward(ctx, dy_RN):
        x_RK, w_eKN, offs_e = ctx.saved_tensors
        dyq_RN, sdy_R = f8.quantize_rows(dy_RN)
        wq_eKN, sw_eK = f8.quantize_rows(w_eKN)
        dx = f8.scaled_grouped_mm(dyq_RN, wq_eKN.transpose(-2, -1), sdy_R, sw_eK, offs_e, True).to(x_RK.dtype)
        return dx, weight_grad_traced(x_RK, dy_RN, offs_e).to(w_eKN.dtype), None


def weight_grad_traced(x_RK, dy_RN, offs_e, mm=None):
    """The old weight gradient: ``fp8_weight_grad``'s steps, returning the kernel output's transposed view."""
    e, R = offs_e.shape[0], x_RK.shape[0]
    dest_R, group_B, padded_offs_e, P = f8.pad_groups(offs_e, R)
    x_PK = x_RK.new_zeros(P, x_RK.shape[1]).index_copy_(0, dest_R, x_RK)
    dy_PN = dy_RN.new_zeros(P, dy_RN.shape[1]).index_copy_(0, dest_R, dy_RN)
    xq_PK, sx_GK = f8.quantize_group_columns(x_PK, group_B, e + 1)
    dyq_PN, sdy_GN = f8.quantize_group_columns(dy_PN, group_B, e + 1)
    args = (dyq_PN.t().contiguous(), xq_PK.t().contiguous().t(), sdy_GN[:e].contiguous().view(-1))
    args = (*args, sx_GK[:e].contiguous().view(-1), padded_offs_e)
    return (mm or (lambda *a: f8.scaled_grouped_mm(*a, True)))(*args).transpose(-2, -1)


def whole(x, w, offs, dy, backend: str, fn=f8.fp8_grouped_mm, label="fp8_grouped_mm (custom ops)") -> None:
    def run(f):
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = f(xx, ww, offs)
        out.backward(dy)
        return out.detach(), xx.grad, ww.grad

    eager = run(fn)
    torch._dynamo.reset()
    compiled = run(torch.compile(fn, backend=backend))
    routed = int(offs[-1])  # rows past it are padding, which the GEMMs leave undefined
    for i, (name, rows) in enumerate((("out", routed), ("dx", routed), ("dw", None))):
        report(f"{backend}: {label}, {name}", rel(compiled[i][:rows], eager[i][:rows]))


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

    seen = []  # the weight gradient's operands, as fp8_weight_grad makes them
    weight_grad_traced(x, dy, offs, lambda *a: seen.append(a) or mm(*a))
    layouts["weight gradient (2d x 2d)"] = seen[0]
    routed = int(offs[-1])  # 2d x 3d: rows past it are padding, which the kernel leaves undefined
    for name, args in layouts.items():
        rows = None if "2d x 2d" in name else routed
        for backend in ("inductor", "aot_eager"):
            torch._dynamo.reset()
            compiled = torch.compile(mm, backend=backend)(*args)
            report(f"{backend}: _scaled_grouped_mm alone, {name}", rel(compiled[:rows], mm(*args)[:rows]))
        # Compiled graphs (aot_eager too) replay views with the strides the meta function gives: a meta function
        # whose strides differ from the kernel's output would have the real output read wrongly.
        meta = mm(*(torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta") for t in args))
        real = mm(*args)
        print(f"  output strides: kernel {real.stride()}, meta {meta.stride()}", flush=True)
        report(f"_scaled_grouped_mm's meta strides differ, {name}", float(real.stride() != meta.stride()))


def bisect_function(fp8_forward: bool, fp8_backward: bool, cast: bool) -> type[torch.autograd.Function]:
    """An autograd.Function over the forward and input-gradient GEMMs, each in FP8 (``Traced``'s pieces) or bf16
    (``F.grouped_mm``); ``cast``: the output goes through ``.to(x.dtype)`` (a no-op alias: it is bf16 already), as
    ``Traced``'s does, else it is returned as the GEMM made it. No weight gradient."""

    def gemm(fp8: bool, a_RC, b_eCD, offs_e):
        if not fp8:
            return torch.nn.functional.grouped_mm(a_RC, b_eCD, offs=offs_e)
        aq_RC, sa_R = f8.quantize_rows(a_RC)
        bq_eDC, sb_eD = f8.quantize_rows(b_eCD.transpose(-2, -1))
        return f8.scaled_grouped_mm(aq_RC, bq_eDC.transpose(-2, -1), sa_R, sb_eD, offs_e, True)

    class Bisect(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x_RK, w_eKN, offs_e):
            ctx.save_for_backward(w_eKN, offs_e)
            out = gemm(fp8_forward, x_RK, w_eKN, offs_e)
            return out.to(x_RK.dtype) if cast else out

        @staticmethod
        def backward(ctx, dy_RN):
            w_eKN, offs_e = ctx.saved_tensors
            return gemm(fp8_backward, dy_RN, w_eKN.transpose(-2, -1), offs_e), None, None

    return Bisect


def bisect(x, w, offs, dy) -> None:
    """Which part of ``Traced`` the zero compiled gradient needs: the input gradient of each variant, compiled
    (aot_eager, then inductor) against eager, and whether the compiled one is all zeros."""
    routed = int(offs[-1])
    for fp8_forward, fp8_backward, cast in itertools.product((True, False), (True, False), (True, False)):
        fn = bisect_function(fp8_forward, fp8_backward, cast).apply
        label = f"forward {'fp8' if fp8_forward else 'bf16'}, backward {'fp8' if fp8_backward else 'bf16'}"
        label += ", .to(dtype)" if cast else ", returned as made"
        for backend in ("eager", "aot_eager", "inductor"):
            torch._dynamo.reset()
            xx = x.clone().requires_grad_()
            (fn if backend == "eager" else torch.compile(fn, backend=backend))(xx, w, offs).backward(dy)
            if backend == "eager":
                eager = xx.grad[:routed]
                continue
            zero = " (all zero)" if not xx.grad[:routed].any() else ""
            report(f"{backend}: {label}: dx{zero}", rel(xx.grad[:routed], eager))


def minimal_function(op: str, ret: str) -> type[torch.autograd.Function]:
    """The bisection's failing case with nothing of FP8 left: one bf16 GEMM each way (``mm``: the first expert's
    weight for every row; ``grouped_mm``: ``F.grouped_mm`` over the groups), the output returned through ``ret``
    (``to``: ``.to(x.dtype)``, a no-op alias; ``view_as``: an explicit view; ``made``: as the GEMM made it)."""

    def gemm(a_RC, b_eCD, offs_e):
        if op == "mm":
            return a_RC @ b_eCD[0]
        return torch.nn.functional.grouped_mm(a_RC, b_eCD, offs=offs_e)

    class Minimal(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x_RK, w_eKN, offs_e):
            ctx.save_for_backward(w_eKN, offs_e)
            out = gemm(x_RK, w_eKN, offs_e)
            return {"to": lambda t: t.to(x_RK.dtype), "view_as": lambda t: t.view_as(t), "made": lambda t: t}[ret](out)

        @staticmethod
        def backward(ctx, dy_RN):
            w_eKN, offs_e = ctx.saved_tensors
            return gemm(dy_RN, w_eKN.transpose(-2, -1), offs_e), None, None

    return Minimal


def minimal(x, w, offs, dy) -> None:
    """The smallest case that still gives a zero compiled input gradient, for the upstream report: which GEMM
    (mm, grouped_mm) and which return (alias or not) it needs, under aot_eager (no inductor code)."""
    routed = int(offs[-1])
    for op, ret in itertools.product(("mm", "grouped_mm"), ("to", "view_as", "made")):
        results = {}
        for backend in ("eager", "aot_eager"):
            torch._dynamo.reset()
            xx = x.clone().requires_grad_()
            fn = minimal_function(op, ret).apply
            (fn if backend == "eager" else torch.compile(fn, backend=backend))(xx, w, offs).backward(dy)
            results[backend] = xx.grad[:routed]
        zero = " (all zero)" if not results["aot_eager"].any() else ""
        report(f"aot_eager: {op}, return {ret}: dx{zero}", rel(results["aot_eager"], results["eager"]))


def log_kernel_inputs(x, w, offs, dy) -> None:
    """What the opaque kernel receives, eager then compiled (aot_eager), call by call: the op's body runs eagerly
    inside compiled graphs too, so a wrong operand in the compiled backward shows here."""

    def summary(t: torch.Tensor) -> str:
        head = t.flatten()[:3].tolist() if t.dtype in (torch.int32, torch.int64) else f"{t.float().abs().sum():.4e}"
        return f"{tuple(t.shape)}{tuple(t.stride())} {str(t.dtype)[6:]} {head}"

    real = f8._kernel

    def logged(emulate):
        def kernel(a, b, sa, sb, o, fast_accum):
            out = real(emulate)(a, b, sa, sb, o, fast_accum)
            names = ("a", "b", "scale_a", "scale_b", "offs", "out")
            print("   ", "; ".join(f"{n} {summary(t)}" for n, t in zip(names, (a, b, sa, sb, o, out))), flush=True)
            return out

        return kernel

    f8._kernel = logged
    try:
        for backend in ("eager", "aot_eager"):
            print(f"-- kernel inputs, {backend}", flush=True)
            torch._dynamo.reset()
            fn = f8.fp8_grouped_mm if backend == "eager" else torch.compile(f8.fp8_grouped_mm, backend=backend)
            xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
            fn(xx, ww, offs).backward(dy)
            print(f"    grads: dx {summary(xx.grad)}; dw {summary(ww.grad)}", flush=True)
    finally:
        f8._kernel = real


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=8192, help="routed rows (tokens x top-k)")
    parser.add_argument("--bisect", action="store_true", help="only bisect the zero compiled gradient")
    parser.add_argument("--minimal", action="store_true", help="only the bf16 reduction of the zero gradient")
    parser.add_argument(
        "--log-kernel-inputs", action="store_true", help="only log the kernel's operands per call, eager and compiled"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        raise SystemExit("fp8_compiled_grad.py: needs a Hopper GPU (torch._scaled_grouped_mm is sm90)")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, rows {args.rows}")
    if args.log_kernel_inputs:
        return log_kernel_inputs(*inputs(args.rows, 128, 2048, 1536))
    if args.minimal:
        return minimal(*inputs(args.rows, 128, 2048, 1536))
    if args.bisect:
        return bisect(*inputs(args.rows, 128, 2048, 1536))
    for K, N in ((2048, 1536), (768, 2048)):  # Qwen3-30B-A3B's gate_up and down
        print(f"-- experts 128, K {K}, N {N}")
        data = inputs(args.rows, 128, K, N)
        for backend in ("inductor", "aot_eager"):
            whole(*data, backend)
            whole(*data, backend, Traced.apply, "Traced (the old autograd.Function)")
        quantizations(*data)
        gemms(*data)


if __name__ == "__main__":
    main()

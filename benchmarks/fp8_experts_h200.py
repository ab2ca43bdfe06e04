"""kernels.experts=grouped_mm_fp8 against bf16 grouped_mm on one H200 (issue 14, item 5).

    python benchmarks/fp8_experts_h200.py check OUT_DIR          the CUDA kernel against bf16 and the emulation
    python benchmarks/fp8_experts_h200.py micro OUT_DIR          (a) one experts block, Qwen3-30B-A3B shapes
    bash: python -m moe_tune.bench ... --out OUT_DIR/train       (b) training rows (all of it: RESULTS_DIR/command.txt)
    python benchmarks/fp8_experts_h200.py report OUT_DIR RESULTS_DIR   JSON + Markdown + PNG

(a) 128 experts, dim 2048, expert hidden 768: gate_up 2048 -> 1536, SwiGLU, down 768 -> 2048, on 32768 routed
rows (4096 tokens x top-8), counts drawn from a skewed router ("real-ish": a few hot experts, some near-empty)
and balanced (256 each). Forward + backward of the block (both weight gradients and the input gradient), median
of 30 timed iterations after 5 of warm-up, CUDA events around each. FLOP = 3 GEMMs (fprop, dgrad, wgrad) x 2 x
rows x (2048 x 1536 + 768 x 2048); TFLOP/s = FLOP / median time.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from moe_tune.kernels.fp8_grouped import fp8_grouped_mm, quantize_rows, scaled_grouped_mm

E, D, I, ROWS = 128, 2048, 768, 32768  # noqa: E741 (I: expert hidden dim, the moe/ legend)
FLOP = 3 * 2 * ROWS * (D * 2 * I + I * D)


def _rel_err(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def counts_for(kind: str) -> torch.Tensor:
    if kind == "balanced":
        return torch.full((E,), ROWS // E, dtype=torch.int64)
    g = torch.Generator().manual_seed(0)
    popularity = torch.softmax(1.5 * torch.randn(E, generator=g), 0)  # a few hot experts, a long cold tail
    ids = torch.multinomial(popularity, ROWS, replacement=True, generator=g)
    return torch.bincount(ids, minlength=E)


def _bf16_mm(x, w, offs):
    return F.grouped_mm(x, w, offs=offs)


def _block(mm):
    def run(x_RD, w1_eDI2, w2_eID, offs_e, dy_RD):
        h = mm(x_RD, w1_eDI2, offs_e)
        gate, up = h.chunk(2, dim=-1)
        y = mm(F.silu(gate) * up, w2_eID, offs_e)
        y.backward(dy_RD)

    return run


def _operands(counts: torch.Tensor):
    g = torch.Generator().manual_seed(1)
    dev, bf16 = "cuda", torch.bfloat16
    x = torch.randn(ROWS, D, generator=g).to(dev, bf16).requires_grad_()
    # Stored as Hugging Face's "out_in" weights and read transposed, as GroupedExperts does.
    w1 = (torch.randn(E, 2 * I, D, generator=g) / D**0.5).to(dev, bf16).requires_grad_()
    w2 = (torch.randn(E, D, I, generator=g) / I**0.5).to(dev, bf16).requires_grad_()
    dy = torch.randn(ROWS, D, generator=g).to(dev, bf16)
    offs = counts.cumsum(0).to(dev, torch.int32)
    return x, w1, w2, offs, dy


def _median_ms(fn, warmup: int = 5, iters: int = 30) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def check(out_dir: str) -> dict:
    """The CUDA kernel (exact accumulation) against the emulation on the same quantized operands, and against
    bf16 grouped_mm, forward and the three gradients, with uneven groups, an empty one and a 15-row one."""
    results = {}
    for name, counts in (("uneven_empty", [200, 0, 15, 1000, 33]), ("qwen3_real", counts_for("real").tolist())):
        g = torch.Generator().manual_seed(2)
        k, n = (256, 128) if name != "qwen3_real" else (D, 2 * I)
        rows = sum(counts)
        x = torch.randn(rows, k, generator=g).cuda().bfloat16()
        w = (torch.randn(len(counts), n, k, generator=g) / k**0.5).cuda().bfloat16().transpose(-2, -1)
        dy = torch.randn(rows, n, generator=g).cuda().bfloat16()
        offs = torch.tensor(counts).cumsum(0).cuda().to(torch.int32)
        outs = {}
        for label, mm in (
            ("cuda", lambda a, b, o: fp8_grouped_mm(a, b, o, fast_accum=False)),
            ("cuda_fast_accum", fp8_grouped_mm),
            ("emulated", lambda a, b, o: fp8_grouped_mm(a, b, o, emulate=True)),
            ("bf16", _bf16_mm),
        ):
            xi, wi = x.clone().requires_grad_(), w.detach().clone().requires_grad_()
            try:
                y = mm(xi, wi, offs)
                y.backward(dy)
                outs[label] = (y, xi.grad, wi.grad)
            except Exception as e:  # report and go on: layouts are finicky
                print(f"[check] {name} {label}: {type(e).__name__}: {str(e).splitlines()[0]}", flush=True)
        errs = {}
        for a, b in (("cuda", "bf16"), ("cuda_fast_accum", "bf16"), ("cuda", "emulated"), ("emulated", "bf16")):
            if a in outs and b in outs:
                errs[f"{a}_vs_{b}"] = {t: _rel_err(p, q) for t, p, q in zip(("y", "dx", "dw"), outs[a], outs[b])}
        results[name] = errs
        print(f"[check] {name}: {json.dumps(errs)}", flush=True)
    _write(out_dir, "check.json", results)
    return results


def compiled(out_dir: str) -> dict:
    """fp8_grouped_mm under torch.compile against eager, on the same inputs: y, dx, dw relative errors, with
    inductor and with the aot_eager backend (tracing alone, no code generation), to locate a difference."""
    counts = [200, 0, 15, 1000, 33]
    g = torch.Generator().manual_seed(2)
    x = torch.randn(sum(counts), 256, generator=g).cuda().bfloat16()
    w = (torch.randn(len(counts), 128, 256, generator=g) / 16).cuda().bfloat16()
    dy = torch.randn(sum(counts), 128, generator=g).cuda().bfloat16()
    offs = torch.tensor(counts).cumsum(0).cuda().to(torch.int32)

    def f(a, b):
        return fp8_grouped_mm(a, b.transpose(-2, -1), offs)

    def run(fn):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fn(xi, wi)
        y.backward(dy)
        return y, xi.grad, wi.grad

    eager = run(f)
    results = {}
    for backend in ("aot_eager", "inductor"):
        try:
            got = run(torch.compile(f, backend=backend, fullgraph=False))
            results[backend] = {t: _rel_err(a, b) for t, a, b in zip(("y", "dx", "dw"), got, eager)}
        except Exception as e:
            results[backend] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        print(f"[compiled] {backend}: {results[backend]}", flush=True)
    _write(out_dir, "compiled.json", results)
    return results


def micro(out_dir: str) -> dict:
    rows = []
    for routing in ("real", "balanced"):
        counts = counts_for(routing)
        x, w1, w2, offs, dy = _operands(counts)
        w1_KN, w2_KN = w1.transpose(-2, -1), w2.transpose(-2, -1)
        fp8_exact = _block(lambda a, b, o: fp8_grouped_mm(a, b, o, fast_accum=False))
        variants = {
            "bf16_grouped_mm": _block(_bf16_mm),
            "fp8": _block(fp8_grouped_mm),
            "fp8_exact_accum": fp8_exact,
            "fp8_compiled": torch.compile(_block(fp8_grouped_mm)),
            "bf16_compiled": torch.compile(_block(_bf16_mm)),
        }
        for name, fn in variants.items():
            try:
                ms = _median_ms(functools.partial(fn, x, w1_KN, w2_KN, offs, dy))
                rows.append({"routing": routing, "variant": name, "ms": ms, "tflops": FLOP / ms / 1e9})
            except Exception as e:
                rows.append({"routing": routing, "variant": name, "error": f"{type(e).__name__}: {str(e)[:200]}"})
            print(f"[micro] {rows[-1]}", flush=True)
        rows += _gemm_only(routing, x, w1_KN, offs)
    result = {"shapes": {"experts": E, "dim": D, "hidden": I, "rows": ROWS}, "flop_fwd_bwd": FLOP, "rows": rows}
    result["counts_real"] = counts_for("real").tolist()
    _write(out_dir, "micro.json", result)
    return result


def _gemm_only(routing, x, w1_KN, offs) -> list[dict]:
    """The gate_up forward GEMM alone: bf16 against FP8 on operands quantized beforehand, to separate the kernel's
    speed from the quantization's cost."""
    xb, wb = x.detach(), w1_KN.detach()
    xq, sx = quantize_rows(xb)
    wq, sw = quantize_rows(wb.transpose(-2, -1))
    flop = 2 * ROWS * D * 2 * I
    out = []
    for name, fn in (
        ("gemm_fprop_bf16", lambda: F.grouped_mm(xb, wb, offs=offs)),
        ("gemm_fprop_fp8", lambda: scaled_grouped_mm(xq, wq.transpose(-2, -1), sx, sw, offs, True)),
        ("quantize_x_and_w", lambda: (quantize_rows(xb), quantize_rows(wb.transpose(-2, -1)))),
    ):
        ms = _median_ms(fn)
        out.append(
            {"routing": routing, "variant": name, "ms": ms, "tflops": flop / ms / 1e9 if "gemm" in name else None}
        )
        print(f"[micro] {out[-1]}", flush=True)
    return out


def report(out_dir: str, results_dir: str) -> None:
    """fp8_experts.{json,md,png} in ``results_dir`` from the files the device wrote to ``out_dir`` (check.json,
    micro.json, the training rows' bench-*.json)."""
    import glob

    load = lambda name: json.load(open(os.path.join(out_dir, name)))  # noqa: E731
    train = [json.load(open(p)) for p in sorted(glob.glob(os.path.join(out_dir, "bench-*.json")))]
    bench = train[-1] if train else {}
    data = {
        "commit": bench.get("commit"),
        "hardware": bench.get("hardware"),
        "versions": bench.get("versions"),
        "check": load("check.json"),
        "micro": load("micro.json"),
        "compiled": load("compiled.json") if os.path.exists(os.path.join(out_dir, "compiled.json")) else None,
        "train": {"workload": bench.get("workload"), "command": bench.get("command"), "rows": _train_rows(bench)},
    }
    _write(results_dir, "fp8_experts.json", data)
    with open(os.path.join(results_dir, "fp8_experts.md"), "w") as f:
        f.write(_markdown(data))
    _chart(data, os.path.join(results_dir, "fp8_experts.png"))


def _train_rows(bench: dict) -> list[dict]:
    rows = bench.get("rows", [])
    ref = next((r for r in rows if r["variant"] == "bf16" and r["status"] == "ok"), None)
    out = []
    for r in rows:
        row = {k: r.get(k) for k in ("variant", "status", "tokens_per_s_per_gpu", "tflops_per_gpu", "peak_mem_gib")}
        row["final_loss"] = r.get("final_loss")
        if ref and r["status"] == "ok":
            a, b = r["losses"], ref["losses"]
            row["final_loss_rel_diff"] = abs(a[-1] - b[-1]) / b[-1]
            row["last10_mean_rel_diff"] = abs(sum(a[-10:]) - sum(b[-10:])) / sum(b[-10:])
            row["max_step_rel_diff"] = max(abs(x - y) / y for x, y in zip(a, b))
        out.append(row)
    return out


def _markdown(d: dict) -> str:
    lines = [
        "# FP8 routed experts (kernels.experts=grouped_mm_fp8), 1 x H200",
        "",
        f"- commit `{d['commit']}`, {d['hardware']}, versions {json.dumps(d['versions'])}",
        "",
        "## Correctness of the CUDA kernel (relative error, forward y and gradients dx, dw)",
        "",
        "| case | comparison | y | dx | dw |",
        "|---|---|---:|---:|---:|",
    ]
    for case, errs in d["check"].items():
        for name, e in errs.items():
            lines.append(f"| {case} | {name} | {e['y']:.2e} | {e['dx']:.2e} | {e['dw']:.2e} |")
    m = d["micro"]
    lines += [
        "",
        f"## (a) One experts block, forward + backward: {m['shapes']}",
        "",
        f"FLOP = 3 GEMM passes x 2 x rows x (2048 x 1536 + 768 x 2048) = {m['flop_fwd_bwd']:.3e}; median of 30.",
        "",
        "| routing | variant | ms | TFLOP/s |",
        "|---|---|---:|---:|",
    ]
    for r in m["rows"]:
        t = f"{r['tflops']:.0f}" if r.get("tflops") else ""
        lines.append(
            f"| {r['routing']} | {r['variant']} | {r.get('ms', float('nan')):.3f} | {t} |"
            if "ms" in r
            else f"| {r['routing']} | {r['variant']} | {r['error']} | |"
        )
    t = d["train"]
    lines += [
        "",
        "## (b) Training: Qwen3-30B-A3B shapes, 8 layers, seq 4096, 50 steps of the arithmetic data, lr 3e-5",
        "",
        "Loss differences against the bf16 row (the issue's bound for FP8: 2%).",
        "",
        "| row | status | tokens/s/GPU | TFLOP/s/GPU | peak GiB | final loss | final diff | last-10 diff | max step diff |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    pct = lambda v: f"{100 * v:.2f}%" if v is not None else ""  # noqa: E731
    num = lambda v, f: format(v, f) if v is not None else ""  # noqa: E731
    for r in t["rows"]:
        lines.append(
            f"| {r['variant']} | {r['status']} | {num(r['tokens_per_s_per_gpu'], ',.0f')} | "
            f"{num(r['tflops_per_gpu'], '.1f')} | {num(r['peak_mem_gib'], '.1f')} | {num(r['final_loss'], '.4f')} | "
            f"{pct(r.get('final_loss_rel_diff'))} | {pct(r.get('last10_mean_rel_diff'))} | "
            f"{pct(r.get('max_step_rel_diff'))} |"
        )
    if d["compiled"]:
        lines += ["", "## fp8_grouped_mm under torch.compile against eager (relative error; 1.0: wrong)", ""]
        lines += [f"- {backend}: {errs}" for backend, errs in d["compiled"].items()]
        lines += ["", "So the fp8_compiled and fp8_compile rows ran wrong gradients: kernels.compile=true is refused."]
    lines += ["", "Training command:", "", f"```\n{t['command']}\n```", ""]
    return "\n".join(lines)


def _chart(d: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4))
    micro = [r for r in d["micro"]["rows"] if r.get("tflops") and not r["variant"].startswith(("gemm", "quant"))]
    a.barh([f"{r['routing']} {r['variant']}" for r in micro], [r["tflops"] for r in micro])
    a.set_xlabel("TFLOP/s, experts block forward + backward")
    train = [r for r in d["train"]["rows"] if r["status"] == "ok"]
    b.barh([r["variant"] for r in train], [r["tokens_per_s_per_gpu"] for r in train])
    b.set_xlabel("tokens/s per GPU, Qwen3-30B-A3B 8 layers")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _write(out_dir: str, name: str, obj) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, name), "w") as f:
        json.dump(obj, f, indent=2)


def main(argv: list[str]) -> int:
    what, out_dir = argv[0], argv[1]
    if what == "check":
        check(out_dir)
    elif what == "compiled":
        compiled(out_dir)
    elif what == "micro":
        t0 = time.time()
        micro(out_dir)
        print(f"[micro] {time.time() - t0:.0f} s", flush=True)
    elif what == "report":
        report(out_dir, argv[2])
    else:
        print(f"unknown step {what!r}: check, micro or report", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

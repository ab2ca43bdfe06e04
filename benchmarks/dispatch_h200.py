"""Token dispatch on 2 x H200: ``comm=symm_mem`` and ``comm=deepep`` against ``comm=all_to_all``.

Run from the repository root, one process per GPU; each run takes all_to_all (the reference) and the fused
backends named in BACKENDS (run deepep and symm_mem in separate processes: each brings its own NVSHMEM)::

    BACKENDS=symm_mem OUT=... COMMIT=... torchrun --nproc-per-node 2 benchmarks/dispatch_h200.py
    python benchmarks/dispatch_h200.py --merge $OUT      # parts -> dispatch.json + dispatch.md, prints the table

Part A (correctness, bf16): one MoE layer with Qwen3-30B-A3B shapes (hidden 2048, 128 experts, top-8,
moe_intermediate 768), 4096 tokens per rank, EP=2, same weights and inputs for every backend, forward and
backward. Routing cases: ``random`` (the router on random inputs), ``skewed`` (expert popularity decaying
~e^3 from expert 0 to 127), ``zero_token`` (only experts 0-3 and 64-67 can win: 120 experts get no rows),
``one_rank`` (every row to rank 0's experts). Output, input gradient, both expert weight gradients and the
router gradient are compared with all_to_all's: max abs diff, max abs diff / max |ref|, and the relative
norm ``||a - b|| / ||b||``. Tolerance: relative norm <= 1e-2 (bf16 keeps 8 bits of mantissa, so
differently ordered sums differ by a few 1e-3).

Part B (speed): dispatch + combine forward, no experts (y = x), random top-8 of 128 experts (uniform),
tokens per rank 512..16384, hidden 2048, 4096, 7168, bf16. Per point: 5 warm-up iterations, then 20, each
between a barrier and a synchronize, timed with CUDA events ("isolated": the median per rank, the slower rank
reported); then 20 back to back, wall time / 20 ("pipelined": as consecutive layers run, where a backend
without host syncs lets the CPU queue work ahead of the GPU). PROFILE=1 prints profiler tables at 4096 x 2048.
Effective bandwidth = 2 x T x K x D x 2 bytes / time: the routed rows (every (token, expert) pair, local
ones included) that a per-pair exchange moves in both directions; DeepEP moves fewer bytes (one copy per
token and rank), so this is a common yardstick, not bus bandwidth. symm_mem runs with capacity_factor 2
(= ep: can never overflow) and max_tokens = T; DeepEP with 24 SMs. ``host_syncs`` counts CUDA host syncs
in one symm_mem forward + backward under torch.cuda.set_sync_debug_mode("warn").
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from moe_tune.config import comm_config
from moe_tune.moe.dispatch import build_dispatcher
from moe_tune.moe.experts import ExpertsSpec
from moe_tune.moe.layer import MoE, MoESpec
from moe_tune.moe.router import RouterSpec

E, K, D_MODEL, I_MOE, T_CHECK = 128, 8, 2048, 768, 4096
TOKENS, HIDDENS = (16384, 8192, 4096, 2048, 1024, 512), (7168, 4096, 2048)
WARMUP, ITERS, TOL = 5, 20, 1e-2
SMOKE = bool(os.environ.get("SMOKE"))  # CPU dry run on gloo with tiny shapes
if SMOKE:
    E, D_MODEL, I_MOE, T_CHECK, TOKENS, HIDDENS, WARMUP, ITERS = 16, 64, 32, 64, (128, 64), (128, 64), 1, 2
DEV = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")
OPTIONS = {"all_to_all": {}, "symm_mem": {"capacity_factor": 2.0}, "deepep": {"num_sms": 24}}
ROUTINGS = ("random", "skewed", "zero_token", "one_rank")


def build_moe(name: str, group, max_tokens: int) -> MoE:
    spec = MoESpec(
        router=RouterSpec(num_experts=E, top_k=K, norm_topk_prob=True),
        experts=ExpertsSpec(num_experts=E, dim=D_MODEL, hidden=I_MOE),
    )
    full = MoE(spec)
    g = torch.Generator().manual_seed(0)  # the same weights on every rank and for every backend
    with torch.no_grad():
        for p in full.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.02 if p.dim() > 1 else 1.0))
    d = dispatcher(name, group, max_tokens)
    moe = MoE(spec, dispatcher=d)  # this rank's experts only, with the full layer's weights
    rows = slice(d.first_local_expert, d.first_local_expert + d.num_local_experts)
    with torch.no_grad():
        moe.router.weight.copy_(full.router.weight)
        for n, p in moe.experts.named_parameters():
            p.copy_(getattr(full.experts, n)[rows])
    return moe.to(DEV, torch.bfloat16).train()


def dispatcher(name: str, group, max_tokens: int):
    opts = dict(OPTIONS[name], **({"max_tokens": max_tokens} if name == "symm_mem" else {}))
    return build_dispatcher(comm_config({"name": name, **opts}), E, K, group)


def routed_inputs(case: str, moe: MoE, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and output gradient for one rank; the routing case is set through the router and feature 0."""
    g = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(T_CHECK, D_MODEL, generator=g)
    c = torch.randn(T_CHECK, D_MODEL, generator=g)
    w = moe.router.weight
    with torch.no_grad():
        if case == "skewed":
            w[:, 0] = torch.linspace(1.5, -1.5, E).to(w.dtype)
            x[:, 0] = 2.0
        elif case in ("zero_token", "one_rank"):
            half = E // 2  # zero_token: experts 0-3 and 64-67 (both ranks) can win; one_rank: experts 0-7
            live = [0, 1, 2, 3, half, half + 1, half + 2, half + 3] if case == "zero_token" else list(range(K))
            w[:, 0] = -4.0
            w[live, 0] = 4.0
            x[:, 0] = 6.0
    return x.to(DEV, torch.bfloat16), c.to(DEV, torch.bfloat16)


def run_layer(name: str, case: str, group, rank: int) -> dict[str, torch.Tensor]:
    moe = build_moe(name, group, T_CHECK)
    x, c = routed_inputs(case, moe, rank)
    x.requires_grad_()
    out = moe(x)
    (out.float() * c.float()).sum().backward()
    return {
        "out": out.detach(),
        "dx": x.grad,
        "d_gate_up": moe.experts.gate_up_proj.grad,
        "d_down": moe.experts.down_proj.grad,
        "d_router": moe.router.weight.grad,
    }


def compare(got: torch.Tensor, ref: torch.Tensor, group) -> dict[str, float]:
    a, b = got.detach().double(), ref.detach().double()
    # Collective over the ep group: the worst rank's numbers (sums of squares for the norms).
    v = torch.stack([(a - b).abs().max(), b.abs().max(), (a - b).square().sum(), b.square().sum()])
    mx, sums = v[:2].clone(), v[2:].clone()
    dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(sums, group=group)
    return {
        "max_abs": mx[0].item(),
        "max_rel": (mx[0] / mx[1].clamp(min=1e-30)).item(),
        "rel_norm": math.sqrt(sums[0].item() / max(sums[1].item(), 1e-30)),
    }


def correctness(backends: list[str], group, rank: int) -> list[dict]:
    rows = []
    for case in ROUTINGS:
        ref = run_layer("all_to_all", case, group, rank)
        for name in backends:
            try:
                got = run_layer(name, case, group, rank)
                diffs = {k: compare(got[k], ref[k], group) for k in ref}
                ok = all(d["rel_norm"] <= TOL for d in diffs.values())
                rows.append({"backend": name, "routing": case, "status": "ok" if ok else "mismatch", "diffs": diffs})
            except Exception as e:  # keep the other cases; the failure is in the JSON and the table
                rows.append({"backend": name, "routing": case, "status": f"error: {type(e).__name__}: {e}"})
            release(name)
    return rows


def release(name: str) -> None:
    if name == "symm_mem":
        from moe_tune.moe.dispatch.symm_mem import release_buffers

        release_buffers()
    elif name == "deepep":
        from moe_tune.moe.dispatch.deepep import release_buffers

        release_buffers()


def _sync() -> None:
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def _point(name: str, T: int, D: int, group, rank: int):
    """One measurement point's inputs (random routing, bf16 tokens, gates) and its dispatcher."""
    g = torch.Generator().manual_seed(10 + rank)
    ids = torch.rand(T, E, generator=g).topk(K, dim=1).indices.to(DEV)
    x = torch.randn(T, D, generator=g).to(DEV, torch.bfloat16)
    w = torch.rand(T, K, generator=g).to(DEV)
    return ids, x, w, dispatcher(name, group, T)


def time_point(name: str, T: int, D: int, group, rank: int) -> dict:
    ids, x, w, d = _point(name, T, D, group, rank)

    def step():
        x_RD, counts_e, ctx = d.dispatch(x, ids)
        return d.combine(x_RD, w, ctx)

    times = []
    with torch.no_grad():
        for i in range(WARMUP + ITERS):
            _sync()
            dist.barrier(group=group)
            if DEV.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                step()
                end.record()
                end.synchronize()
                ms = start.elapsed_time(end)
            else:
                t0 = time.perf_counter()
                step()
                ms = (time.perf_counter() - t0) * 1e3
            if i >= WARMUP:
                times.append(ms)
        # Pipelined: ITERS back to back, as layers follow each other in a step (a backend without host syncs
        # lets the CPU run ahead, so its launch overhead hides behind the GPU's work).
        _sync()
        dist.barrier(group=group)
        t0 = time.perf_counter()
        for _ in range(ITERS):
            step()
        _sync()
        pipelined = (time.perf_counter() - t0) * 1e3 / ITERS
    med = torch.tensor([statistics.median(times), pipelined], dtype=torch.float64, device=DEV)
    # Collective over the ep group: the slower rank's numbers.
    dist.all_reduce(med, op=dist.ReduceOp.MAX, group=group)
    ms, ms_pipe = med.tolist()
    nbytes = 2 * T * K * D * 2
    row = {"backend": name, "tokens": T, "hidden": D, "ms": ms, "gb_per_s": nbytes / (ms * 1e-3) / 1e9}
    row.update(ms_pipelined=ms_pipe, gb_per_s_pipelined=nbytes / (ms_pipe * 1e-3) / 1e9)
    if name == "symm_mem":
        row["host_syncs"], row["host_sync_sites"] = count_host_syncs(d, x, ids, w)
        release(name)  # buffers are sized for this T; DeepEP's one buffer is kept (largest hidden first)
    return row


def count_host_syncs(d, x, ids, w) -> tuple[int, list[str]]:
    """CUDA host syncs in one forward + backward of dispatch + combine (after warm-up), and where they were."""
    if DEV.type != "cuda":
        return -1, []
    x = x.detach().requires_grad_()
    _sync()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            x_RD, _, ctx = d.dispatch(x, ids)
            d.combine(x_RD, w, ctx).float().sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    _sync()
    sites = [f"{Path(c.filename).name}:{c.lineno}" for c in caught if "synchroniz" in str(c.message)]
    return len(sites), sites


def profile_point(name: str, T: int, D: int, group, rank: int) -> None:
    """Profiler tables (rank 0) for 5 pipelined dispatch + combine forwards: where the time goes."""
    from torch.profiler import ProfilerActivity, profile

    ids, x, w, d = _point(name, T, D, group, rank)
    with torch.no_grad():
        for i in range(8):
            if i == 3:
                _sync()
                prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
                prof.__enter__()
            x_RD, _, ctx = d.dispatch(x, ids)
            d.combine(x_RD, w, ctx)
        _sync()
        prof.__exit__(None, None, None)
    if rank == 0:
        avg = prof.key_averages()
        print(f"== profile {name} T={T} D={D}: 5 iterations ==")
        print(avg.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))
        print(avg.table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=60))
    if name == "symm_mem":
        release(name)


def bench(backends: list[str], group, rank: int, save, rows: list[dict]) -> list[dict]:
    for D in HIDDENS:
        for T in TOKENS:  # largest first: smaller symmetric buffers then reuse the freed memory
            for name in backends:
                try:
                    rows.append(time_point(name, T, D, group, rank))
                except Exception as e:
                    rows.append(
                        {"backend": name, "tokens": T, "hidden": D, "status": f"error: {type(e).__name__}: {e}"}
                    )
                    release(name)
                save()
    return rows


def meta() -> dict:
    versions = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0]}
    if DEV.type == "cuda":
        versions["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    if "deep_ep" in sys.modules:
        from importlib import metadata

        try:
            versions["deep_ep"] = metadata.version("deep_ep")
        except metadata.PackageNotFoundError:
            versions["deep_ep"] = "unknown"
    name = torch.cuda.get_device_name() if DEV.type == "cuda" else "CPU (smoke run)"
    return {
        "hardware": f"{dist.get_world_size()} x {name}",
        "num_gpus": dist.get_world_size(),
        "commit": os.environ.get("COMMIT", "unknown"),
        "versions": versions,
        "env": {
            k: os.environ.get(k)
            for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")
        },
    }


def main() -> None:
    from moe_tune.distributed.process_group import destroy_distributed, init_distributed

    env = init_distributed()
    group, rank = dist.group.WORLD, env.rank
    backends = [b for b in os.environ.get("BACKENDS", "symm_mem").split(",") if b]
    out = Path(os.environ.get("OUT", "benchmarks/out"))
    part = {"meta": meta(), "backends": backends, "correctness": [], "bench": []}

    def save() -> None:  # after every part, so that a later failure keeps what was measured
        part["meta"] = meta()  # now that the backends are imported (their versions)
        if rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            (out / f"part_{'_'.join(backends)}.json").write_text(json.dumps(part, indent=1))

    part["correctness"] = correctness(backends, group, rank)
    save()
    timed = backends if os.environ.get("SKIP_A2A_BENCH") else ["all_to_all", *backends]
    if os.environ.get("PROFILE") and DEV.type == "cuda":
        for name in timed:
            profile_point(name, 4096, 2048, group, rank)
    part["bench"] = bench(timed, group, rank, save, part["bench"])
    save()
    if rank == 0:
        print(markdown(merge_parts([part])))
    for name in backends:  # DeepEP's buffer must go while every rank is still alive
        release(name)
    destroy_distributed()


def merge_parts(parts: list[dict]) -> dict:
    merged = {"meta": parts[0]["meta"], "tolerance_rel_norm": TOL, "correctness": [], "bench": []}
    merged["workload"] = {
        "correctness": f"MoE layer E={E} top-{K} hidden {D_MODEL} moe_intermediate {I_MOE}, {T_CHECK} tokens/rank, bf16",
        "bench": f"dispatch+combine forward, E={E} top-{K}, uniform random routing, bf16, median of {ITERS} after {WARMUP}",
        "gb_per_s": "2 * tokens * top_k * hidden * 2 bytes / time (per rank)",
        "options": OPTIONS,
    }
    seen = set()
    for p in parts:
        merged["correctness"] += p["correctness"]
        for r in p["bench"]:
            key = (r["backend"], r["tokens"], r["hidden"])
            if key not in seen:
                seen.add(key)
                merged["bench"].append(r)
    return merged


def markdown(m: dict) -> str:
    lines = [f"# Dispatch + combine, {m['meta']['hardware']} (commit {m['meta']['commit'][:12]})", ""]
    lines += ["## Correctness vs all_to_all (bf16; relative norm, tolerance 1e-2)", ""]
    lines += [
        "| backend | routing | status | out max abs | out max abs / max ref | out rel | dx rel | d_gate_up rel | d_down rel | d_router rel |"
    ]
    lines += ["|---|---|---|---|---|---|---|---|---|---|"]
    for r in m["correctness"]:
        d = r.get("diffs", {})
        cells = [f"{d[k]['rel_norm']:.1e}" if k in d else "" for k in ("out", "dx", "d_gate_up", "d_down", "d_router")]
        mx = f"{d['out']['max_abs']:.1e} | {d['out']['max_rel']:.1e}" if d else " | "
        lines.append(f"| {r['backend']} | {r['routing']} | {r['status'][:60]} | {mx} | " + " | ".join(cells) + " |")
    names = sorted({r["backend"] for r in m["bench"]}, key=lambda n: (n != "all_to_all", n))
    by = {(r["backend"], r["tokens"], r["hidden"]): r for r in m["bench"]}
    titles = {
        "ms": "Isolated latency (ms, median of iterations each between a barrier and a sync)",
        "ms_pipelined": "Pipelined (ms per iteration, iterations back to back)",
    }
    for key, title in titles.items():
        lines += ["", f"## {title}; effective GB/s; speedup vs all_to_all", ""]
        lines += ["| hidden | tokens | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
        for D in sorted({r["hidden"] for r in m["bench"]}):
            for T in sorted({r["tokens"] for r in m["bench"]}):
                base = by.get(("all_to_all", T, D), {}).get(key)
                cells = []
                for n in names:
                    r = by.get((n, T, D), {})
                    if key not in r:
                        cells.append(r.get("status", "")[:30])
                        continue
                    speed = f", {base / r[key]:.2f}x" if base and n != "all_to_all" else ""
                    cells.append(f"{r[key]:.3f} ({2 * T * K * D * 2 / r[key] / 1e6:.0f} GB/s{speed})")
                lines.append(f"| {D} | {T} | " + " | ".join(cells) + " |")
    syncs = [r for r in m["bench"] if r.get("host_syncs") is not None]
    if syncs:
        worst = max(syncs, key=lambda r: r["host_syncs"])
        sites = ", ".join(sorted(set(worst.get("host_sync_sites", [])))) or "none"
        lines += [
            "",
            f"symm_mem host syncs per forward + backward (sync debug mode): max {worst['host_syncs']} ({sites})",
        ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--merge", help="directory of part_*.json: write dispatch.json and dispatch.md there")
    args = parser.parse_args()
    if args.merge:
        d = Path(args.merge)
        merged = merge_parts([json.loads(p.read_text()) for p in sorted(d.glob("part_*.json"))])
        (d / "dispatch.json").write_text(json.dumps(merged, indent=1))
        (d / "dispatch.md").write_text(markdown(merged))
        print(markdown(merged))
    else:
        main()

"""Tiny runs of each backend, for ``moe_tune.env.backends.probe`` and ``moe-tune-env``.

Each ``run_<backend>()`` returns (ok, detail): what ran, on what, and the numbers it checked against a
reference. They assume ``backends.unusable_reason`` already passed (package importable, GPU present).
The symmetric-memory check needs a process group of >= 2 ranks (torch's NVSHMEM rendezvous refuses a
1-rank group), so without one it runs in child processes: two ranks on GPUs 0 and 1 when there are two,
otherwise one rank that checks only the allocation. A child cannot hang or crash the caller.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys


def _rel_err(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


def _version(dist_name: str) -> str:
    from importlib import metadata

    for candidate in (dist_name, dist_name.replace("_", "-")):
        try:
            return metadata.version(candidate)
        except metadata.PackageNotFoundError:
            continue
    return getattr(sys.modules.get(dist_name), "__version__", "unknown version")


def run_grouped_mm() -> tuple[bool, str]:
    """Grouped GEMM forward and backward with uneven and empty groups, against a per-group loop in float64."""
    import torch
    import torch.nn.functional as F

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    g = torch.Generator().manual_seed(0)
    counts = [5, 0, 19, 8]  # group 1 receives no rows: its weight gradient must be exactly zero
    x = torch.randn(sum(counts), 64, generator=g).to(dev, dtype).requires_grad_()
    w = (torch.randn(len(counts), 64, 32, generator=g) / 8).to(dev, dtype).requires_grad_()
    dy = torch.randn(sum(counts), 32, generator=g).to(dev, dtype)
    offs = torch.tensor(counts, device=dev).cumsum(0).to(torch.int32)
    mm = F.grouped_mm if hasattr(F, "grouped_mm") else torch._grouped_mm
    y = mm(x, w, offs=offs)
    y.backward(dy)
    xr, wr = x.detach().double().cpu().requires_grad_(), w.detach().double().cpu().requires_grad_()
    starts = [sum(counts[:j]) for j in range(len(counts))]
    yr = torch.cat([xr[s : s + n] @ wr[j] for j, (s, n) in enumerate(zip(starts, counts))])
    yr.backward(dy.double().cpu())
    errs = {"y": _rel_err(y.cpu(), yr), "dx": _rel_err(x.grad.cpu(), xr.grad), "dw": _rel_err(w.grad.cpu(), wr.grad)}
    empty_ok = bool((w.grad[1] == 0).all())
    ok = max(errs.values()) < tol and empty_ok
    where = f"{dev} ({torch.cuda.get_device_name()})" if dev == "cuda" else "cpu"
    detail = (
        f"forward+backward on {where} in {str(dtype).removeprefix('torch.')}, groups {counts}: rel err vs float64 "
        + ", ".join(f"{k} {v:.1e}" for k, v in errs.items())
        + f" (tolerance {tol:.0e}); empty group's weight grad zero: {empty_ok}"
    )
    return ok, detail


def run_grouped_mm_fp8() -> tuple[bool, str]:
    """kernels.experts=grouped_mm_fp8's GEMM forward and backward (uneven and empty groups) against bf16
    grouped_mm; E4M3's 3 mantissa bits put the relative error near 4e-2 on random data."""
    import torch
    import torch.nn.functional as F

    from moe_tune.kernels.fp8_grouped import fp8_grouped_mm

    g = torch.Generator().manual_seed(0)
    counts = [40, 0, 152, 64]
    x = torch.randn(sum(counts), 128, generator=g).to("cuda", torch.bfloat16)
    w = (torch.randn(len(counts), 128, 64, generator=g) / 8).to("cuda", torch.bfloat16)
    dy = torch.randn(sum(counts), 64, generator=g).to("cuda", torch.bfloat16)
    offs = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)

    def run(mm):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = mm(xi, wi, offs)
        y.backward(dy)
        return y, xi.grad, wi.grad

    fp8 = run(fp8_grouped_mm)
    ref = run(lambda a, b, o: F.grouped_mm(a, b, offs=o))
    errs = {k: _rel_err(a, b) for k, a, b in zip(("y", "dx", "dw"), fp8, ref)}
    tol = 6e-2
    ok = max(errs.values()) < tol
    detail = ", ".join(f"{k} {v:.1e}" for k, v in errs.items())
    return (
        ok,
        f"FP8 E4M3 grouped GEMM forward+backward, groups {counts}: rel err vs bf16 {detail} (tolerance {tol:.0e})",
    )


def run_frozen_fp8() -> tuple[bool, str]:
    """peft.quantize_base=fp8's grouped GEMM forward and input gradient (uneven and empty groups) against fp32
    matmuls of the dequantized weights, on the GPU (or the CPU emulation without one)."""
    import torch

    from moe_tune.kernels.fp8_frozen import dequantize_weight, frozen_fp8_grouped_mm, quantize_weight

    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    counts = [40, 0, 152, 64]
    x = torch.randn(sum(counts), 128, generator=g).to(device, torch.bfloat16).requires_grad_()
    w_q, w_s = quantize_weight((torch.randn(len(counts), 64, 128, generator=g) / 8).to(device))
    dy = torch.randn(sum(counts), 64, generator=g).to(device, torch.bfloat16)
    offs = torch.tensor(counts, device=device).cumsum(0).to(torch.int32)
    y = frozen_fp8_grouped_mm(x, w_q, w_s, offs)
    y.backward(dy)
    w = dequantize_weight(w_q, w_s)
    groups = torch.repeat_interleave(torch.arange(len(counts), device=device), torch.tensor(counts, device=device))
    ref_y = torch.einsum("rk,rnk->rn", x.detach().float(), w[groups])
    ref_dx = torch.einsum("rn,rnk->rk", dy.float(), w[groups])
    errs = {"y": _rel_err(y, ref_y), "dx": _rel_err(x.grad, ref_dx)}
    tol = 6e-2
    detail = ", ".join(f"{k} {v:.1e}" for k, v in errs.items())
    return (
        max(errs.values()) < tol,
        f"FP8 frozen-base grouped GEMM ({device}) forward+input gradient, groups {counts}: rel err vs the "
        f"dequantized weights in fp32 {detail} (tolerance {tol:.0e})",
    )


def run_transformer_engine() -> tuple[bool, str]:
    import torch
    import transformer_engine.pytorch as te

    torch.manual_seed(0)
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    norm = te.RMSNorm(256, eps=1e-6, params_dtype=torch.bfloat16)
    lin = te.Linear(256, 128, bias=False, params_dtype=torch.bfloat16)
    y = lin(norm(x))
    y.float().square().mean().backward()
    xf = x.detach().float()
    ref = (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + 1e-6) * norm.weight.float()) @ lin.weight.float().t()
    err = _rel_err(y, ref)
    finite = bool(torch.isfinite(x.grad).all() and torch.isfinite(lin.weight.grad).all())
    detail = f"TE {_version('transformer_engine')}: RMSNorm+Linear bf16 forward+backward, rel err vs torch {err:.1e}"
    return err < 2e-2 and finite, f"{detail} (tol 2e-2), grads finite: {finite}"


def run_fp8(mode: str) -> tuple[bool, str]:
    """A TE Linear under fp8 autocast with the recipe a run with ``kernels.fp8=mode`` uses (TE's defaults for
    the options)."""
    import torch
    import transformer_engine.pytorch as te

    from moe_tune.kernels.te import fp8_recipe

    recipe = fp8_recipe(mode)
    recipe_name = type(recipe).__name__
    torch.manual_seed(0)
    lin = te.Linear(256, 256, bias=False, params_dtype=torch.bfloat16)
    x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    if hasattr(te, "autocast"):  # TE >= 2.8; fp8_autocast before
        ctx = te.autocast(enabled=True, recipe=recipe)
    else:
        ctx = te.fp8_autocast(enabled=True, fp8_recipe=recipe)
    with ctx:
        y = lin(x)
    y.float().square().mean().backward()
    err = _rel_err(y, x.detach().float() @ lin.weight.detach().float().t())
    ok = err < 0.1 and bool(torch.isfinite(lin.weight.grad).all())
    return (
        ok,
        f"TE {_version('transformer_engine')}: Linear in fp8 ({recipe_name}) fwd+bwd, rel err vs bf16 {err:.1e} (tol 1e-1)",
    )


def run_deepep() -> tuple[bool, str]:
    import deep_ep
    import torch.distributed as dist

    version = _version("deep_ep")
    if not dist.is_initialized():
        return True, (
            f"deep_ep {version} imports and has Buffer: {hasattr(deep_ep, 'Buffer')}; no Buffer built "
            "(that needs a process group: a run with comm=deepep builds it at start)"
        )
    buf = deep_ep.Buffer(dist.group.WORLD, num_nvl_bytes=1 << 26, num_rdma_bytes=0)
    del buf
    return True, f"deep_ep {version}: Buffer (64 MiB NVLink) built on the world group of {dist.get_world_size()} ranks"


# -- symmetric memory ---------------------------------------------------------------------------------------


def run_symm_mem() -> tuple[bool, str]:
    import torch
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        return symm_mem_check(dist.group.WORLD)  # collective: every rank must call probe("symm_mem")
    if torch.cuda.device_count() >= 2:
        return _spawn(2)
    ok, detail = _spawn(1)
    return False, (
        "comm=symm_mem needs >= 2 GPUs (it carries expert-parallel traffic, and torch's NVSHMEM rendezvous "
        f"refuses a 1-rank group); this machine has 1. One-rank check: {detail}"
    )


def symm_mem_check(group) -> tuple[bool, str]:
    """All ranks of ``group``: NVSHMEM alloc, rendezvous and ``all_to_all_vdev`` with uneven splits, checked
    against NCCL's ``all_to_all_single`` on the same data. Rank r sends 16 * (r + 1) * (p + 1) elements to p."""
    import torch
    import torch.distributed as dist
    from torch.distributed import _symmetric_memory as symm

    from moe_tune.moe.dispatch.symm_mem import init_nvshmem

    rank, world, name = dist.get_rank(group), dist.get_world_size(group), group.group_name
    # What the trainer's dispatcher does: its device with an explicit index (NVSHMEM binds its teams to one
    # device per process; an index-less "cuda" need not be the rank's device) and its NVSHMEM setup.
    dev = torch.device("cuda", torch.cuda.current_device())
    init_nvshmem(dev, name)
    send = [16 * (rank + 1) * (p + 1) for p in range(world)]
    recv = [16 * (s + 1) * (rank + 1) for s in range(world)]
    cap = 8 * world * world * (world + 1)  # the most any rank sends or receives
    inp = symm.empty(cap, dtype=torch.float32, device=dev)
    inp.copy_(torch.arange(cap, dtype=torch.float32, device=dev) + 1e5 * rank)
    if world == 1:
        ok = bool((inp[:4] == torch.arange(4, device=dev)).all())  # host sync: probe check
        return ok, f"NVSHMEM symmetric alloc of {cap * 4} bytes {'ok' if ok else 'WRONG'}; rendezvous not tried"
    out = symm.empty(cap, dtype=torch.float32, device=dev).fill_(-1)
    in_splits = symm.empty(world, dtype=torch.int64, device=dev)
    in_splits.copy_(torch.tensor(send, device=dev))
    out_so = symm.empty((2, world), dtype=torch.int64, device=dev)
    for t in (inp, out, in_splits, out_so):
        symm.rendezvous(t, name)
    torch.ops.symm_mem.all_to_all_vdev(inp, out, in_splits, out_so, name)
    expected = torch.empty(sum(recv), dtype=torch.float32, device=dev)
    dist.all_to_all_single(expected, inp[: sum(send)].clone(), recv, send, group=group)
    torch.cuda.synchronize()
    offsets = [sum(recv[:i]) for i in range(world)]
    # host sync: the probe reads splits and offsets back to compare them with the expected lists.
    splits_ok = out_so[0].tolist() == recv and out_so[1].tolist() == offsets
    data_ok = bool(torch.equal(out[: sum(recv)], expected))
    flags = torch.tensor([splits_ok and data_ok], dtype=torch.int32, device=dev)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=group)
    ok = bool(flags.item())  # host sync: probe result
    return ok, (
        f"NVSHMEM alloc + rendezvous + all_to_all_vdev on {world} ranks, uneven splits: "
        f"{'matches' if ok else 'DIFFERS from'} NCCL all_to_all_single (splits and data on every rank)"
    )


def _spawn(world: int, timeout: float = 120) -> tuple[bool, str]:
    """Run ``symm_mem_check`` in ``world`` child processes, one per GPU, with their own process group."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world))
    env.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    env.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    cmd = [sys.executable, "-m", "moe_tune.env.probes", "symm_mem_worker"]
    procs = [
        subprocess.Popen(
            cmd,
            env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    results = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            return False, f"the {world}-rank symmetric-memory check did not finish in {timeout:.0f} s"
        lines = [ln for ln in out.splitlines() if ln.startswith('{"ok"')]
        if lines:
            results.append(json.loads(lines[-1]))
        else:
            tail = [ln for ln in err.strip().splitlines() if "Error" in ln] or err.strip().splitlines() or ["no output"]
            results.append({"ok": False, "detail": f"rank exited {p.returncode}: {tail[-1][:300]}"})
    bad = next((r for r in results if not r["ok"]), None)
    return (False, bad["detail"]) if bad else (True, results[0]["detail"])


def _worker() -> None:
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    try:
        ok, detail = symm_mem_check(dist.group.WORLD)
    except Exception as e:
        ok, detail = False, f"rank {rank}: {_first_line(e)}"
    print(json.dumps({"ok": ok, "detail": detail}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__" and sys.argv[1:] == ["symm_mem_worker"]:
    _worker()

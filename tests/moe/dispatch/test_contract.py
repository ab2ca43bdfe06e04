"""The dispatcher contract, the same checks for every ``comm`` backend on 2 ranks.

``dispatch(x_TD, ids_TK) -> (x_RD, counts_e, ctx)``: the first ``counts_e.sum()`` rows of x_RD are this rank's
experts' rows, grouped by local expert, each group holding exactly the rows routed to that expert by any
rank (rows past the sum are padding: symm_mem returns a fixed capacity to avoid a host sync).
``combine(y_RD, weights_TK, ctx) -> out_TD = sum_k weights * y``; both differentiable.

Where each backend runs:
  - ``all_to_all`` and ``all_to_all_dedup`` (comm.dedup=true): gloo on CPU (the CPU suite).
  - ``symm_mem_emulated``: symm_mem's own permutation, capacity and autograd code on gloo (CPU), with
    NVSHMEM's ``all_to_all_vdev`` and symmetric allocation replaced by a gloo equivalent.
  - ``all_to_all_nccl`` (with comm.dedup=true, on NCCL), ``symm_mem`` and ``deepep``: NCCL on 2 GPUs, bf16 rows of 256 (``gpu`` marker; skipped with the reason
    otherwise). On 2 x H200 with torch 2.11 and DeepEP 1.2.1 the three ``gpu`` tests pass:
    benchmarks/results/2026-11-30-2xH200/dispatch-gpu-tests.log.
Nothing here imports deep_ep unless the deepep case runs.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.distributed as dist

from moe_tune.config import comm_config
from moe_tune.moe.dispatch import build_dispatcher
from moe_tune.moe.dispatch.deepep import expand_by_local_expert, weighted_sum_per_token
from moe_tune.moe.dispatch.symm_mem import padded_expert_major
from tests.harness import run_ranks
from tests.tiny import rel_err

E, K = 8, 2
GPU_BACKENDS = ("all_to_all_nccl", "symm_mem", "deepep")
CASES = ("random", "one_rank", "sparse")
TOKENS = ((5, 11), (7, 0))  # uneven batches, and a rank without tokens


def _gpu_skip(backend: str) -> str | None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        return "needs 2 CUDA GPUs"
    if backend == "deepep" and importlib.util.find_spec("deep_ep") is None:
        return "DeepEP is not installed (build it from source tag v1.2.1; see docs/launching.md)"
    if backend == "symm_mem":
        from torch.distributed import _symmetric_memory as symm

        if not symm.is_nvshmem_available():
            return "NVSHMEM is not available to this torch"
    return None


def _run(body, backend: str) -> None:
    """``body(rank, backend)`` on 2 ranks: gloo on CPU, NCCL (one GPU per rank) for symm_mem and deepep."""
    run_ranks(body, 2, backend, backend="nccl" if backend in GPU_BACKENDS else "gloo")


def _backend_params():
    params = [
        pytest.param("all_to_all", id="all_to_all"),
        pytest.param("all_to_all_dedup", id="all_to_all_dedup"),
        pytest.param("symm_mem_emulated", id="symm_mem_emulated"),
    ]
    for name in GPU_BACKENDS:
        reason = _gpu_skip(name)
        marks = [pytest.mark.gpu] + ([pytest.mark.skip(reason=reason)] if reason else [])
        params.append(pytest.param(name, id=name, marks=marks))
    return params


# -- symm_mem's NVSHMEM primitives, emulated over gloo --------------------------------------------------


def _gloo_vdev(send, recv, in_splits_S, out_splits_offsets_2S, group_name) -> None:
    out_S = torch.empty_like(in_splits_S)
    dist.all_to_all_single(out_S, in_splits_S)
    ins, outs = in_splits_S.tolist(), out_S.tolist()  # host sync: the emulation needs Python split sizes
    rows = recv.new_empty(sum(outs), recv.shape[1])
    dist.all_to_all_single(rows, send[: sum(ins)].contiguous(), outs, ins)
    recv[: sum(outs)] = rows
    out_splits_offsets_2S[0] = out_S
    out_splits_offsets_2S[1] = torch.cumsum(out_S, 0) - out_S


def _emulate_symm_mem() -> None:
    import moe_tune.moe.dispatch.symm_mem as sm

    sm._symmetric_empty = lambda shape, dtype, device, group_name: torch.empty(shape, dtype=dtype, device=device)
    sm._all_to_all_vdev = _gloo_vdev


def _build(backend: str, checked_after_step: bool = False, **options):
    if backend.startswith("symm_mem"):
        options = {"capacity_factor": 2.0, "max_tokens": 16, **options}
        backend = "symm_mem"
    if backend in ("all_to_all_dedup", "all_to_all_nccl"):
        backend, options = "all_to_all", {"dedup": True, **options}
    comm = comm_config({"name": backend, **options})
    return build_dispatcher(comm, E, K, dist.group.WORLD, checked_after_step)


def _release(backend: str) -> None:
    """Free the backend's shared buffers while every rank is alive (DeepEP's destructor synchronises ranks)."""
    if backend.startswith("symm_mem"):
        from moe_tune.moe.dispatch.symm_mem import release_buffers

        release_buffers()
    elif backend == "deepep":
        from moe_tune.moe.dispatch.deepep import release_buffers

        release_buffers()


# -- the contract ---------------------------------------------------------------------------------------


def _ids(case: str, rank: int, T: int, g: torch.Generator) -> torch.Tensor:
    if case == "sparse":  # only experts 1 and 6: the other six get zero rows on both ranks
        return torch.tensor([[1, 6] if rank == 0 else [6, 1]] * T, dtype=torch.long).reshape(T, K)
    n = E if case == "random" else E // 2  # "one_rank": every row to ep rank 0's experts
    rows = [torch.randperm(n, generator=g)[:K] for _ in range(T)]
    return torch.stack(rows) if rows else torch.empty(0, K, dtype=torch.long)


def _sorted_rows(x: torch.Tensor) -> torch.Tensor:
    """Rows in a canonical order (by a random projection of their values), to compare groups as sets."""
    key = x.double() @ torch.linspace(1.0, 2.0, x.shape[1], dtype=torch.float64)
    return x[torch.argsort(key, stable=True)]


def _contract_body(rank: int, backend: str) -> None:
    if backend == "symm_mem_emulated":
        _emulate_symm_mem()
    gpu = backend in GPU_BACKENDS
    dev = torch.device("cuda", rank) if gpu else torch.device("cpu")
    dtype, D = (torch.bfloat16, 256) if gpu else (torch.float32, 16)
    tol = 1e-2 if gpu else 1e-6
    exact_order = backend != "deepep"  # DeepEP orders received tokens by its channels; the contract is per group
    d = _build(backend)
    e = d.num_local_experts
    failures = []

    def check(ok: bool, what: str) -> None:
        if not ok:
            failures.append(what)

    for T in TOKENS:  # the rank without tokens comes last
        for case in CASES:
            g = torch.Generator().manual_seed(100 * rank + T[rank] + len(case))
            ids_TK = _ids(case, rank, T[rank], g)
            x_TD = torch.randn(T[rank], D, generator=g).to(dev, dtype).requires_grad_()
            w_TK = torch.rand(T[rank], K, generator=g).to(dev).requires_grad_()
            x_RD, counts_e, ctx = d.dispatch(x_TD, ids_TK.to(dev))
            n = int(counts_e.sum())
            assert counts_e.shape == (e,) and x_RD.shape[0] >= n and x_RD.shape[1] == D

            all_x, all_ids = [None, None], [None, None]
            dist.all_gather_object(all_x, x_TD.detach().cpu())
            dist.all_gather_object(all_ids, ids_TK)
            start = 0
            for j, c in enumerate(counts_e.tolist()):
                glob = rank * e + j
                want = torch.cat([all_x[s][(all_ids[s] == glob).nonzero()[:, 0]] for s in range(2)])
                got = x_RD[start : start + c].detach().cpu()
                if c != want.shape[0]:
                    check(False, f"{case} T={T} expert {j}: {c} rows, want {want.shape[0]}")
                elif exact_order:  # rows of source 0 then source 1, each in token order
                    check(torch.equal(got, want), f"{case} T={T} expert {j}: rows differ or out of order")
                else:
                    check(torch.equal(_sorted_rows(got), _sorted_rows(want)), f"{case} T={T} expert {j}: rows differ")
                start += c

            # "Expert" j multiplies its rows by j + 1; padding rows are left as they are.
            scale_E = torch.arange(1.0, E + 1, device=dev)
            local_R = torch.repeat_interleave(torch.arange(e, device=dev), counts_e, output_size=n)
            scale_R = torch.cat([scale_E[rank * e + local_R], torch.ones(x_RD.shape[0] - n, device=dev)])
            out_TD = d.combine(x_RD * scale_R.to(dtype).unsqueeze(1), w_TK, ctx)
            xf = x_TD.float()
            ref_TD = (w_TK.unsqueeze(-1) * xf.unsqueeze(1) * scale_E[ids_TK.to(dev)].unsqueeze(-1)).sum(1)
            assert out_TD.shape == (T[rank], D)
            check(rel_err(out_TD, ref_TD) < tol, f"{case} T={T} out rel err {rel_err(out_TD, ref_TD):.1e}")

            c_TD = torch.randn(T[rank], D, generator=g).to(dev)
            # Every rank takes part in the backward exchanges, with or without tokens.
            gx, gw = torch.autograd.grad((out_TD.float() * c_TD).sum(), (x_TD, w_TK), allow_unused=True)
            if T[rank]:
                rx, rw = torch.autograd.grad((ref_TD * c_TD).sum(), (x_TD, w_TK))
                check(rel_err(gx, rx) < tol, f"{case} T={T} dx rel err {rel_err(gx, rx):.1e}")
                check(rel_err(gw, rw) < tol, f"{case} T={T} dweights rel err {rel_err(gw, rw):.1e}")
    if dev.type == "cuda":
        torch.cuda.synchronize()
    d.check()  # no batch overflowed: the trainer's after-step check stays silent
    _release(backend)
    assert not failures, f"rank {rank} ({backend}): " + "; ".join(failures)


@pytest.mark.dist
@pytest.mark.parametrize("backend", _backend_params())
def test_dispatcher_contract(backend):
    _run(_contract_body, backend)


# -- symm_mem capacity: an overflow drops the batch on every rank and raises, never corrupts -------------


def _overflow_body(rank: int, backend: str) -> None:
    if backend == "symm_mem_emulated":
        _emulate_symm_mem()
    dev = torch.device("cuda", rank) if backend == "symm_mem" else torch.device("cpu")
    ids_TK = torch.tensor([[0, 1]] * 8, device=dev)  # 32 rows for rank 0, which holds 8 x ceil(0.5 x 2) = 8
    x_TD = torch.randn(8, 16, device=dev)
    lazy = _build(backend, capacity_factor=0.5, max_tokens=8)
    x_RD, counts_e, ctx = lazy.dispatch(x_TD, ids_TK)
    assert int(counts_e.sum()) == 0 and x_RD.shape == (8, 16)  # nothing received, nothing written past the buffer
    out = lazy.combine(x_RD, torch.ones(8, 2, device=dev), ctx)
    assert float(out.abs().sum()) == 0.0
    if dev.type == "cuda":
        torch.cuda.synchronize()
    # The trainer's check after the step (the same verdict on every rank: it comes from all-gathered counts).
    with pytest.raises(RuntimeError, match=r"up to 32 routed rows .* buffer holds 8 .*capacity_factor"):
        lazy.check()
    with pytest.raises(RuntimeError, match=r"up to 32 routed rows .* buffer holds 8 .*capacity_factor"):
        lazy.dispatch(x_TD, ids_TK)
    _release(backend)
    # As under the trainer, which runs check() after each step: dispatch leaves the verdict to check().
    lazy = _build(backend, checked_after_step=True, capacity_factor=0.5, max_tokens=8)
    lazy.dispatch(x_TD, ids_TK)
    lazy.dispatch(x_TD, ids_TK)
    with pytest.raises(RuntimeError, match="Raise comm.capacity_factor"):
        lazy.check()
    _release(backend)
    eager = _build(backend, capacity_factor=0.5, max_tokens=8, debug=True)
    with pytest.raises(RuntimeError, match="Raise comm.capacity_factor"):
        eager.dispatch(x_TD, ids_TK)
    _release(backend)


@pytest.mark.dist
@pytest.mark.parametrize("backend", [p for p in _backend_params() if p.id.startswith("symm_mem")])
def test_symm_mem_overflow_raises_and_drops(backend):
    _run(_overflow_body, backend)


# -- the pure permutation maths -------------------------------------------------------------------------


def test_padded_expert_major():
    # 2 sources x 3 local experts, received source-major: s0 [e0:2, e1:0, e2:1], s1 [e0:1, e1:2, e2:0], then 2 pad.
    counts_Ge = torch.tensor([[2, 0, 1], [1, 2, 0]])
    src_of_em, em_of_src = padded_expert_major(counts_Ge, 8)
    # expert-major: e0 <- s0 rows 0,1 and s1 row 3; e1 <- s1 rows 4,5; e2 <- s0 row 2; padding 6,7 stays.
    assert src_of_em.tolist() == [0, 1, 3, 4, 5, 2, 6, 7]
    assert em_of_src.tolist() == [0, 1, 5, 2, 3, 4, 6, 7]
    empty_src, _ = padded_expert_major(torch.zeros(2, 3, dtype=torch.long), 4)
    assert empty_src.tolist() == [0, 1, 2, 3]


def test_expand_by_local_expert_and_weighted_sum():
    # 3 received tokens, top-2, 2 local experts; -1 marks an expert on another rank.
    recv_ids_NK = torch.tensor([[1, -1], [0, 1], [-1, -1]])
    order_P, counts_e = expand_by_local_expert(recv_ids_NK, 2)
    assert counts_e.tolist() == [1, 2]
    pair_R = order_P[:3]
    assert pair_R.tolist() == [2, 0, 3]  # expert 0: (token 1, k 0); expert 1: (token 0, k 0), (token 1, k 1)
    y_RD = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 2.0]])
    gates_NK = torch.tensor([[0.5, 9.0], [0.25, 0.75], [9.0, 9.0]])
    z_ND = weighted_sum_per_token(y_RD, pair_R, gates_NK)
    assert z_ND.tolist() == [[0.0, 0.5], [1.75, 1.5], [0.0, 0.0]]


# -- LoRA on the experts through every backend -------------------------------------------------------------


def _lora_moe(dispatcher, dev: torch.device, dtype: torch.dtype, D: int):
    """An MoE layer with rank-8 expert adapters whose weights are rows of the same global tensors on every rank
    (a rank's experts are its dispatcher's block), B nonzero so every adapter counts."""
    from moe_tune.lora import LoRASpec
    from moe_tune.moe.experts import ExpertsSpec
    from moe_tune.moe.layer import MoE, MoESpec
    from moe_tune.moe.router import RouterSpec

    spec = MoESpec(router=RouterSpec(num_experts=E, top_k=K), experts=ExpertsSpec(num_experts=E, dim=D, hidden=16))
    moe = MoE(spec, dispatcher=dispatcher, lora=LoRASpec(rank=8, alpha=16))
    first, e = moe.experts.first_expert, moe.experts.num_local_experts
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in sorted(moe.named_parameters()):
            full = torch.randn((E, *p.shape[1:]) if ".experts." in f".{name}" else p.shape, generator=g) * 0.2
            p.data = (full[first : first + e] if ".experts." in f".{name}" else full).to(dev, dtype)
    return moe


def _lora_body(rank: int, backend: str) -> None:
    """Each rank's outputs and its experts' adapter gradients under EP=2 equal one process's layer holding every
    expert, run on both ranks' tokens."""
    from moe_tune.moe.dispatch.local import LocalDispatcher

    if backend == "symm_mem_emulated":
        _emulate_symm_mem()
    gpu = backend in GPU_BACKENDS
    dev = torch.device("cuda", rank) if gpu else torch.device("cpu")
    dtype, D, tol = (torch.bfloat16, 256, 2e-2) if gpu else (torch.float32, 16, 1e-5)
    ep, ref = _lora_moe(_build(backend), dev, dtype, D), _lora_moe(LocalDispatcher(E, K), dev, dtype, D)
    xs = [torch.randn(T, D, generator=torch.Generator().manual_seed(s)).to(dev, dtype) for s, T in enumerate((9, 6))]
    out = ep(xs[rank])
    (out.float().square().sum()).backward()
    ref_out = ref(torch.cat(xs))
    ref_out.float().square().sum().backward()
    mine = ref_out[:9] if rank == 0 else ref_out[9:]
    assert rel_err(out, mine) < tol, (backend, rel_err(out, mine))
    first, e = ep.experts.first_expert, ep.experts.num_local_experts
    for (name, p), (_, q) in zip(ep.experts.lora.named_parameters(), ref.experts.lora.named_parameters()):
        err = rel_err(p.grad, q.grad[first : first + e])
        assert err < tol, (backend, name, err)
    _release(backend)


@pytest.mark.dist
@pytest.mark.parametrize("backend", _backend_params())
def test_expert_adapters_through_every_backend(backend):
    _run(_lora_body, backend)

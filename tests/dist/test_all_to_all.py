"""comm=all_to_all on 2 gloo ranks: the dispatcher with uneven and empty splits, and an EP=2 MoE layer
against the single-process layer, forward and gradients in fp32."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_harness import rel_err, run_ranks

from moe_tune.config import AllToAllConfig
from moe_tune.moe.dispatch import build_dispatcher
from moe_tune.moe.dispatch.all_to_all import AllToAllDispatcher
from moe_tune.moe.dispatch.base import expert_major_positions
from moe_tune.moe.dispatch.local import LocalDispatcher
from moe_tune.moe.experts import ExpertsSpec
from moe_tune.moe.layer import MoE, MoESpec
from moe_tune.moe.router import RouterSpec

pytestmark = pytest.mark.dist
E, K, D = 8, 2, 16


def test_expert_major_positions():
    # 2 sources x 3 local experts; received source-major: s0 [e0:2, e1:0, e2:1], s1 [e0:1, e1:2, e2:0].
    counts_Ge = torch.tensor([[2, 0, 1], [1, 2, 0]])
    dest_R = expert_major_positions(counts_Ge, 6)
    # expert-major: e0 <- s0 rows 0,1 then s1 row 3; e1 <- s1 rows 4,5; e2 <- s0 row 2.
    assert dest_R.tolist() == [0, 1, 5, 2, 3, 4]


def _ids(case: str, rank: int, T: int, g: torch.Generator) -> torch.Tensor:
    if case == "sparse":  # only experts 1 and 6, one per rank; the other 6 experts get zero rows
        return torch.tensor([[1, 6] if rank == 0 else [6, 1]] * T, dtype=torch.long).reshape(T, K)
    # "one_rank": every row to ep rank 0's experts, so rank 1 receives nothing
    n = E if case == "random" else E // 2
    rows = [torch.randperm(n, generator=g)[:K] for _ in range(T)]
    return torch.stack(rows) if rows else torch.empty(0, K, dtype=torch.long)


def _dispatcher_body(rank: int) -> None:
    group = dist.group.WORLD
    for case in ("random", "one_rank", "sparse"):
        for T in ((5, 11), (7, 0)):
            g = torch.Generator().manual_seed(100 * rank + T[rank])
            ids_TK = _ids(case, rank, T[rank], g)
            x_TD = torch.randn(T[rank], D, generator=g, requires_grad=True)
            w_TK = torch.rand(T[rank], K, generator=g, requires_grad=True)
            scale_E = torch.arange(1.0, E + 1)  # "expert" j multiplies its rows by j + 1
            d = AllToAllDispatcher(E, K, group)
            x_RD, counts_e, ctx = d.dispatch(x_TD, ids_TK)
            assert counts_e.sum().item() == x_RD.shape[0]
            local_ids = torch.repeat_interleave(torch.arange(d.num_local_experts), counts_e)
            out = d.combine(x_RD * scale_E[rank * d.num_local_experts + local_ids].unsqueeze(1), w_TK, ctx)
            ref = (w_TK.unsqueeze(-1) * x_TD.unsqueeze(1) * scale_E[ids_TK].unsqueeze(-1)).sum(1)
            torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
            # Expert-major order: rows of local expert j from source 0, then source 1, each in token order.
            all_x = [None, None]
            all_ids = [None, None]
            dist.all_gather_object(all_x, x_TD.detach())
            dist.all_gather_object(all_ids, ids_TK)
            expected = []
            for j in range(rank * d.num_local_experts, (rank + 1) * d.num_local_experts):
                for s in range(2):
                    tok = (all_ids[s] == j).nonzero()[:, 0]
                    expected.append(all_x[s][tok])
            torch.testing.assert_close(x_RD.detach(), torch.cat(expected), rtol=0, atol=0)
            # Backward through both all-to-alls equals the local gradient of the same function.
            gx, gw = torch.autograd.grad((out * out).sum(), (x_TD, w_TK)) if T[rank] else (x_TD, w_TK)
            if T[rank]:
                rx, rw = torch.autograd.grad((ref * ref).sum(), (x_TD, w_TK))
                torch.testing.assert_close(gx, rx, rtol=1e-6, atol=1e-6)
                torch.testing.assert_close(gw, rw, rtol=1e-6, atol=1e-6)
            else:
                (out * out).sum().backward()  # rank 1 has no tokens but still serves the backward all-to-all


def test_dispatcher_uneven_and_empty_splits():
    run_ranks(_dispatcher_body, 2)


def _moe(seed: int) -> MoE:
    spec = MoESpec(
        router=RouterSpec(num_experts=E, top_k=K, norm_topk_prob=True),
        experts=ExpertsSpec(num_experts=E, dim=D, hidden=12),
    )
    moe = MoE(spec)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return moe


def _ep_moe(d, full: MoE) -> MoE:
    """The layer built under expert parallelism (this rank's experts only), with ``full``'s weights."""
    ep = MoE(full.spec, dispatcher=d)
    assert ep.experts.gate_up_proj.shape[0] == d.num_local_experts < E
    rows = slice(d.first_local_expert, d.first_local_expert + d.num_local_experts)
    with torch.no_grad():
        ep.router.weight.copy_(full.router.weight)
        for name, p in ep.experts.named_parameters():
            p.copy_(getattr(full.experts, name)[rows])
    return ep


def _route_to(moe: MoE, live: list[int]) -> None:
    """Make feature 0 decide routing: with x[:, 0] large, only experts in ``live`` can win."""
    with torch.no_grad():
        moe.router.weight[:, 0] = -3.0
        moe.router.weight[live, 0] = 3.0


def _moe_layer_body(rank: int) -> None:
    T_all = (6, 13)
    for live in (None, [0, 3], [1, 6]):  # real routing; all rows to rank 0; zero-token experts on both ranks
        ref = _moe(seed=0)
        if live is not None:
            _route_to(ref, live)
        g = torch.Generator().manual_seed(7)
        xs = [torch.randn(T, D, generator=g) for T in T_all]
        cs = [torch.randn(T, D, generator=g) for T in T_all]
        if live is not None:
            for x in xs:
                x[:, 0] = 4.0
        # Reference: one process, every token and every expert, local dispatch.
        ref.train()
        x_ref = torch.cat(xs).requires_grad_()
        out_ref = ref(x_ref)
        (out_ref * torch.cat(cs)).sum().backward()

        d = build_dispatcher(AllToAllConfig(), E, K, dist.group.WORLD)
        ep = _ep_moe(d, full=_moe(seed=0))
        if live is not None:
            _route_to(ep, live)
        ep.train()
        x = xs[rank].clone().requires_grad_()
        out = ep(x)
        (out * cs[rank]).sum().backward()

        start = sum(T_all[:rank])
        rows = slice(start, start + T_all[rank])
        assert rel_err(out, out_ref[rows]) < 1e-6
        assert rel_err(x.grad, x_ref.grad[rows]) < 1e-6
        first, e = rank * d.num_local_experts, d.num_local_experts
        for name in ("gate_up_proj", "down_proj"):
            got = getattr(ep.experts, name).grad
            want = getattr(ref.experts, name).grad[first : first + e]
            assert rel_err(got, want) < 1e-6, name
        router_grad = ep.router.weight.grad.clone()
        dist.all_reduce(router_grad)  # each rank's router saw only its tokens
        assert rel_err(router_grad, ref.router.weight.grad) < 1e-6
        if live == [0, 3] and rank == 1:
            assert ep.experts.gate_up_proj.grad.abs().sum() == 0  # rank 1's experts got no rows


def test_moe_layer_ep2_matches_single_process():
    run_ranks(_moe_layer_body, 2)


def test_local_dispatcher_is_the_ep1_case():
    assert isinstance(build_dispatcher(AllToAllConfig(), E, K, None), LocalDispatcher)

"""comm=all_to_all: the dispatcher on 2 gloo ranks with uneven and empty splits (rows, order, combine and
gradients; rows on the wire), with comm.dedup on and off, its expert-major permutation, and the local dispatcher as the EP=1 case. (The MoE layer under EP=2:
tests/moe/test_layer.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moe_tune.config import AllToAllConfig
from moe_tune.moe.dispatch import build_dispatcher
from moe_tune.moe.dispatch.all_to_all import AllToAllDispatcher
from moe_tune.moe.dispatch.base import expert_major_positions
from moe_tune.moe.dispatch.local import LocalDispatcher
from tests.harness import run_ranks

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


def _dispatcher_body(rank: int, dedup: bool) -> None:
    group = dist.group.WORLD
    for case in ("random", "one_rank", "sparse"):
        for T in ((5, 11), (7, 0)):
            g = torch.Generator().manual_seed(100 * rank + T[rank])
            ids_TK = _ids(case, rank, T[rank], g)
            x_TD = torch.randn(T[rank], D, generator=g, requires_grad=True)
            w_TK = torch.rand(T[rank], K, generator=g, requires_grad=True)
            scale_E = torch.arange(1.0, E + 1)  # "expert" j multiplies its rows by j + 1
            d = AllToAllDispatcher(E, K, group, AllToAllConfig(dedup=dedup))
            x_RD, counts_e, ctx = d.dispatch(x_TD, ids_TK)
            assert counts_e.sum().item() == x_RD.shape[0]
            # On the wire: one row per (token, ep rank holding any of its experts) with dedup, else per expert.
            pairs = {(t, j // d.num_local_experts) for t, row in enumerate(ids_TK.tolist()) for j in row}
            assert sum(ctx.send_splits) == (len(pairs) if dedup else ids_TK.numel())
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


@pytest.mark.parametrize("dedup", [True, False], ids=["one_row_per_rank", "one_row_per_expert"])
def test_dispatcher_uneven_and_empty_splits(dedup):
    run_ranks(_dispatcher_body, 2, dedup)


def test_local_dispatcher_is_the_ep1_case():
    assert isinstance(build_dispatcher(AllToAllConfig(), E, K, None), LocalDispatcher)

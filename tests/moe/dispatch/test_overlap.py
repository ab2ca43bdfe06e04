"""comm.overlap=true against false: the MoE layer with its tokens in two pipelined halves gives the plain layer's
output and gradients (fp32, 1e-6), on 2 gloo ranks under EP=2 (uneven and empty splits, odd token counts, one
token, a rank without tokens, a gated shared expert) and in one process through the dispatcher contract's
default (sequential) async methods. The tiny Qwen3-MoE model under EP=2: tests/distributed/test_overlap.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from moe_tune.config import AllToAllConfig
from moe_tune.moe.dispatch import build_dispatcher
from moe_tune.moe.dispatch.local import LocalDispatcher
from moe_tune.moe.experts import ExpertsOptions, ExpertsSpec
from moe_tune.moe.layer import MoE, MoESpec
from moe_tune.moe.router import RouterSpec
from moe_tune.moe.stats import LayerStats
from tests.harness import run_ranks
from tests.tiny import rel_err

E, K, D, H = 8, 2, 16, 12
# Tokens on (rank 0, rank 1): uneven with odd counts (halves 3/3 and 7/6), odd halves 2/1 against 1/0, one
# token against none (a rank whose halves are both empty).
TOKENS = ((6, 13), (3, 1), (1, 0))
# Routing: real; every row to rank 0's experts (rank 1 receives nothing: empty splits); two experts only.
ROUTES = (None, [0, 3], [1, 6])


def _spec() -> MoESpec:
    return MoESpec(
        # Sigmoid scores with a selection-only bias (DeepSeek-V3's): ``live`` forces routing while the gates stay
        # unsaturated, so the router's gradient is well conditioned (a saturated softmax's cancels to ~1e-6).
        router=RouterSpec(num_experts=E, top_k=K, score="sigmoid", correction_bias=True, norm_topk_prob=True),
        experts=ExpertsSpec(num_experts=E, dim=D, hidden=H),
        shared_attr="shared_expert",
        shared_gate_attr="shared_expert_gate",
    )


def _moe(dispatcher, live: list[int] | None, dtype: torch.dtype = torch.float32) -> MoE:
    """This rank's layer: the same random weights on every rank and for both settings (experts: this rank's
    block of them); ``live``: only those experts are chosen. fp64: the per-expert loop (grouped_mm has no fp64)."""
    shared = {
        "shared_expert": nn.Sequential(nn.Linear(D, H), nn.SiLU(), nn.Linear(H, D)),
        "shared_expert_gate": nn.Linear(D, 1),
    }
    impl = ExpertsOptions(impl="grouped_mm" if dtype == torch.float32 else "loop")
    moe = MoE(_spec(), shared, dispatcher, impl, stats=LayerStats(None))
    g = torch.Generator().manual_seed(0)
    first, e = dispatcher.first_local_expert, dispatcher.num_local_experts
    with torch.no_grad():
        for name, p in sorted(moe.named_parameters()):
            full = torch.randn((E, *p.shape[1:]) if name.startswith("experts.") else p.shape, generator=g) * 0.3
            p.copy_(full[first : first + e] if name.startswith("experts.") else full)
        if live is not None:
            moe.router.e_score_correction_bias[live] = 10.0  # sigmoid scores are in (0, 1): these always win
    return moe.to(dtype).train()


def _inputs(T: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, D, generator=g), torch.randn(T, D, generator=g)


def _run(moe: MoE, x: torch.Tensor, c: torch.Tensor):
    """Output, input gradient, every parameter's gradient and the balancing loss of ``(moe(x) * c).sum()``."""
    x = x.clone().requires_grad_()
    out = moe(x)
    (out * c).sum().backward()
    grads = {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in moe.named_parameters()}
    return out.detach(), x.grad, grads, moe.stats.aux_loss.detach()


def _compare(plain, overlapped, what: str, tol: float = 1e-6) -> list[str]:
    (out, gx, grads, aux), (out2, gx2, grads2, aux2) = plain, overlapped
    pairs = [("out", out2, out), ("x.grad", gx2, gx), ("aux_loss", aux2, aux)]
    pairs += [(f"{n}.grad", grads2[n], grads[n]) for n in grads]
    return [f"{what} {name}: rel err {rel_err(a, b):.1e}" for name, a, b in pairs if rel_err(a, b) > tol]


def _layer_body(rank: int) -> None:
    failures = []
    # fp32 (1e-6: the expert GEMMs round differently on row blocks of another size), and fp64 (1e-12: the
    # pipeline computes exactly the same sums; only the expert weights' gradients are added in two parts).
    for dtype, tol in ((torch.float32, 1e-6), (torch.float64, 1e-12)):
        for T in TOKENS:
            for live in ROUTES:
                x, c = (t.to(dtype) for t in _inputs(T[rank], seed=10 * rank + T[rank]))
                results = []
                for overlap in (False, True):
                    d = build_dispatcher(AllToAllConfig(overlap=overlap), E, K, dist.group.WORLD)
                    assert d.overlap is overlap
                    results.append(_run(_moe(d, live, dtype), x, c))
                failures += _compare(*results, f"{dtype} T={T} live={live}", tol)
                if live == [0, 3] and rank == 1:  # the empty splits happened: rank 1's experts got no rows
                    assert results[1][2]["experts.gate_up_proj"].abs().sum() == 0
    assert not failures, f"rank {rank}: " + "; ".join(failures)


@pytest.mark.dist
def test_overlap_matches_plain_ep2():
    run_ranks(_layer_body, 2)


@pytest.mark.parametrize("T", [0, 1, 2, 7])
def test_halves_through_the_default_async_methods(T):
    """A dispatcher without its own async methods (the contract's defaults) runs the same schedule in order."""
    x, c = _inputs(T, seed=T)
    results = []
    for overlap in (False, True):
        d = LocalDispatcher(E, K)
        d.overlap = overlap
        results.append(_run(_moe(d, None), x, c))
    failures = _compare(*results, f"T={T}")
    assert not failures, "; ".join(failures)

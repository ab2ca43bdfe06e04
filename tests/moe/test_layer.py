"""The MoE layer on routing edge cases: grouped_mm experts against the per-expert loop and a per-token dense
reference, forward and backward, for both expert layouts; and the layer under EP=2 (all_to_all dispatch on 2 gloo
ranks) against the single-process layer, forward and gradients in fp32.

CPU grouped_mm cannot take an expanded (stride-0) upstream gradient, so losses are ``(y * g).sum()`` with a
random ``g``, never ``y.sum()``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moe_tune.config import AllToAllConfig
from moe_tune.moe.dispatch import build_dispatcher
from moe_tune.moe.experts import ExpertsOptions, ExpertsSpec
from moe_tune.moe.layer import MoE, MoESpec
from moe_tune.moe.router import RouterSpec
from moe_tune.moe.stats import LayerStats, MoEStats, MoEStatsCollector
from tests.harness import run_ranks
from tests.tiny import rel_err

D, HIDDEN, T = 24, 20, 30  # gate/up 40 x 24, down 24 x 20: no square weight

LAYOUTS = {
    # Qwen/DeepSeek-style: [E, 2I, D] / [E, D, I], plain SwiGLU, no expert biases.
    "out_in": dict(layout="out_in"),
    # GPT-OSS-style: [E, D, 2I] interleaved / [E, I, D], clamped SwiGLU, expert biases.
    "in_out": dict(layout="in_out", bias=True, activation="clamped_swiglu"),
}


def build_moe(
    layout: str,
    num_experts: int,
    top_k: int,
    score: str = "softmax",
    favour=None,
    seed: int = 0,
    z_loss=False,
    stats: LayerStats | None = None,
) -> MoE:
    """``favour``: {expert: router bias}; a large bias sends every token to that expert. ``stats``: the layer's
    slot (default: one of its own, which the tests read)."""
    spec = MoESpec(
        router=RouterSpec(num_experts=num_experts, top_k=top_k, score=score, bias=True, norm_topk_prob=True),
        experts=ExpertsSpec(num_experts=num_experts, dim=D, hidden=HIDDEN, **LAYOUTS[layout]),
        z_loss=z_loss,
    )
    moe = MoE(spec, stats=stats or LayerStats(None))
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.5)
        for expert, b in (favour or {}).items():
            moe.router.bias[expert] = b
    return moe


def dense_reference(moe: MoE, x_TD: torch.Tensor) -> torch.Tensor:
    """Token by token, choice by choice: ``sum_k w_tk * expert_{id_tk}(x_t)``; no sorting, no grouping."""
    weights_TK, ids_TK, _, _ = moe.router(x_TD)
    ex = moe.experts
    w1, w2 = ex._weights_KN()
    rows = []
    for t in range(x_TD.shape[0]):
        acc = x_TD.new_zeros(D)
        for k in range(ids_TK.shape[1]):
            j = int(ids_TK[t, k])
            h = x_TD[t] @ w1[j] + (ex.gate_up_proj_bias[j] if ex.spec.bias else 0)
            y = ex._activation(h) @ w2[j] + (ex.down_proj_bias[j] if ex.spec.bias else 0)
            acc = acc + weights_TK[t, k] * y
        rows.append(acc)
    return torch.stack(rows) if rows else x_TD.new_zeros(0, D)


def run(moe: MoE, x_TD: torch.Tensor, g_TD: torch.Tensor, impl: str):
    """Output and gradients (input and every parameter) of ``(y * g).sum()``."""
    moe.zero_grad(set_to_none=True)
    x = x_TD.clone().requires_grad_(True)
    if impl == "dense":
        y = dense_reference(moe, x)
    else:
        moe.experts.options = ExpertsOptions(impl=impl)  # the same weights through another implementation
        y = moe(x)
    (y * g_TD).sum().backward()
    grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in moe.named_parameters()}
    return y.detach(), x.grad, grads


CASES = {
    # every token to expert 2 (top-1): one group holds all rows, the others none
    "all_to_one": dict(num_experts=4, top_k=1, favour={2: 50.0}),
    # only experts 1 and 4 receive tokens; the first and the last expert are empty
    "zero_token_experts": dict(num_experts=6, top_k=2, favour={1: 50.0, 4: 40.0}),
    # every token to every expert
    "top_k_equals_experts": dict(num_experts=4, top_k=4),
    "random": dict(num_experts=8, top_k=2),
}


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Each entry to 1e-5 relative, or 1e-5 of the tensor's largest entry (at least 1e-5): sums over tokens and
    experts (top_k = num_experts included) cancel, so an entry near zero keeps its terms' rounding."""
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * max(float(b.abs().max()), 1.0), msg=what)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", CASES)
def test_grouped_matches_loop_and_dense(layout, case):
    moe = build_moe(layout, **CASES[case])
    gen = torch.Generator().manual_seed(1)
    x_TD, g_TD = torch.randn(T, D, generator=gen), torch.randn(T, D, generator=gen)
    y, gx, grads = run(moe, x_TD, g_TD, "grouped_mm")
    counts_E = moe.stats.counts_E
    assert int(counts_E.sum()) == T * moe.spec.router.top_k
    for ref_impl in ("loop", "dense"):
        y_ref, gx_ref, grads_ref = run(moe, x_TD, g_TD, ref_impl)
        _close(y, y_ref, "output")
        _close(gx, gx_ref, "input gradient")
        for name in grads:
            _close(grads[name], grads_ref[name], name)
    # experts that received no rows get exactly zero gradient (not NaN, not garbage)
    empty = (counts_E == 0).nonzero().flatten()
    for name in ("gate_up_proj", "down_proj") + (
        ("gate_up_proj_bias", "down_proj_bias") if moe.spec.experts.bias else ()
    ):
        g = grads[f"experts.{name}"]
        assert torch.isfinite(g).all()
        assert torch.all(g[empty] == 0), name
        assert torch.all(g[counts_E > 0].flatten(1).abs().sum(-1) > 0), name
    if case == "all_to_one":
        assert counts_E.tolist() == [0, 0, T, 0]
    if case == "zero_token_experts":
        assert counts_E.tolist() == [0, T, 0, 0, T, 0]


@pytest.mark.parametrize("score", ["softmax", "topk_softmax", "sigmoid"])
def test_score_modes_through_the_layer(score):
    moe = build_moe("in_out", num_experts=8, top_k=2, score=score)
    gen = torch.Generator().manual_seed(2)
    x_TD, g_TD = torch.randn(T, D, generator=gen), torch.randn(T, D, generator=gen)
    y, gx, grads = run(moe, x_TD, g_TD, "grouped_mm")
    y_ref, gx_ref, grads_ref = run(moe, x_TD, g_TD, "dense")
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx, gx_ref, rtol=1e-5, atol=1e-5)
    for name in grads:
        torch.testing.assert_close(grads[name], grads_ref[name], rtol=1e-5, atol=1e-5, msg=name)


def test_no_tokens():
    moe = build_moe("out_in", num_experts=4, top_k=2)
    x = torch.zeros(0, D, requires_grad=True)
    y = moe(x)
    assert y.shape == (0, D)
    (y * torch.randn_like(y)).sum().backward()
    assert torch.all(moe.experts.gate_up_proj.grad == 0)


def test_batched_shape_stats_and_tuple():
    """[B, S, D] in, same shape out; per-layer statistics and losses, taken as one value for the model's output
    (the balancing losses in training only); GPT-OSS returns a tuple."""
    assert not MoESpec(RouterSpec(4, 2), ExpertsSpec(4, D, HIDDEN)).z_loss  # computed only when a run asks
    collector = MoEStatsCollector()
    moe = build_moe("out_in", num_experts=4, top_k=2, z_loss=True, stats=collector.layer(3))
    x = torch.randn(2, 5, D)
    moe.train()
    y = moe(x)
    assert y.shape == x.shape
    stats = collector.take()
    assert stats.layer_idx == (3,) and collector.take() == MoEStats()  # taken once
    (counts_E_got,), (aux_loss,), (z_loss,) = stats.counts_E, stats.aux_loss, stats.z_loss
    # The statistics' values, from the router's own outputs on the same tokens: Switch/GShard's E * sum f_i P_i
    # (f_i: rows per expert / T, P_i: mean probability) and ST-MoE's mean squared logsumexp.
    _, ids_TK, scores_TE, logits_TE = moe.router(x.reshape(-1, D))
    counts_E = torch.bincount(ids_TK.reshape(-1), minlength=4)
    assert torch.equal(counts_E_got, counts_E) and int(counts_E.sum()) == 2 * 5 * 2
    assert torch.equal(stats.counts_LE(), counts_E[None]) and torch.equal(stats.counts_LE([3]), counts_E[None])
    expected_aux = 4 * ((counts_E.float() / 10) * scores_TE.mean(dim=0)).sum()
    torch.testing.assert_close(aux_loss, expected_aux, rtol=1e-6, atol=0)
    torch.testing.assert_close(z_loss, torch.logsumexp(logits_TE.float(), -1).square().mean(), rtol=1e-6, atol=0)
    assert aux_loss.requires_grad and z_loss.requires_grad and not counts_E_got.requires_grad
    moe.eval()
    torch.testing.assert_close(moe(x), y)
    evaluated = collector.take()  # an evaluation's forward: its own loads, no balancing losses
    assert torch.equal(evaluated.counts_E[0], counts_E) and evaluated.aux_loss == evaluated.z_loss == ()
    tupled = MoE(MoESpec(router=moe.spec.router, experts=moe.spec.experts, returns_tuple=True))
    tupled.load_state_dict(moe.state_dict())
    out, weights_TK = tupled.eval()(x)
    torch.testing.assert_close(out, y)
    assert weights_TK.shape == (10, 2)


def test_bias_experts_with_capacity_padding_rows():
    """A fixed-capacity dispatcher (symm_mem) hands the experts padding rows past counts_e.sum(): the biased
    (GPT-OSS) experts must still give the real rows exactly what they give without padding."""
    moe = build_moe("in_out", num_experts=4, top_k=2)
    experts = moe.experts
    x_RD = torch.randn(10, D)
    counts_e = torch.tensor([3, 0, 4, 3])
    ref = experts(x_RD, counts_e)
    padded = experts(torch.cat([x_RD, torch.randn(6, D)]), counts_e)
    # To fp32's last bits, not bitwise: the element-wise activation on strided views vectorises by the total row
    # count, so the padding can move a real row's last bit; a padding row leaking into a real one moves it by O(1).
    torch.testing.assert_close(padded[:10], ref, rtol=1e-6, atol=1e-7)


def test_bias_grads_ignore_garbage_on_padding_rows():
    """Stale buffer contents (even NaN) in the gradient of padding rows must not reach the bias gradients."""
    moe = build_moe("in_out", num_experts=4, top_k=2)
    experts = moe.experts
    counts_e = torch.tensor([3, 0, 4, 3])
    x_RD = torch.randn(10, D)
    g_RD = torch.randn(10, D)
    experts(x_RD, counts_e).mul(g_RD).sum().backward()
    ref = {n: p.grad.clone() for n, p in experts.named_parameters()}
    experts.zero_grad()
    y = experts(torch.cat([x_RD, torch.randn(6, D)]), counts_e)
    garbage = torch.cat([g_RD, torch.full((6, D), float("nan"))])
    y.backward(garbage)
    for n, p in experts.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], rtol=1e-6, atol=1e-6, msg=n)


# -- the layer under expert parallelism (EP=2, all_to_all on 2 gloo ranks) --------------------------------

E, K = 8, 2


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


@pytest.mark.dist
def test_moe_layer_ep2_matches_single_process():
    run_ranks(_moe_layer_body, 2)

"""Router: every score mode against the Hugging Face router class of its family; balancing losses; expert bias."""

from __future__ import annotations

import importlib

import pytest
import torch
from transformers import AutoConfig

from moe_tune.models.families import get_family
from moe_tune.moe.router import (
    Router,
    RouterSpec,
    expert_counts,
    load_balancing_loss,
    update_expert_bias,
    z_loss,
)

D, E, K, T = 32, 8, 2, 64

# (model_type, HF router class, config fields that matter for routing)
HF_ROUTERS = [
    ("qwen3_moe", "Qwen3MoeTopKRouter", dict(num_experts=E, norm_topk_prob=False)),
    ("qwen3_moe", "Qwen3MoeTopKRouter", dict(num_experts=E, norm_topk_prob=True)),
    ("qwen2_moe", "Qwen2MoeTopKRouter", dict(num_experts=E, norm_topk_prob=False)),
    ("mixtral", "MixtralTopKRouter", dict(num_local_experts=E)),
    ("olmoe", "OlmoeTopKRouter", dict(num_experts=E, norm_topk_prob=False)),
    ("gpt_oss", "GptOssTopKRouter", dict(num_local_experts=E)),
    (
        "deepseek_v3",
        "DeepseekV3TopkRouter",
        dict(n_routed_experts=E, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5),
    ),
    (
        "glm4_moe",
        "Glm4MoeTopkRouter",
        dict(n_routed_experts=E, n_group=4, topk_group=3, norm_topk_prob=False, routed_scaling_factor=1.5),
    ),
    (
        "glm4_moe",
        "Glm4MoeTopkRouter",
        dict(n_routed_experts=E, n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0),
    ),
]


def _hf_and_ours(model_type: str, cls_name: str, fields: dict, bias_mean: float = 0.0):
    config = AutoConfig.for_model(model_type, hidden_size=D, num_experts_per_tok=K, **fields)
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    torch.manual_seed(0)
    hf = getattr(module, cls_name)(config)
    with torch.no_grad():
        for name, t in [*hf.named_parameters(), *hf.named_buffers()]:
            t.normal_(bias_mean if name == "e_score_correction_bias" else 0.0, 0.5)
    ours = Router(get_family(model_type).moe_spec(config).router, D)
    ours.load_state_dict(hf.state_dict())
    return hf, ours


def _sorted_by_expert(weights_TK, ids_TK):
    ids_TK, order = ids_TK.sort(dim=-1)
    return weights_TK.gather(1, order), ids_TK


# Sigmoid routers again with a correction bias of mean -2, which makes every selection score negative.
CASES = [(*r, 0.0) for r in HF_ROUTERS] + [(*r, -2.0) for r in HF_ROUTERS if "n_routed_experts" in r[2]]


@pytest.mark.parametrize(
    "model_type,cls_name,fields,bias_mean", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)]
)
def test_router_matches_hf(model_type, cls_name, fields, bias_mean):
    """Same logits, same experts (as sets: sigmoid routers take an unsorted top-k), same gates. With negative
    selection scores, experts of dropped groups must still lose (masked with -inf, not 0)."""
    hf, ours = _hf_and_ours(model_type, cls_name, fields, bias_mean)
    x_TD = torch.randn(T, D, generator=torch.Generator().manual_seed(1))
    logits_ref, weights_ref, ids_ref = hf(x_TD)
    weights_TK, ids_TK, scores_TE, logits_TE = ours(x_TD)
    torch.testing.assert_close(logits_TE, logits_ref)
    w_ref, i_ref = _sorted_by_expert(weights_ref.float(), ids_ref)
    w, i = _sorted_by_expert(weights_TK, ids_TK)
    assert torch.equal(i, i_ref)
    torch.testing.assert_close(w, w_ref, rtol=1e-6, atol=1e-7)
    assert weights_TK.dtype == scores_TE.dtype == torch.float32  # fp32 island
    if ours.spec.num_groups > 1:  # experts really come from at most topk_groups groups
        groups_TK = ids_TK // (E // ours.spec.num_groups)
        assert all(len(set(g.tolist())) <= ours.spec.topk_groups for g in groups_TK)


def test_load_balancing_loss_is_top_k_when_balanced():
    counts_E = torch.full((E,), T * K // E)
    uniform_TE = torch.full((T, E), 1.0 / E)
    assert load_balancing_loss(uniform_TE, counts_E, K).item() == pytest.approx(K, abs=1e-6)
    # Any probabilities whose mean over tokens is uniform give K as well.
    probs_TE = torch.eye(E).repeat(T // E, 1)
    assert load_balancing_loss(probs_TE, counts_E, K).item() == pytest.approx(K, abs=1e-6)
    # Imbalance raises it: everything on expert 0 with all probability there gives E * K.
    skewed = torch.zeros(T, E)
    skewed[:, 0] = 1.0
    assert load_balancing_loss(skewed, torch.tensor([T * K] + [0] * (E - 1)), K).item() == pytest.approx(E * K)


def test_load_balancing_loss_hand_formula():
    logits_TE = torch.randn(T, E, generator=torch.Generator().manual_seed(2))
    probs_TE = logits_TE.softmax(-1)
    ids_TK = probs_TE.topk(K, dim=-1).indices
    counts_E = expert_counts(ids_TK, E)
    expected = sum(E * (counts_E[i] / T) * probs_TE[:, i].mean() for i in range(E))
    assert load_balancing_loss(probs_TE, counts_E, K).item() == pytest.approx(expected.item(), rel=1e-6)


def test_hf_load_balancing_loss_double_softmax_pitfall():
    """HF's load_balancing_loss_func softmaxes what it is given. On router logits (one layer) it equals ours.
    Handed probabilities (as a caller that reuses the router's softmax output does), it
    softmaxes them again: softmax of values in [0, 1] is nearly uniform, so the loss sits near its balanced value
    and hides most of the imbalance. Ours takes probabilities and never softmaxes them again."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    logits_TE = 3.0 * torch.randn(T, E, generator=torch.Generator().manual_seed(3))
    logits_TE[:, 0] += 4.0  # expert 0 is overloaded
    probs_TE = logits_TE.softmax(-1)
    counts_E = expert_counts(probs_TE.topk(K, dim=-1).indices, E)
    ours = load_balancing_loss(probs_TE, counts_E, K).item()
    assert load_balancing_loss_func((logits_TE,), E, K).item() == pytest.approx(ours, rel=1e-5)
    double = load_balancing_loss_func((probs_TE,), E, K).item()
    assert ours > 1.5 * K
    assert double - K < 0.25 * (ours - K)  # most of the penalty is gone


def test_z_loss():
    logits_TE = torch.randn(T, E, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    expected = (logits_TE.exp().sum(-1).log() ** 2).mean()
    assert z_loss(logits_TE.to(torch.bfloat16)).dtype == torch.float32
    assert z_loss(logits_TE.float()).item() == pytest.approx(expected.item(), rel=1e-6)


def _sigmoid_router(seed: int = 0) -> Router:
    spec = RouterSpec(num_experts=E, top_k=K, score="sigmoid", norm_topk_prob=True, correction_bias=True)
    router = Router(spec, D)
    with torch.no_grad():
        router.weight.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(seed))
        router.weight[0] += 1.0  # expert 0 is overloaded
    return router


def test_update_expert_bias_moves_toward_balance():
    router = _sigmoid_router()
    x_TD = torch.randn(256, D, generator=torch.Generator().manual_seed(5)) + 0.5
    counts_E = expert_counts(router(x_TD)[1], E)
    before = counts_E.max().item() / counts_E.float().mean().item()
    update_expert_bias([router], counts_E[None].clone(), rate=0.01)
    bias = router.e_score_correction_bias
    mean = counts_E.float().mean()
    assert torch.all(bias[counts_E > mean] < 0) and torch.all(bias[counts_E < mean] > 0)
    assert torch.all(bias[counts_E == mean] == 0)
    for _ in range(200):
        update_expert_bias([router], expert_counts(router(x_TD)[1], E)[None], rate=0.01)
    counts_E = expert_counts(router(x_TD)[1], E)
    after = counts_E.max().item() / counts_E.float().mean().item()
    assert after < before and after < 1.5
    # The bias only decides selection: gates stay the raw sigmoid scores of the chosen experts (renormalised).
    weights_TK, ids_TK, scores_TE, _ = router(x_TD)
    torch.testing.assert_close(
        weights_TK, scores_TE.gather(1, ids_TK) / scores_TE.gather(1, ids_TK).sum(-1, keepdim=True)
    )


@pytest.mark.parametrize("score", ["softmax", "topk_softmax", "sigmoid"])
def test_force_balanced_gives_equal_counts(score):
    spec = RouterSpec(num_experts=E, top_k=K, score=score, correction_bias=score == "sigmoid", force_balanced=True)
    router = Router(spec, D)
    with torch.no_grad():
        router.weight.normal_()
        router.weight[3] += 5.0
    weights_TK, ids_TK, scores_TE, _ = router(torch.randn(T, D).abs())
    assert torch.equal(expert_counts(ids_TK, E), torch.full((E,), T * K // E))
    assert torch.all(ids_TK[:, 0] != ids_TK[:, 1])
    if score == "topk_softmax":  # gates are the softmax over the forced experts' logits
        torch.testing.assert_close(weights_TK.sum(-1), torch.ones(T))

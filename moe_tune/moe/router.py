"""Top-k routers for every supported family, computed in fp32, plus load-balancing losses and statistics."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class RouterSpec:
    num_experts: int
    top_k: int
    # "softmax": softmax over all experts then top-k (Qwen, Mixtral, OLMoE).
    # "topk_softmax": top-k over logits then softmax over the k (GPT-OSS).
    # "sigmoid": sigmoid scores, bias-corrected group-limited top-k (DeepSeek-V3, GLM-4-MoE).
    score: str = "softmax"
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    num_groups: int = 1
    topk_groups: int = 1
    # DeepSeek-V3's e_score_correction_bias: added to scores for selection only.
    correction_bias: bool = False
    # GPT-OSS: the router is a Linear with a bias.
    bias: bool = False
    # Forced balanced routing (benchmarks only; a run option, not the family's): token t takes experts
    # t*k .. t*k+k-1 modulo E, gated by their real scores.
    force_balanced: bool = False


class Router(nn.Module):
    """``forward(x_TD) -> (weights_TK fp32, ids_TK, scores_TE fp32, logits_TE)``.

    fp32 island: logits are computed in the input dtype as Hugging Face does, then scores, top-k and the
    gates are in fp32 so that renormalisation and the balancing losses do not lose precision in bf16.
    """

    def __init__(self, spec: RouterSpec, dim: int):
        super().__init__()
        self.spec = spec
        self.weight = nn.Parameter(torch.empty(spec.num_experts, dim))
        self.bias = nn.Parameter(torch.zeros(spec.num_experts)) if spec.bias else None
        if spec.correction_bias:
            self.register_buffer("e_score_correction_bias", torch.zeros(spec.num_experts, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None

    def forward(self, x_TD: torch.Tensor):
        s = self.spec
        # Sigmoid routers (DeepSeek-V3, GLM-4-MoE) take their logits in fp32, as Hugging Face does.
        xd = torch.float32 if s.score == "sigmoid" else x_TD.dtype
        bias = None if self.bias is None else self.bias.to(xd)
        logits_TE = F.linear(x_TD.to(xd), self.weight.to(xd), bias)
        if s.score == "topk_softmax":
            top_TK, ids_TK = torch.topk(logits_TE, s.top_k, dim=-1)
            if s.force_balanced:
                ids_TK = self._balanced(ids_TK)
                top_TK = logits_TE.gather(1, ids_TK)
            # GPT-OSS takes the softmax in the logits' dtype; we keep it in fp32 (an fp32 island for the gates).
            weights_TK = torch.softmax(top_TK.float(), dim=-1)
            scores_TE = torch.softmax(logits_TE.float(), dim=-1)
            return weights_TK, ids_TK, scores_TE, logits_TE
        if s.score == "softmax":
            scores_TE = torch.softmax(logits_TE.float(), dim=-1)
            weights_TK, ids_TK = torch.topk(scores_TE, s.top_k, dim=-1)
        elif s.score == "sigmoid":
            scores_TE = torch.sigmoid(logits_TE.float())
            ids_TK = self._group_limited_topk(scores_TE)
            weights_TK = scores_TE.gather(1, ids_TK)
        else:
            raise ValueError(f"unknown router score {s.score!r}")
        if s.force_balanced:
            ids_TK = self._balanced(ids_TK)
            weights_TK = scores_TE.gather(1, ids_TK)
        if s.norm_topk_prob:
            weights_TK = weights_TK / (weights_TK.sum(dim=-1, keepdim=True) + (1e-20 if s.score == "sigmoid" else 0.0))
        if s.routed_scaling_factor != 1.0:
            weights_TK = weights_TK * s.routed_scaling_factor
        return weights_TK, ids_TK, scores_TE, logits_TE

    def _group_limited_topk(self, scores_TE: torch.Tensor) -> torch.Tensor:
        s = self.spec
        choice_TE = scores_TE.detach()
        if self.e_score_correction_bias is not None:
            choice_TE = choice_TE + self.e_score_correction_bias
        if s.num_groups > 1:
            T = choice_TE.shape[0]
            grouped = choice_TE.view(T, s.num_groups, -1)
            # A group's score is the sum of its two best experts (DeepSeek-V3).
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
            group_ids = torch.topk(group_scores, k=s.topk_groups, dim=-1, sorted=False)[1]
            keep = torch.zeros_like(group_scores).scatter_(1, group_ids, 1.0).bool()
            # -inf, not 0: with a negative correction bias a kept expert can score below 0 and must still win.
            choice_TE = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(T, -1)
        return torch.topk(choice_TE, k=s.top_k, dim=-1, sorted=False)[1]

    def _balanced(self, ids_TK: torch.Tensor) -> torch.Tensor:
        """Token t takes experts t*k .. t*k+k-1 modulo E (``RouterSpec.force_balanced``)."""
        T, K = ids_TK.shape
        start = torch.arange(T, device=ids_TK.device).unsqueeze(1) * K
        return (start + torch.arange(K, device=ids_TK.device)) % self.spec.num_experts


def expert_counts(ids_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Rows per expert without a host sync (bincount's output size would need one)."""
    counts_E = torch.zeros(num_experts, dtype=torch.int64, device=ids_TK.device)
    return counts_E.scatter_add_(0, ids_TK.reshape(-1), torch.ones_like(ids_TK.reshape(-1)))


def load_balancing_loss(scores_TE: torch.Tensor, counts_E: torch.Tensor, top_k: int) -> torch.Tensor:
    """Switch/GShard auxiliary loss for one layer: ``E * sum_i f_i * P_i``, equal to top_k when balanced.

    ``f_i`` = rows routed to expert i per token (counts / T, summing to K) and ``P_i`` the mean router
    probability of expert i. This is Hugging Face's scaling, so a published ``router_aux_loss_coef`` has the
    same strength here (the coefficient multiplies the mean of this over MoE layers). ``scores_TE`` are
    probabilities already (softmax, or sigmoid scores renormalised here): we never apply a softmax to them
    again. Hugging Face's ``load_balancing_loss_func`` takes the router *logits* and applies its own softmax,
    which is right only for softmax routers: for sigmoid routers it softmaxes logits of a model that never used
    a softmax, and a caller handing it probabilities gets a second softmax that hides most of the imbalance.
    """
    del top_k  # f_i sums to K by construction; kept in the signature for the callers' clarity
    E = scores_TE.shape[-1]
    T = scores_TE.shape[0]
    probs_TE = scores_TE / scores_TE.sum(dim=-1, keepdim=True) if T else scores_TE
    f_E = counts_E.float() / max(T, 1)
    P_E = probs_TE.mean(dim=0) if T else probs_TE.sum(dim=0)
    return (f_E * P_E).sum() * E


def z_loss(logits_TE: torch.Tensor) -> torch.Tensor:
    """Router z-loss (ST-MoE): mean squared log-partition, fp32."""
    return torch.logsumexp(logits_TE.float(), dim=-1).square().mean()


@torch.no_grad()
def update_expert_bias(routers: list[Router], counts_LE: torch.Tensor, rate: float, group=None) -> None:
    """Aux-loss-free balancing (DeepSeek-V3): once per optimizer step, move each expert's selection bias
    towards the mean load. ``counts_LE`` are this rank's rows per expert summed over the step's micro-batches;
    they are all-reduced over ``group`` (every data-parallel rank) so all ranks apply the same update."""
    import torch.distributed as dist

    if group is not None and dist.is_initialized():
        dist.all_reduce(counts_LE, group=group)
    load = counts_LE.float()
    delta = torch.sign(load.mean(dim=-1, keepdim=True) - load) * rate
    for router, d in zip(routers, delta):
        router.e_score_correction_bias.add_(d)

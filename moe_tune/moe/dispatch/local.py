"""No expert parallelism: every expert is local, dispatch is a sort."""

from __future__ import annotations

import torch

from moe_tune.moe.dispatch.base import (
    Dispatcher,
    inverse_permutation,
    repeat_tokens,
    sort_by_expert,
    weighted_sum,
)
from moe_tune.moe.router import expert_counts


class LocalDispatcher(Dispatcher):
    def __init__(self, num_experts: int, top_k: int):
        self.num_experts = self.num_local_experts = num_experts
        self.top_k = top_k
        self.first_local_expert = 0

    def dispatch(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, counts_E: torch.Tensor | None = None):
        order_R, _ = sort_by_expert(ids_TK)
        inv_R = inverse_permutation(order_R)
        counts_e = expert_counts(ids_TK, self.num_experts) if counts_E is None else counts_E
        return repeat_tokens(x_TD, order_R, inv_R, self.top_k), counts_e, (order_R, inv_R)

    def combine(self, y_RD: torch.Tensor, weights_TK: torch.Tensor, ctx) -> torch.Tensor:
        order_R, inv_R = ctx
        return weighted_sum(y_RD, order_R, inv_R, weights_TK)

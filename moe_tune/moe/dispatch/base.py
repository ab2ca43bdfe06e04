"""The dispatcher contract and the pure permutation maths every backend shares."""

from __future__ import annotations

from typing import Any

import torch


class Dispatcher:
    """``dispatch`` returns this rank's rows sorted by local expert and ``counts_e``; ``combine`` returns
    ``out_TD = sum_k weights_TK * y`` for every token of this rank. Both are differentiable."""

    num_experts: int
    top_k: int
    num_local_experts: int

    def dispatch(self, x_TD: torch.Tensor, ids_TK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]:
        raise NotImplementedError

    def combine(self, y_RD: torch.Tensor, weights_TK: torch.Tensor, ctx: Any) -> torch.Tensor:
        raise NotImplementedError


def sort_by_expert(ids_TK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stable sort of the T*K routed rows by expert. Returns (order_R, token_of_row_R): row r of the sorted
    layout is copy ``order[r] % K`` of token ``order[r] // K``."""
    K = ids_TK.shape[1]
    order_R = torch.argsort(ids_TK.reshape(-1), stable=True)
    return order_R, order_R // K


def inverse_permutation(order_R: torch.Tensor) -> torch.Tensor:
    inv_R = torch.empty_like(order_R)
    inv_R[order_R] = torch.arange(order_R.numel(), device=order_R.device)
    return inv_R


def weighted_sum(y_RD: torch.Tensor, inv_R: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
    """Undo the sort and reduce the K copies of each token with its gates, in one batched matmul
    (deterministic, no atomics): ``out_T1D = weights_T1K @ y_TKD``."""
    T, K = weights_TK.shape
    y_TKD = y_RD[inv_R].view(T, K, -1)
    return torch.bmm(weights_TK.to(y_TKD.dtype).unsqueeze(1), y_TKD).squeeze(1)

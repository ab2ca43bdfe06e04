"""``comm=all_to_all``: expert parallelism over ``torch.distributed.all_to_all_single`` (NCCL or gloo).

Experts are split in contiguous blocks: ep rank s owns global experts [s*e, (s+1)*e), e = E / ep.
Dispatch, on each rank of the ep group:
  1. sort the T*K routed rows by global expert; this also groups them by destination rank;
  2. all-to-all the per-expert row counts (E ints) so every rank learns counts_Ge, the rows it will
     receive from source s for each of its local experts;
  3. one host sync: all_to_all_single takes its split sizes as Python ints;
  4. all-to-all the rows (uneven and empty splits are fine);
  5. permute the received rows from source-rank-major to local-expert-major order (device ops only).
Every permutation is a gather, forward and backward (``base.permute_rows``, ``base.repeat_tokens``).
Combine is the exact reverse: inverse permutation, all-to-all back with the splits swapped, then the
weighted sum of each token's K copies. Both all-to-alls are differentiable (backward is the reverse
all-to-all), so gradients reach the tokens' ranks and the experts' ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe_tune.config import AllToAllConfig
from moe_tune.moe.dispatch.base import (
    Dispatcher,
    expert_major_positions,
    inverse_permutation,
    permute_rows,
    repeat_tokens,
    sort_by_expert,
    weighted_sum,
)
from moe_tune.moe.router import expert_counts


def _exchange(x_RD: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    out = x_RD.new_empty((sum(out_splits), *x_RD.shape[1:]))
    # Collective over the ep mesh axis: rows [sum(in_splits[:s]), +in_splits[s]) go to ep rank s.
    dist.all_to_all_single(out, x_RD.contiguous(), out_splits, in_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with autograd: backward sends the gradients back along the same routes."""

    @staticmethod
    def forward(ctx, x_RD, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _exchange(x_RD, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad_RD):
        out_splits, in_splits = ctx.splits
        return _exchange(grad_RD, in_splits, out_splits, ctx.group), None, None, None


def all_to_all(x_RD: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    return _AllToAll.apply(x_RD, out_splits, in_splits, group)


@dataclass
class _Route:
    order_R: torch.Tensor  # this rank's sort by global expert
    inv_order_R: torch.Tensor  # undoes it
    dest_R: torch.Tensor  # received (source-major) row r sits at dest_R[r] in expert-major order
    src_R: torch.Tensor  # expert-major row r was received as row src_R[r] (dest_R's inverse)
    send_splits: list[int]
    recv_splits: list[int]


class AllToAllDispatcher(Dispatcher):
    def __init__(
        self,
        num_experts: int,
        top_k: int,
        ep_group,
        options: AllToAllConfig | None = None,
        checked_after_step: bool = False,
    ):
        del options, checked_after_step  # no options, and nothing only the device knows to check
        ep = dist.get_world_size(ep_group)
        self.num_experts, self.top_k, self.ep_group, self.ep = num_experts, top_k, ep_group, ep
        self.num_local_experts = num_experts // ep
        self.first_local_expert = dist.get_rank(ep_group) * self.num_local_experts

    def dispatch(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, counts_E: torch.Tensor | None = None):
        G, e = self.ep, self.num_local_experts
        order_R, _ = sort_by_expert(ids_TK)
        inv_order_R = inverse_permutation(order_R)
        counts_E = expert_counts(ids_TK, self.num_experts) if counts_E is None else counts_E
        counts_Ge = torch.empty_like(counts_E)
        # Collective over the ep mesh axis: e counts to each ep rank, for the experts it owns.
        dist.all_to_all_single(counts_Ge, counts_E, group=self.ep_group)
        counts_Ge = counts_Ge.view(G, e)
        # host sync: all_to_all_single needs its split sizes as Python ints (the one sync of this backend).
        send_splits, recv_splits = torch.stack([counts_E.view(G, e).sum(1), counts_Ge.sum(1)]).tolist()
        sorted_RD = repeat_tokens(x_TD, order_R, inv_order_R, self.top_k)
        routed_RD = all_to_all(sorted_RD, recv_splits, send_splits, self.ep_group)
        dest_R = expert_major_positions(counts_Ge, sum(recv_splits))
        src_R = inverse_permutation(dest_R)
        # Into expert-major order: a gather (its backward too; no scatter).
        x_RD = permute_rows(routed_RD, src_R, dest_R)
        route = _Route(order_R, inv_order_R, dest_R, src_R, send_splits, recv_splits)
        return x_RD, counts_Ge.sum(0), route

    def combine(self, y_RD: torch.Tensor, weights_TK: torch.Tensor, ctx: _Route) -> torch.Tensor:
        # Back to source-rank-major order, then the reverse all-to-all (ep mesh axis) returns each row home.
        back_RD = all_to_all(permute_rows(y_RD, ctx.dest_R, ctx.src_R), ctx.send_splits, ctx.recv_splits, self.ep_group)
        return weighted_sum(back_RD, ctx.order_R, ctx.inv_order_R, weights_TK)

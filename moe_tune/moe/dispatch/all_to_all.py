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

``comm.overlap=true`` (``dispatch_async``/``combine_async``, driven by ``moe_tune.moe.overlap``): the layer's
tokens come in chunks (two halves); steps 2-3 run once for all chunks (one counts exchange, one host sync per
layer, as without overlap), and each chunk's row all-to-all runs on the side stream (``streams.launch``) while
the compute stream goes on; the permutations stay on the compute stream.
"""

from __future__ import annotations

import functools
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
from moe_tune.moe.dispatch.streams import Pending, launch
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
    counts_e: torch.Tensor  # rows received per local expert


class AllToAllDispatcher(Dispatcher):
    def __init__(
        self,
        num_experts: int,
        top_k: int,
        ep_group,
        options: AllToAllConfig | None = None,
        checked_after_step: bool = False,
    ):
        del checked_after_step  # nothing only the device knows to check
        ep = dist.get_world_size(ep_group)
        self.num_experts, self.top_k, self.ep_group, self.ep = num_experts, top_k, ep_group, ep
        self.num_local_experts = num_experts // ep
        self.first_local_expert = dist.get_rank(ep_group) * self.num_local_experts
        self.overlap = (options or AllToAllConfig()).overlap

    def _routes(self, ids: list[torch.Tensor], counts: list[torch.Tensor]) -> list[_Route]:
        """The routes of one or more chunks of this rank's tokens (``ids[i]``, ``counts[i]``: chunk i's experts
        and rows per global expert), with one counts exchange and one host sync for all of them."""
        G, e, n = self.ep, self.num_local_experts, len(ids)
        orders = [sort_by_expert(ids_TK)[0] for ids_TK in ids]
        # [G, n, e]: for each ep rank, every chunk's counts of the experts it owns.
        send_Gne = torch.stack(counts).view(n, G, e).transpose(0, 1).contiguous()
        recv_Gne = torch.empty_like(send_Gne)
        # Collective over the ep mesh axis: n*e counts to each ep rank, for the experts it owns.
        dist.all_to_all_single(recv_Gne, send_Gne, group=self.ep_group)
        # host sync: all_to_all_single needs its split sizes as Python ints (the one sync per layer, all chunks).
        send_nG, recv_nG = torch.stack([send_Gne.sum(2).t(), recv_Gne.sum(2).t()]).tolist()
        routes = []
        for i, order_R in enumerate(orders):
            counts_Ge = recv_Gne[:, i]
            dest_R = expert_major_positions(counts_Ge, sum(recv_nG[i]))
            inv_order_R, src_R = inverse_permutation(order_R), inverse_permutation(dest_R)
            routes.append(_Route(order_R, inv_order_R, dest_R, src_R, send_nG[i], recv_nG[i], counts_Ge.sum(0)))
        return routes

    def _send(self, x_TD: torch.Tensor, route: _Route) -> torch.Tensor:
        return repeat_tokens(x_TD, route.order_R, route.inv_order_R, self.top_k)

    def _arrived(self, routed_RD: torch.Tensor, route: _Route):
        # Into expert-major order: a gather (its backward too; no scatter).
        return permute_rows(routed_RD, route.src_R, route.dest_R), route.counts_e, route

    def dispatch(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, counts_E: torch.Tensor | None = None):
        counts_E = expert_counts(ids_TK, self.num_experts) if counts_E is None else counts_E
        (route,) = self._routes([ids_TK], [counts_E])
        routed_RD = all_to_all(self._send(x_TD, route), route.recv_splits, route.send_splits, self.ep_group)
        return self._arrived(routed_RD, route)

    def combine(self, y_RD: torch.Tensor, weights_TK: torch.Tensor, ctx: _Route) -> torch.Tensor:
        # Back to source-rank-major order, then the reverse all-to-all (ep mesh axis) returns each row home.
        back_RD = all_to_all(permute_rows(y_RD, ctx.dest_R, ctx.src_R), ctx.send_splits, ctx.recv_splits, self.ep_group)
        return weighted_sum(back_RD, ctx.order_R, ctx.inv_order_R, weights_TK)

    def dispatch_async(self, chunks: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> list[Pending]:
        routes = self._routes([ids_TK for _, ids_TK, _ in chunks], [counts_E for _, _, counts_E in chunks])
        pending = []
        for (x_TD, _, _), route in zip(chunks, routes):
            # The gather on the compute stream, the all-to-all (ep mesh axis) on the side stream.
            sent = launch(all_to_all, self._send(x_TD, route), route.recv_splits, route.send_splits, self.ep_group)
            sent.finish = functools.partial(self._arrived, route=route)
            pending.append(sent)
        return pending

    def combine_async(self, y_RD: torch.Tensor, weights_TK: torch.Tensor, ctx: _Route) -> Pending:
        # As combine: the permutation on the compute stream, the all-to-all (ep mesh axis) on the side stream,
        # the weighted sum on the compute stream once the rows are home.
        back_RD = permute_rows(y_RD, ctx.dest_R, ctx.src_R)
        sent = launch(all_to_all, back_RD, ctx.send_splits, ctx.recv_splits, self.ep_group)
        sent.finish = functools.partial(weighted_sum, order_R=ctx.order_R, inv_R=ctx.inv_order_R, weights_TK=weights_TK)
        return sent

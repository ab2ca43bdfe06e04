"""``comm=all_to_all``: expert parallelism over ``torch.distributed.all_to_all_single`` (NCCL or gloo).

Experts are split in contiguous blocks: ep rank s owns global experts [s*e, (s+1)*e), e = E / ep.

``comm.dedup=true``: each token crosses to an ep rank once, however many of its K experts live
there (DeepEP's layout). With top-8 of 128 experts on 2 ranks a token has about 4 experts on each rank, so the
rows on the wire drop about 4x. Dispatch sends the token and, per slot k, its local expert id there (``e``: held
elsewhere); the expert's rank expands each token to its local experts' rows (a gather), and its combine weights
and sums them (the gates travel with the combine, a K-float exchange), so one partial sum per (token, rank)
comes home, where the ranks' partials are added. Every expansion and reduction is a gather, forward and
backward (``base.take_rows``, ``base.gather_rows``).

``comm.dedup=false`` (the default): one row per (token, expert). Dispatch, on each rank of the ep group:
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
    gather_rows,
    inverse_permutation,
    permute_rows,
    repeat_tokens,
    sort_by_expert,
    take_rows,
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


@dataclass
class _RankRoute:
    """comm.dedup=true: one row per (token, destination ep rank). S rows sent (rank-major, token order within a
    rank), R tokens received (source-major), expanded to N rows in local-expert-major order."""

    token_S: torch.Tensor  # sent row s is token token_S[s]
    inverse_TG: torch.Tensor  # token t's row for ep rank g is inverse_TG[t, g] (S: t has no expert there)
    home_S: torch.Tensor  # sent row s sits at home_S[s] in inverse_TG.reshape(-1)
    local_RK: torch.Tensor  # received token r's slot k: local expert id, e where the expert is elsewhere
    order_N: torch.Tensor  # expert-major row n expands slot order_N[n] of local_RK.reshape(-1)
    slot_RK: torch.Tensor  # slot (r, k)'s row in expert-major order (N: the slot is elsewhere)
    send_splits: list[int]  # tokens to each ep rank
    recv_splits: list[int]  # tokens from each ep rank
    counts_e: torch.Tensor  # rows per local expert


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
        options = options or AllToAllConfig()
        self.overlap, self.dedup = options.overlap, options.dedup

    def _exchange_counts(self, counts_nGc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``counts_nGc[i, g]``: chunk i's c counts for ep rank g. Returns (sent, received) as [G, n, c]: what this
        rank sent to each ep rank and what each ep rank sent to it, one collective for all chunks."""
        send_Gnc = counts_nGc.transpose(0, 1).contiguous()
        recv_Gnc = torch.empty_like(send_Gnc)
        # Collective over the ep mesh axis: n*c counts to each ep rank.
        dist.all_to_all_single(recv_Gnc, send_Gnc, group=self.ep_group)
        return send_Gnc, recv_Gnc

    def _routes(self, ids: list[torch.Tensor], counts: list[torch.Tensor]) -> list[_Route] | list[_RankRoute]:
        """The routes of one or more chunks of this rank's tokens (``ids[i]``, ``counts[i]``: chunk i's experts
        and rows per global expert), with one counts exchange and one host sync for all of them."""
        G, e, n = self.ep, self.num_local_experts, len(ids)
        if self.dedup:
            return self._rank_routes(ids, counts)
        orders = [sort_by_expert(ids_TK)[0] for ids_TK in ids]
        send_Gne, recv_Gne = self._exchange_counts(torch.stack(counts).view(n, G, e))
        # host sync: all_to_all_single needs its split sizes as Python ints (the one sync per layer, all chunks).
        send_nG, recv_nG = torch.stack([send_Gne.sum(2).t(), recv_Gne.sum(2).t()]).tolist()
        routes = []
        for i, order_R in enumerate(orders):
            counts_Ge = recv_Gne[:, i]
            dest_R = expert_major_positions(counts_Ge, sum(recv_nG[i]))
            inv_order_R, src_R = inverse_permutation(order_R), inverse_permutation(dest_R)
            routes.append(_Route(order_R, inv_order_R, dest_R, src_R, send_nG[i], recv_nG[i], counts_Ge.sum(0)))
        return routes

    def _rank_routes(self, ids: list[torch.Tensor], counts: list[torch.Tensor]) -> list[_RankRoute]:
        """``_routes`` for comm.dedup=true: per chunk, which tokens go to which ep rank, exchanged with the
        per-expert counts (one exchange, one host sync for all chunks), then each chunk's local expert ids."""
        G, e, n, K = self.ep, self.num_local_experts, len(ids), self.top_k
        device = ids[0].device
        ranks = torch.arange(G, device=device)
        # hit_GT[g, t]: token t has at least one of its K experts on ep rank g.
        hits = [((ids_TK // e).unsqueeze(0) == ranks.view(G, 1, 1)).any(-1) for ids_TK in ids]
        # Per ep rank and chunk: the rows for each expert it owns, then the chunk's tokens it receives.
        tokens_nG1 = torch.stack([h.sum(1) for h in hits]).unsqueeze(-1)
        send, recv = self._exchange_counts(torch.cat([torch.stack(counts).view(n, G, e), tokens_nG1], 2))
        # host sync: split sizes as Python ints (the one sync per layer, all chunks).
        send_nG, recv_nG, rows_nG = torch.stack([send[..., e].t(), recv[..., e].t(), recv[..., :e].sum(2).t()]).tolist()
        routes = []
        for i, (ids_TK, hit_GT) in enumerate(zip(ids, hits)):
            T, S, R, N = ids_TK.shape[0], sum(send_nG[i]), sum(recv_nG[i]), sum(rows_nG[i])
            flat_M = hit_GT.reshape(-1)  # (rank, token), rank-major: the send order
            picked_S = torch.argsort(flat_M.logical_not().to(torch.uint8), stable=True)[:S]
            token_S, rank_S = picked_S % max(T, 1), picked_S // max(T, 1)
            inverse_TG = torch.where(flat_M, torch.cumsum(flat_M, 0) - 1, S).view(G, T).t()
            ids_SK = ids_TK[token_S]
            local_SK = torch.where(ids_SK // e == rank_S.unsqueeze(1), ids_SK - rank_S.unsqueeze(1) * e, e)
            local_SK = local_SK.to(torch.int32)  # half the bytes of int64 on the wire (e + 1 values)
            local_RK = _exchange(local_SK, recv_nG[i], send_nG[i], self.ep_group)
            # Expert-major rows: slots sorted by local expert (e, "elsewhere", last), sources then tokens within.
            order_N = torch.argsort(local_RK.reshape(-1), stable=True)[:N]
            slot_RK = torch.full((R * K,), N, dtype=order_N.dtype, device=device)
            slot_RK[order_N] = torch.arange(N, device=device)
            home_S = token_S * G + rank_S
            routes.append(
                _RankRoute(
                    token_S,
                    inverse_TG,
                    home_S,
                    local_RK,
                    order_N,
                    slot_RK.view(R, K),
                    send_nG[i],
                    recv_nG[i],
                    recv[:, i, :e].sum(0),
                )
            )
        return routes

    def _send(self, x_TD: torch.Tensor, route: _Route | _RankRoute) -> torch.Tensor:
        if isinstance(route, _RankRoute):
            return take_rows(x_TD, route.token_S, route.inverse_TG, pad=True)
        return repeat_tokens(x_TD, route.order_R, route.inv_order_R, self.top_k)

    def _arrived(self, routed_RD: torch.Tensor, route: _Route | _RankRoute):
        if isinstance(route, _RankRoute):  # each token to its local experts' rows, expert-major (a gather)
            return take_rows(routed_RD, route.order_N // self.top_k, route.slot_RK, pad=True), route.counts_e, route
        # Into expert-major order: a gather (its backward too; no scatter).
        return permute_rows(routed_RD, route.src_R, route.dest_R), route.counts_e, route

    def _partial_sums(self, y_ND: torch.Tensor, gates_RK: torch.Tensor, route: _RankRoute) -> torch.Tensor:
        """On the experts' rank: each received token's gate-weighted sum over its local experts' rows. A slot
        held elsewhere reads row 0 with a zero gate (cheaper than copying y to pad it with a zero row)."""
        R, K = route.slot_RK.shape
        here_RK = route.local_RK < self.num_local_experts
        index_M = torch.where(here_RK, route.slot_RK, 0).reshape(-1)
        y_RKD = gather_rows(y_ND, index_M, route.order_N).view(R, K, y_ND.shape[-1])
        gates_RK = torch.where(here_RK, gates_RK, 0).to(y_RKD.dtype)
        return torch.bmm(gates_RK.unsqueeze(1), y_RKD).squeeze(1)

    def _home(self, back_SD: torch.Tensor, route: _RankRoute) -> torch.Tensor:
        """On the tokens' rank: the sum of each token's partial sums from the ep ranks."""
        T, G = route.inverse_TG.shape
        return (
            gather_rows(back_SD, route.inverse_TG.reshape(-1), route.home_S, pad=True)
            .view(T, G, back_SD.shape[-1])
            .sum(1)
        )

    def _gates(self, weights_TK: torch.Tensor, route: _RankRoute) -> torch.Tensor:
        """Each sent token's K gates (those of slots held elsewhere are zeroed there)."""
        return take_rows(weights_TK, route.token_S, route.inverse_TG, pad=True)

    def dispatch(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, counts_E: torch.Tensor | None = None):
        counts_E = expert_counts(ids_TK, self.num_experts) if counts_E is None else counts_E
        (route,) = self._routes([ids_TK], [counts_E])
        routed_RD = all_to_all(self._send(x_TD, route), route.recv_splits, route.send_splits, self.ep_group)
        return self._arrived(routed_RD, route)

    def combine(self, y_RD: torch.Tensor, weights_TK: torch.Tensor, ctx: _Route | _RankRoute) -> torch.Tensor:
        if isinstance(ctx, _RankRoute):  # gates to the experts' rank, partial sums home (ep mesh axis)
            gates_RK = all_to_all(self._gates(weights_TK, ctx), ctx.recv_splits, ctx.send_splits, self.ep_group)
            back_SD = all_to_all(
                self._partial_sums(y_RD, gates_RK, ctx), ctx.send_splits, ctx.recv_splits, self.ep_group
            )
            return self._home(back_SD, ctx)
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

    def combine_async(self, y_RD: torch.Tensor, weights_TK: torch.Tensor, ctx: _Route | _RankRoute) -> Pending:
        if isinstance(ctx, _RankRoute):
            # Both exchanges (ep mesh axis) on the side stream; the partial and home sums on the compute stream.
            gates = launch(all_to_all, self._gates(weights_TK, ctx), ctx.recv_splits, ctx.send_splits, self.ep_group)
            partial_RD = self._partial_sums(y_RD, gates.wait(), ctx)
            sent = launch(all_to_all, partial_RD, ctx.send_splits, ctx.recv_splits, self.ep_group)
            sent.finish = functools.partial(self._home, route=ctx)
            return sent
        # As combine: the permutation on the compute stream, the all-to-all (ep mesh axis) on the side stream,
        # the weighted sum on the compute stream once the rows are home.
        back_RD = permute_rows(y_RD, ctx.dest_R, ctx.src_R)
        sent = launch(all_to_all, back_RD, ctx.send_splits, ctx.recv_splits, self.ep_group)
        sent.finish = functools.partial(weighted_sum, order_R=ctx.order_R, inv_R=ctx.inv_order_R, weights_TK=weights_TK)
        return sent

"""The dispatcher contract and the pure permutation maths every backend shares."""

from __future__ import annotations

from typing import Any

import torch

from moe_tune.moe.dispatch.streams import Pending


class Dispatcher:
    """``dispatch`` returns this rank's rows sorted by local expert and ``counts_e``; ``combine`` returns
    ``out_TD = sum_k weights_TK * y`` for every token of this rank. Both are differentiable.

    Experts are split over the ep group in contiguous blocks: ep rank s owns global experts [s*e, (s+1)*e),
    e = E / ep (``ParallelDims.check_experts`` made sure it divides)."""

    num_experts: int
    top_k: int
    num_local_experts: int
    first_local_expert: int = 0
    # comm.overlap: the MoE layer pipelines two halves of its tokens through dispatch_async/combine_async.
    overlap: bool = False

    def dispatch(
        self, x_TD: torch.Tensor, ids_TK: torch.Tensor, counts_E: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """``counts_E``: rows per global expert if the caller has them already (the MoE layer does)."""
        raise NotImplementedError

    def combine(self, y_RD: torch.Tensor, weights_TK: torch.Tensor, ctx: Any) -> torch.Tensor:
        raise NotImplementedError

    def dispatch_async(self, chunks: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> list[Pending]:
        """Start dispatching chunks ``(x_TD, ids_TK, counts_E)`` of this rank's tokens; each ``Pending.wait()``
        returns that chunk's ``dispatch`` result. Every rank passes the same number of chunks (empty ones too).
        This default dispatches them one after another, each done when returned: no overlap."""
        return [Pending(self.dispatch(*chunk)) for chunk in chunks]

    def combine_async(self, y_RD: torch.Tensor, weights_TK: torch.Tensor, ctx: Any) -> Pending:
        """Start ``combine``; ``Pending.wait()`` returns its ``out_TD``. Default: combined when returned."""
        return Pending(self.combine(y_RD, weights_TK, ctx))

    def check(self) -> None:
        """Raise if a finished batch went wrong in a way only the device knew (symm_mem's capacity). The
        trainer calls it after each step, once the step's work is done: every rank raises at the same step."""


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


# Gathers only, forward and backward. Autograd's own backward of ``x[index]`` is an index_put (a scatter,
# accumulating with a sort of the indices); for a permutation it is the gather by the inverse permutation, and
# for the K copies of each token a gather back to token-major order and a sum over K.


class _GatherRows(torch.autograd.Function):
    """``x_ND[index_M]`` (with ``pad``: an index ``N`` reads a zero row); backward gathers the gradient rows back
    through ``source_N`` (where each of x's rows was read: every row is read exactly once that counts, and any
    other read must meet a zero gradient)."""

    @staticmethod
    def forward(ctx, x_ND, index_M, source_N, pad: bool):
        ctx.save_for_backward(source_N)
        if pad:
            x_ND = torch.cat([x_ND, x_ND.new_zeros(1, x_ND.shape[-1])])
        return x_ND[index_M]

    @staticmethod
    def backward(ctx, grad_MD):
        (source_N,) = ctx.saved_tensors
        return grad_MD[source_N], None, None, None


class _TakeRows(torch.autograd.Function):
    """``x_TD[index_S]`` where token t is read at the rows ``inverse_TM[t]`` (with ``pad``: at most M times, the
    entries ``S`` for fewer): backward gathers those rows (a zero row for the missing ones) and sums them, without
    a scatter."""

    @staticmethod
    def forward(ctx, x_TD, index_S, inverse_TM, pad: bool):
        ctx.save_for_backward(inverse_TM)
        ctx.pad = pad
        return x_TD[index_S]

    @staticmethod
    def backward(ctx, grad_SD):
        (inverse_TM,) = ctx.saved_tensors
        T, M = inverse_TM.shape
        if ctx.pad:
            grad_SD = torch.cat([grad_SD, grad_SD.new_zeros(1, grad_SD.shape[-1])])
        return grad_SD[inverse_TM.reshape(-1)].view(T, M, grad_SD.shape[-1]).sum(1), None, None, None


def gather_rows(x_ND: torch.Tensor, index_M: torch.Tensor, source_N: torch.Tensor, pad: bool = False):
    """Rows ``x_ND[index_M]`` where ``index_M[source_N] == arange(N)``; ``pad``: an index ``N`` gives a zero row.
    Reads at other positions than ``source_N`` get no gradient: the caller makes sure theirs is zero."""
    return _GatherRows.apply(x_ND, index_M, source_N, pad)


def take_rows(x_TD: torch.Tensor, index_S: torch.Tensor, inverse_TM: torch.Tensor, pad: bool = False):
    """Rows ``x_TD[index_S]``, token t read at the rows listed in ``inverse_TM[t]`` (``pad``: padded with ``S``)."""
    return _TakeRows.apply(x_TD, index_S, inverse_TM, pad)


def permute_rows(x_RD: torch.Tensor, index_R: torch.Tensor, inverse_R: torch.Tensor) -> torch.Tensor:
    """``x_RD[index_R]`` for a permutation ``index_R`` whose inverse is ``inverse_R``."""
    return gather_rows(x_RD, index_R, inverse_R)


def repeat_tokens(x_TD: torch.Tensor, order_R: torch.Tensor, inv_R: torch.Tensor, top_k: int) -> torch.Tensor:
    """The routed rows in sorted order, ``x_TD[order_R // top_k]`` (``sort_by_expert``), for all T*K rows."""
    return take_rows(x_TD, order_R // top_k, inv_R.view(-1, top_k))


def weighted_sum(y_RD: torch.Tensor, order_R: torch.Tensor, inv_R: torch.Tensor, weights_TK: torch.Tensor):
    """Undo the sort and reduce the K copies of each token with its gates, in one batched matmul
    (deterministic, no atomics): ``out_T1D = weights_T1K @ y_TKD``."""
    T, K = weights_TK.shape
    y_TKD = permute_rows(y_RD, inv_R, order_R).view(T, K, y_RD.shape[-1])
    return torch.bmm(weights_TK.to(y_TKD.dtype).unsqueeze(1), y_TKD).squeeze(1)


def expert_major_positions(counts_Ge: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Rows received from an all-to-all arrive source-rank-major: (source 0: local expert 0..e-1), (source 1:
    ...). Return ``dest_R``, where row r must go in local-expert-major order (expert 0: sources 0..G-1, ...),
    so that ``x_expert_major[dest_R] = x_received``. Device ops only: no host sync, no loop over experts.
    ``num_rows`` = counts_Ge.sum(), passed in because the caller knows it already (it needed the splits)."""
    G, e = counts_Ge.shape
    counts_R = counts_Ge.reshape(-1)
    src_start = torch.cumsum(counts_R, 0) - counts_R
    counts_eG = counts_Ge.t().reshape(-1)
    dst_start = (torch.cumsum(counts_eG, 0) - counts_eG).view(e, G).t().reshape(-1)
    segment_R = torch.repeat_interleave(torch.arange(G * e, device=counts_Ge.device), counts_R, output_size=num_rows)
    row_R = torch.arange(num_rows, device=counts_Ge.device)
    return dst_start[segment_R] + row_R - src_start[segment_R]

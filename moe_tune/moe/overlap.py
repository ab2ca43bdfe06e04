"""``comm.overlap=true``: the MoE layer's tokens in two halves, pipelined so that the expert-parallel all-to-alls
run beside compute (DeepSeek-V3's dual-micro-batch overlap, applied inside one layer).

Forward, on one rank, in the order the kernels are queued (compute stream | side stream, ``dispatch.streams``):

    compute                                   side (each all-to-all over the ep mesh axis)
    router on all T tokens; counts of both halves exchanged, one host sync (as without overlap)
    gather half 0's rows
    gather half 1's rows                      dispatch half 0
    shared expert on all T tokens             dispatch half 0, then dispatch half 1
    (wait) experts on half 0                  dispatch half 1
    (wait) experts on half 1                  combine half 0
    (wait) weighted sum of half 0             combine half 1
    (wait) weighted sum of half 1

Hidden: half 1's dispatch behind half 0's experts, half 0's combine behind half 1's experts, and the shared
expert (Qwen2-MoE, DeepSeek-V3) behind both dispatches. Exposed: half 0's dispatch (less the gather and the
shared expert) and half 1's combine (less half 0's weighted sum); hiding those too needs work from outside the
layer (the next micro-batch's attention, as DeepSeek-V3's DualPipe does).

Backward mirrors it: autograd runs each node on its forward's stream, so every exchange's backward (the
reverse all-to-all) runs on the side stream and the rest on the compute stream, joined by events. Half 0's
combine backward runs beside half 1's experts backward, half 1's dispatch backward beside half 0's experts
and the shared expert's backward; half 1's combine backward and half 0's dispatch backward are exposed.

Results: each token's output is the same sum of the same products as without overlap (routing and the
balancing losses see all T tokens at once); only the expert weights' gradients are summed in two parts.
Every rank splits into two halves, empty or not, so every rank runs the same collectives in the same order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from moe_tune.moe.dispatch.base import Dispatcher
from moe_tune.moe.router import expert_counts


def routed_in_halves(
    dispatcher: Dispatcher,
    experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    x_TD: torch.Tensor,
    ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    counts_E: torch.Tensor,
    shared: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(routed_TD, shared_TD)``: dispatch -> experts -> combine for every token, and ``shared(x_TD)`` if given,
    scheduled as in the module docstring. The first half takes the odd token; either half may be empty."""
    T = x_TD.shape[0]
    halves = (slice(0, T - T // 2), slice(T - T // 2, T))
    counts_0E = expert_counts(ids_TK[halves[0]], dispatcher.num_experts)
    chunks = [(x_TD[h], ids_TK[h], c) for h, c in zip(halves, (counts_0E, counts_E - counts_0E))]
    dispatching = dispatcher.dispatch_async(chunks)
    shared_TD = shared(x_TD) if shared is not None else None  # beside both dispatches
    combining = []
    for h, pending in zip(halves, dispatching):
        x_RD, counts_e, ctx = pending.wait()
        # Half 0's experts run beside half 1's dispatch, half 1's beside half 0's combine.
        combining.append(dispatcher.combine_async(experts(x_RD, counts_e), weights_TK[h], ctx))
    # Half 0's weighted sum runs beside half 1's combine.
    return torch.cat([pending.wait() for pending in combining]), shared_TD

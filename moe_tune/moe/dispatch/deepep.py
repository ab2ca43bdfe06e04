"""``comm=deepep``: DeepEP's normal-mode (high-throughput) kernels, v1.2.x ``Buffer`` API.

Intranode over NVLink (2, 4 or 8 ranks) and internode over RDMA + NVLink (DeepEP picks the path from the
group). DeepEP sends each token once to every rank that owns one of its experts (not once per expert), and
reduces on the way back. On each rank of the ep group (experts in contiguous blocks of e = E / ep):

dispatch: ``get_dispatch_layout`` (tokens per rank and expert) -> ``Buffer.dispatch``: this rank receives
  N tokens, each with its top-k ids translated to local experts (-1 where the expert lives elsewhere).
  The (token, local expert) pairs become rows sorted by local expert (``expand_by_local_expert``), so
  GroupedExperts sees the same layout as with ``all_to_all``.
combine: the gates go to the experts' ranks with a cached-handle ``dispatch`` (fp32 bytes, same layout as
  the tokens), each received token's rows are weighted and summed there (``weighted_sum_per_token``), and
  ``Buffer.combine`` adds the ranks' partial sums into each token.
Autograd: the backward of a dispatch is a combine with the same handle and vice versa; the gates' gradients
go home in a combine too (a 256-wide bf16 payload, exact; see ``_SendGates.backward``).
The gates travel at combine time because the dispatcher contract hands them to ``combine`` only (DeepEP's
own API would carry them with the tokens); the price is one small extra dispatch and combine per layer.

One host sync per dispatch, inside DeepEP: normal mode waits on the host for the number of tokens this rank
receives (it sizes the output), as ``all_to_all`` waits for its split sizes. DeepEP moves bf16 activations.
One ``Buffer`` per ep group, sized from DeepEP's own config hints, is shared by every layer and reused
across steps. ``deep_ep`` is imported only when this backend is built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from moe_tune.config import DeepEPConfig
from moe_tune.moe.dispatch.base import Dispatcher

# DeepEP moves rows in 16-byte units, in pairs (its TMA path halves each row): the fp32 gates are padded to
# 32 bytes per token. Their gradients return as 256 bf16 per token (see _SendGates.backward).
_GATE_ALIGN, _GRAD_PAYLOAD = 8, 256
# How to get DeepEP: raised here when `import deep_ep` fails, and by moe_tune.env.require_backends before a run.
DEEPEP_HOWTO = (
    "DeepEP is not installed, and it is not on PyPI: build it from upstream source tag v1.2.1: "
    "`git clone --branch v1.2.1 https://github.com/deepseek-ai/DeepEP && pip install nvidia-nvshmem-cu13 && "
    "CPATH=/usr/local/cuda/include/cccl:$CPATH pip install --no-build-isolation ./DeepEP` "
    "(its setup.py finds NVSHMEM in PyTorch's nvidia-nvshmem wheel; use -cu12 on CUDA 12, where the CPATH "
    "addition for CUDA 13's CCCL headers is not needed); or pick comm=all_to_all"
)


def _import_deep_ep():
    try:
        import deep_ep
    except ImportError as e:
        raise ImportError(f"comm=deepep: {DEEPEP_HOWTO} (import failed: {e})") from e
    return deep_ep


def expand_by_local_expert(recv_ids_NK: torch.Tensor, num_local_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows for the (received token, local expert) pairs, sorted by local expert (stable: within an expert,
    in received order). Returns ``(order_P, counts_e)``: ``order_P`` are flat N*K indices, valid pairs
    first, then the pairs of experts elsewhere (-1); ``counts_e`` rows per local expert. Device ops only."""
    flat_P = recv_ids_NK.reshape(-1)
    key_P = torch.where(flat_P >= 0, flat_P, num_local_experts)
    order_P = torch.argsort(key_P, stable=True)
    counts = torch.zeros(num_local_experts + 1, dtype=torch.int64, device=flat_P.device)
    counts.scatter_add_(0, key_P, torch.ones_like(key_P))
    return order_P, counts[:num_local_experts]


def weighted_sum_per_token(y_RD: torch.Tensor, pair_R: torch.Tensor, gates_NK: torch.Tensor) -> torch.Tensor:
    """``z_ND[n] = sum_k gates[n, k] * y[row of pair (n, k)]`` over the pairs held here; pairs of experts on
    other ranks contribute zero (their gates still arrive, and get a zero gradient here). One batched
    matmul, no atomics."""
    N, K = gates_NK.shape
    y_PD = y_RD.new_zeros(N * K, y_RD.shape[1]).index_copy(0, pair_R, y_RD)
    return torch.bmm(gates_NK.to(y_RD.dtype).unsqueeze(1), y_PD.view(N, K, y_RD.shape[1])).squeeze(1)


@dataclass
class _Comm:
    """What every DeepEP call of one dispatch/combine pair needs; ``handle`` is DeepEP's layout cache."""

    buffer: Any
    dispatch_config: Any
    combine_config: Any
    num_experts: int
    handle: Any = None
    num_rows: int = 0  # (received token, local expert) pairs: DeepEP returns the counts as host ints


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, ids_TK, comm: _Comm):
        buf = comm.buffer
        per_rank, per_rdma_rank, per_expert, in_rank, _ = buf.get_dispatch_layout(ids_TK, comm.num_experts)
        # The gates are not known yet (they travel in combine); DeepEP wants weights beside the ids.
        no_gates_TK = torch.zeros(ids_TK.shape, dtype=torch.float32, device=ids_TK.device)
        # Collective over the ep mesh axis (NVLink within a node, RDMA across nodes): each token goes once to
        # every ep rank that owns one of its experts.
        # host sync: DeepEP's normal-mode dispatch waits on the host for the received token count (sizes recv_x).
        recv_ND, recv_ids_NK, _, rows_per_expert, handle, _ = buf.dispatch(
            x_TD,
            num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma_rank,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
            topk_idx=ids_TK,
            topk_weights=no_gates_TK,
            config=comm.dispatch_config,
        )
        comm.handle, comm.num_rows = handle, sum(rows_per_expert)
        ctx.comm = comm
        ctx.mark_non_differentiable(recv_ids_NK)
        return recv_ND, recv_ids_NK

    @staticmethod
    def backward(ctx, grad_ND, _grad_ids):
        c = ctx.comm
        # Collective over the ep mesh axis: each token's gradient is the sum over the ranks it was sent to.
        grad_TD, _, _ = c.buffer.combine(grad_ND.contiguous(), c.handle, config=c.combine_config)
        return grad_TD, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z_ND, comm: _Comm):
        ctx.comm = comm
        # Collective over the ep mesh axis: every rank's partial sum goes back to the token's rank and is added.
        out_TD, _, _ = comm.buffer.combine(z_ND.contiguous(), comm.handle, config=comm.combine_config)
        return out_TD

    @staticmethod
    def backward(ctx, grad_TD):
        c = ctx.comm
        # Collective over the ep mesh axis: the output gradient goes to every rank that holds part of the sum.
        grad_ND, _, _, _, _, _ = c.buffer.dispatch(grad_TD.contiguous(), handle=c.handle, config=c.dispatch_config)
        return grad_ND, None


class _SendGates(torch.autograd.Function):
    """Gates ``[T, K]`` fp32 -> ``[N, K]`` on the experts' ranks, bytes unchanged (cached-handle dispatch)."""

    @staticmethod
    def forward(ctx, gates_TK, comm: _Comm):
        ctx.comm = comm
        T, K = gates_TK.shape
        padded = gates_TK.new_zeros(T, -(-K // _GATE_ALIGN) * _GATE_ALIGN)
        padded[:, :K] = gates_TK
        # Collective over the ep mesh axis: the same routes as the tokens (cached layout), no host sync.
        recv_NK, _, _, _, _, _ = comm.buffer.dispatch(padded, handle=comm.handle, config=comm.dispatch_config)
        return recv_NK[:, :K].contiguous()

    @staticmethod
    def backward(ctx, grad_NK):
        c = ctx.comm
        N, K = grad_NK.shape
        # The gate gradients go home in a combine's bf16 payload, one 512-byte row per token (the row size
        # DeepEP's combine is used and tested with; its top-k-weights channel beside a tiny payload gave wrong
        # sums on H200). Exact: the gates entered the weighted sum in bf16, so their gradients are bf16
        # numbers, and each is nonzero on one rank only (its expert's), so the sum adds zeros.
        payload_NP = torch.zeros(N, _GRAD_PAYLOAD, dtype=torch.bfloat16, device=grad_NK.device)
        payload_NP[:, :K] = grad_NK
        # Collective over the ep mesh axis: summed over the ranks each token went to.
        sum_TP, _, _ = c.buffer.combine(payload_NP, c.handle, config=c.combine_config)
        return sum_TP[:, :K].float(), None


# One Buffer per ep group (by group name), shared by every layer's dispatcher and reused across steps; rebuilt
# larger if a layer needs more bytes than it was sized for (hidden sizes are the same on every rank, so every
# rank rebuilds at the same call). A per-process cache keyed by group name, not a process-group singleton.
_BUFFERS: dict[str, tuple[Any, int, int]] = {}


def release_buffers() -> None:
    _BUFFERS.clear()


@dataclass
class _Route:
    comm: _Comm
    pair_R: torch.Tensor  # expanded row r is the flat (received token, k) pair pair_R[r]
    num_tokens: int


class DeepEPDispatcher(Dispatcher):
    """Option ``num_sms``: streaming multiprocessors DeepEP's normal kernels use (``DeepEPConfig``)."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        ep_group,
        options: DeepEPConfig | None = None,
        checked_after_step: bool = False,
    ):
        del checked_after_step  # nothing only the device knows
        self._deep_ep = _import_deep_ep()
        ep = dist.get_world_size(ep_group)
        num_sms = (options or DeepEPConfig()).num_sms
        self.num_experts, self.top_k, self.ep_group, self.ep = num_experts, top_k, ep_group, ep
        self.num_local_experts = num_experts // ep
        self.first_local_expert = dist.get_rank(ep_group) * self.num_local_experts
        Buffer = self._deep_ep.Buffer
        Buffer.set_num_sms(num_sms)  # class-wide in DeepEP: the configs below capture it for this dispatcher
        try:
            self.dispatch_config = Buffer.get_dispatch_config(ep)
            self.combine_config = Buffer.get_combine_config(ep)
        except AssertionError as e:
            raise ValueError(
                f"DeepEP has no tuned config for an ep group of {ep} ranks (it has 2, 4, 8, 16, 24, 32, 64, 128, "
                f"144, 160); pick parallel.ep among those or comm=all_to_all"
            ) from e

    def _buffer(self, hidden_bytes: int):
        G = self.ep
        configs = (self.dispatch_config, self.combine_config)
        nvl = max(c.get_nvl_buffer_size_hint(hidden_bytes, G) for c in configs)
        rdma = max(c.get_rdma_buffer_size_hint(hidden_bytes, G) for c in configs)
        name = self.ep_group.group_name
        cached = _BUFFERS.get(name)
        if cached is None or cached[1] < nvl or cached[2] < rdma:
            nvl, rdma = max(nvl, cached[1] if cached else 0), max(rdma, cached[2] if cached else 0)
            # Collective over the ep mesh axis: exchanges device ids and IPC handles (a one-time host sync).
            _BUFFERS[name] = (self._deep_ep.Buffer(self.ep_group, num_nvl_bytes=nvl, num_rdma_bytes=rdma), nvl, rdma)
        return _BUFFERS[name][0]

    def dispatch(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, counts_E: torch.Tensor | None = None):
        x_TD, ids_TK = _as_bf16(x_TD), ids_TK.to(torch.int64)
        T, D = x_TD.shape
        if D % 16:
            raise ValueError(f"comm=deepep needs the hidden size to be a multiple of 16 (32-byte bf16 rows); got {D}")
        if T == 0:  # a rank without tokens sends one token to no expert (-1), so DeepEP's kernels see a token
            x_TD = torch.cat([x_TD, x_TD.new_zeros(1, D)])
            ids_TK = torch.cat([ids_TK, ids_TK.new_full((1, self.top_k), -1)])
        comm = _Comm(self._buffer(D * x_TD.element_size()), self.dispatch_config, self.combine_config, self.num_experts)
        recv_ND, recv_ids_NK = _Dispatch.apply(x_TD.contiguous(), ids_TK.contiguous(), comm)
        order_P, counts_e = expand_by_local_expert(recv_ids_NK, self.num_local_experts)
        pair_R = order_P[: comm.num_rows]  # the valid pairs come first
        return recv_ND[pair_R // self.top_k], counts_e, _Route(comm, pair_R, T)

    def combine(self, y_RD: torch.Tensor, weights_TK: torch.Tensor, ctx: _Route) -> torch.Tensor:
        gates_TK = weights_TK.float()
        if ctx.num_tokens == 0:
            gates_TK = torch.cat([gates_TK, gates_TK.new_zeros(1, self.top_k)])
        gates_NK = _SendGates.apply(gates_TK.contiguous(), ctx.comm)
        z_ND = weighted_sum_per_token(y_RD, ctx.pair_R, gates_NK)
        return _Combine.apply(z_ND.to(torch.bfloat16), ctx.comm)[: ctx.num_tokens]


def _as_bf16(x_TD: torch.Tensor) -> torch.Tensor:
    if x_TD.dtype == torch.bfloat16:
        return x_TD
    if torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") == torch.bfloat16:
        return x_TD.to(torch.bfloat16)  # what autocast feeds the expert GEMMs anyway
    raise TypeError(
        f"comm=deepep moves bfloat16 activations only (DeepEP's combine kernel is bf16-only); got {x_TD.dtype}: "
        "train in bf16 (train.precision=bf16, bf16_fp32_master or amp_bf16) or pick comm=all_to_all"
    )

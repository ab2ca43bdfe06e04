"""``comm=symm_mem``: expert parallelism over PyTorch's NVSHMEM symmetric memory, with no host sync.

Split sizes never travel through the host: every size the exchange needs stays on the device, so the MoE
layer never waits for the GPU. The price is a fixed-size output: the rows a rank receives land in a buffer
sized for the worst case, and ``dispatch`` returns ``capacity`` rows of which the first ``counts_e.sum()``
are real (grouped GEMMs read only up to their last offset; the padding rows are never sent back).

Dispatch, on each rank of the ep group (experts in contiguous blocks: rank s owns [s*e, (s+1)*e)):
  1. sort the T*K routed rows by global expert, which also groups them by destination rank, and gather
     them straight into this rank's symmetric send buffer;
  2. all-gather every rank's rows per expert (E ints each): every rank now knows what every rank will
     receive, checks every receiver's capacity *before* any row moves, and knows its own rows per
     (source, local expert);
  3. ``torch.ops.symm_mem.all_to_all_vdev`` (1-D, source-rank-major): each rank pulls its rows from every
     peer's symmetric send buffer; split sizes are exchanged on the device inside the op;
  4. permute the received rows to local-expert-major order with one gather whose index is computed on
     the device (``padded_expert_major``).
Combine is the reverse (gather to source-major, ``all_to_all_vdev`` back, weighted sum of each token's K
rows); the backward of each exchange is the exchange in the other direction.

Capacity: a rank receives at most ``capacity = max_tokens x ceil(capacity_factor x top_k)`` rows;
``capacity_factor >= ep`` can never overflow. If a batch would overflow, every rank sees it in step 2 and
zeroes its splits: no row is written past a buffer (no corruption), that batch's routed output is zero, and
a RuntimeError naming the numbers is raised by ``check()``, which the trainer calls on every rank after each
step (so all ranks stop at the same step), else at a later dispatch (the overflow flag is copied to pinned
host memory without waiting), or at once with ``debug=True`` (which reads it with a host sync).

Buffers: symmetric tensors are allocated once per (ep group, hidden, dtype, size) and shared by every
layer; each exchange alternates between two slots because a peer may still be pulling from the previous
exchange's send buffer (and writing split sizes into ours) while this rank starts the next one. Two
exchanges later that peer has necessarily passed the next exchange's barrier, so the slot is free again.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe_tune.config import SymmMemConfig
from moe_tune.moe.dispatch.base import Dispatcher, inverse_permutation, sort_by_expert
from moe_tune.moe.router import expert_counts

# all_to_all_vdev splits each peer's bytes evenly over up to 32 thread blocks (2 ranks, 64 blocks): a row
# must be a multiple of 32 bytes for every row count to split evenly.
ROW_ALIGN_BYTES = 32


def padded_expert_major(counts_Ge: torch.Tensor, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Received rows are source-rank-major (source 0: local experts 0..e-1, source 1: ...), followed by padding up
    to ``capacity``. Returns ``(src_of_em_C, em_of_src_C)``: expert-major row j is received row
    ``src_of_em_C[j]``, and received row i goes to expert-major row ``em_of_src_C[i]``; padding rows map to
    themselves. Device ops only (no host sync, no loop over experts); needs ``counts_Ge.sum() <= capacity``."""
    G, e = counts_Ge.shape
    pad = (capacity - counts_Ge.sum()).reshape(1)
    seg_src = torch.cat([counts_Ge.reshape(-1), pad])  # segments (s, j) in source-major order, then padding
    seg_em = torch.cat([counts_Ge.t().reshape(-1), pad])  # the same segments in expert-major order (j, s)
    start_src = torch.cumsum(seg_src, 0) - seg_src
    start_em_jG = torch.cumsum(seg_em, 0) - seg_em
    start_em = torch.cat([start_em_jG[:-1].view(e, G).t().reshape(-1), start_em_jG[-1:]])
    seg_ids = torch.arange(G * e + 1, device=counts_Ge.device)
    segment_C = torch.repeat_interleave(seg_ids, seg_src, output_size=capacity)
    row_C = torch.arange(capacity, device=counts_Ge.device)
    em_of_src_C = start_em[segment_C] + row_C - start_src[segment_C]
    src_of_em_C = torch.empty_like(row_C).scatter_(0, em_of_src_C, row_C)
    return src_of_em_C, em_of_src_C


# The two primitives below are module functions so that tests can run this backend's logic on CPU (gloo)
# with an emulated exchange. Both need every rank of the group to call them together.


def _symmetric_empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, group_name: str):
    from torch.distributed import _symmetric_memory as symm

    t = symm.empty(shape, dtype=dtype, device=device)
    # Collective over the ep mesh axis: exchanges the allocation's handles so peers can reach it.
    symm.rendezvous(t, group_name)
    return t


def _all_to_all_vdev(send, recv, in_splits_G, out_splits_offsets_2G, group_name: str) -> None:
    # Collective over the ep mesh axis: rows [offset_s, offset_s + in_splits[s]) of `send` go to ep rank s; each
    # rank pulls its rows from every peer into `recv`, source-rank-major. Splits are exchanged on the device.
    torch.ops.symm_mem.all_to_all_vdev(send, recv, in_splits_G, out_splits_offsets_2G, group_name)


# torch >= 2.12 renames all_gather_into_tensor (kept there, deprecated) to all_gather_single.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@functools.cache  # once per (device, group) and process
def init_nvshmem(device: torch.device, group_name: str) -> None:
    from torch.distributed import _symmetric_memory as symm

    if not symm.is_nvshmem_available():
        raise RuntimeError("comm=symm_mem: NVSHMEM is not available to this torch; pip install nvidia-nvshmem-cu13")
    get_backend = getattr(symm, "get_backend", None)
    if get_backend is None or get_backend(device) != "NVSHMEM":
        symm.set_backend("NVSHMEM")  # fails if another symmetric-memory backend already allocated here
    with warnings.catch_warnings():  # deprecated (a no-op) in recent torch, needed by older ones
        warnings.simplefilter("ignore")
        symm.enable_symm_mem_for_group(group_name)


class _Pool:
    """Symmetric buffers of one ep group for rows of one width and dtype, in two slots; shared by all layers."""

    def __init__(self, group, rows_to_experts: int, rows_to_tokens: int, dim: int, dtype, device):
        self.group_name, self.capacity = group.group_name, rows_to_tokens
        G = dist.get_world_size(group)
        if device.type == "cuda":
            init_nvshmem(device, self.group_name)

        def alloc(shape, dt):
            return _symmetric_empty(shape, dt, device, self.group_name).zero_()

        # "small": the T*K rows a rank sends (dispatch) or gets back (combine); "big": the rows it receives.
        self.small = [alloc((rows_to_experts, dim), dtype) for _ in range(2)]
        self.big = [alloc((rows_to_tokens, dim), dtype) for _ in range(2)]
        self.in_splits = [alloc((G,), torch.int64) for _ in range(2)]
        self.out_splits_offsets = [alloc((2, G), torch.int64) for _ in range(2)]
        self.step = 0
        # Overflow record [a batch overflowed, largest rows one rank would have received], read without a sync.
        self.overflow_2 = torch.zeros(2, dtype=torch.int64, device=device)
        pin = device.type == "cuda"
        self.overflow_host_2 = torch.zeros(2, dtype=torch.int64, pin_memory=pin)
        self.overflow_event = torch.cuda.Event() if pin else None

    def exchange(self, to_experts: bool, splits_G: torch.Tensor, fill: Callable[[torch.Tensor], None]):
        """Fill this slot's send buffer, exchange, return the receive buffer (valid until two exchanges later)."""
        slot = self.step % 2
        self.step += 1
        small, big = self.small[slot], self.big[slot]
        send, recv = (small, big) if to_experts else (big, small)
        fill(send)
        self.in_splits[slot].copy_(splits_G)
        _all_to_all_vdev(send, recv, self.in_splits[slot], self.out_splits_offsets[slot], self.group_name)
        return recv

    def record_overflow(self, overflow: torch.Tensor, worst_rows: torch.Tensor) -> None:
        now_2 = torch.stack([overflow.to(torch.int64), worst_rows])
        torch.maximum(self.overflow_2, now_2, out=self.overflow_2)
        self.overflow_host_2.copy_(self.overflow_2, non_blocking=True)
        if self.overflow_event is not None:
            self.overflow_event.record()

    def overflow_seen(self, block: bool) -> int | None:
        """The largest row count one rank would have received, if an overflow has been recorded. Without
        ``block``, only looks at the last copy once the GPU has finished it (no waiting)."""
        if self.overflow_event is not None:
            if block:
                self.overflow_event.synchronize()  # host sync: debug mode checks every batch at once
            elif not self.overflow_event.query():
                return None
        overflowed, rows = self.overflow_host_2.tolist()  # pinned host memory already written: no device sync
        return rows if overflowed else None


# One pool per (ep group, hidden, dtype, max_tokens, rows per token): a per-process cache of buffers keyed by
# group name (not a process-group singleton); ``release_buffers()`` frees them.
_POOLS: dict[tuple, _Pool] = {}


def release_buffers() -> None:
    _POOLS.clear()


@dataclass
class _Route:
    pool: _Pool
    order_R: torch.Tensor  # this rank's T*K rows sorted by global expert: row r is flat (t, k) index order_R[r]
    token_R: torch.Tensor
    inv_order_R: torch.Tensor
    send_G: torch.Tensor  # rows to each ep rank (device)
    recv_G: torch.Tensor  # rows from each ep rank (device)
    src_of_em_C: torch.Tensor
    em_of_src_C: torch.Tensor
    num_tokens: int
    top_k: int


class _ToExperts(torch.autograd.Function):
    """x_TD -> rows at their experts' ranks, local-expert-major, padded to capacity; backward returns the
    gradients along the same routes and sums each token's K copies."""

    @staticmethod
    def forward(ctx, x_TD, route: _Route):
        ctx.route = route
        n = route.token_R.numel()

        def fill(send):
            torch.index_select(x_TD, 0, route.token_R, out=send[:n])

        recv = route.pool.exchange(True, route.send_G, fill)
        return recv.index_select(0, route.src_of_em_C)

    @staticmethod
    def backward(ctx, grad_CD):
        r = ctx.route
        C = r.em_of_src_C.numel()

        def fill(send):
            torch.index_select(grad_CD.contiguous(), 0, r.em_of_src_C, out=send[:C])

        recv = r.pool.exchange(False, r.recv_G, fill)
        grad_TKD = recv.index_select(0, r.inv_order_R).view(r.num_tokens, r.top_k, recv.shape[1])
        return grad_TKD.sum(1), None


class _ToTokens(torch.autograd.Function):
    """Expert-major rows (capacity, or fewer from a reference expert loop) -> each token's K rows on its own
    rank, in (token, k) order; backward sends the row gradients back to the experts' ranks."""

    @staticmethod
    def forward(ctx, y_RD, route: _Route):
        ctx.route, ctx.num_rows = route, y_RD.shape[0]
        C = route.em_of_src_C.numel()
        if y_RD.shape[0] < C:  # padding rows are never sent; they only need to exist for the gather
            y_RD = torch.cat([y_RD, y_RD.new_zeros(C - y_RD.shape[0], y_RD.shape[1])])

        def fill(send):
            torch.index_select(y_RD, 0, route.em_of_src_C, out=send[:C])

        recv = route.pool.exchange(False, route.recv_G, fill)
        return recv.index_select(0, route.inv_order_R).view(route.num_tokens, route.top_k, recv.shape[1])

    @staticmethod
    def backward(ctx, grad_TKD):
        r = ctx.route
        n = r.order_R.numel()

        def fill(send):
            torch.index_select(grad_TKD.reshape(n, send.shape[1]), 0, r.order_R, out=send[:n])

        recv = r.pool.exchange(True, r.send_G, fill)
        return recv.index_select(0, r.src_of_em_C[: ctx.num_rows]), None


class SymmMemDispatcher(Dispatcher):
    """Options (``SymmMemConfig``): ``capacity_factor`` (rows a rank can receive per token of ``max_tokens``, in
    units of top_k; ``ep`` never overflows), ``max_tokens`` (tokens per rank the buffers are sized for; default:
    the largest batch of any rank at the first dispatch), ``debug`` (check overflow after every batch, with a
    host sync). ``checked_after_step``: the caller runs ``check()`` on every rank after each step, so dispatch
    does not look at the previous batch's overflow flag itself."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        ep_group,
        options: SymmMemConfig | None = None,
        checked_after_step: bool = False,
    ):
        options = options or SymmMemConfig()
        ep = dist.get_world_size(ep_group)
        self.num_experts, self.top_k, self.ep_group, self.ep = num_experts, top_k, ep_group, ep
        self.num_local_experts = num_experts // ep
        self.ep_rank = dist.get_rank(ep_group)
        self.first_local_expert = self.ep_rank * self.num_local_experts
        self.capacity_factor, self.max_tokens, self.debug = options.capacity_factor, options.max_tokens, options.debug
        self.checked_after_step = checked_after_step
        self._last_pool: _Pool | None = None  # the buffers of the last dispatch, for check()
        self.rows_per_token = math.ceil(options.capacity_factor * top_k)

    @property
    def capacity(self) -> int:
        """Rows one rank can receive (the rows ``dispatch`` returns), once ``max_tokens`` is known."""
        return (self.max_tokens or 0) * self.rows_per_token

    def _pool(self, x_TD: torch.Tensor) -> _Pool:
        T, D = x_TD.shape
        if self.max_tokens is None:
            t = torch.tensor([max(T, 1)], device=x_TD.device)
            # Collective over the ep mesh axis: the largest batch of any rank sizes every rank's buffers.
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.ep_group)
            self.max_tokens = int(t.item())  # host sync: once, at the first dispatch, to size the buffers
        if T > self.max_tokens:
            raise ValueError(
                f"comm=symm_mem: this batch has {T} tokens on ep rank {self.ep_rank} but the symmetric buffers hold "
                f"{self.max_tokens} (sized at the first batch); pass max_tokens >= {T} to the dispatcher"
            )
        if (D * x_TD.element_size()) % ROW_ALIGN_BYTES:
            raise ValueError(
                f"comm=symm_mem needs rows of a multiple of {ROW_ALIGN_BYTES} bytes; hidden {D} x "
                f"{x_TD.element_size()} bytes is not: use comm=all_to_all for this model"
            )
        key = (self.ep_group.group_name, D, x_TD.dtype, self.max_tokens, self.rows_per_token)
        if key not in _POOLS:
            _POOLS[key] = _Pool(self.ep_group, self.max_tokens * self.top_k, self.capacity, D, x_TD.dtype, x_TD.device)
        return _POOLS[key]

    def check(self) -> None:
        if self._last_pool is not None:
            self._check_overflow(self._last_pool, block=True)

    def _check_overflow(self, pool: _Pool, block: bool) -> None:
        rows = pool.overflow_seen(block)
        if rows is None:
            return
        raise RuntimeError(
            f"comm=symm_mem: a batch would have sent up to {rows} routed rows to one ep rank, whose "
            f"buffer holds {pool.capacity} (capacity_factor {self.capacity_factor} x top_k {self.top_k} x "
            f"{self.max_tokens} tokens); their routed rows were dropped (nothing was written past the buffer). "
            f"Raise comm.capacity_factor (>= ep = {self.ep} never overflows)"
        )

    # Kept out of torch.compile (kernels.compile=true): the NVSHMEM ops and the overflow event are not
    # traceable ("expected event to be a torch.Event object" on torch 2.11); the layers around it compile.
    @torch.compiler.disable
    def dispatch(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, counts_E: torch.Tensor | None = None):
        G, e, E = self.ep, self.num_local_experts, self.num_experts
        pool = self._pool(x_TD)
        self._last_pool = pool
        if not self.checked_after_step:  # ranks may see the flag at different layers: the trainer checks after a step
            self._check_overflow(pool, block=False)
        order_R, token_R = sort_by_expert(ids_TK)
        counts_E = expert_counts(ids_TK, E) if counts_E is None else counts_E
        counts_GE = counts_E.new_empty(G * E)
        # Collective over the ep mesh axis (all-gather): every rank's rows per global expert, on the device.
        _all_gather(counts_GE, counts_E, group=self.ep_group)
        counts_GGe = counts_GE.view(G, G, e)  # [source, receiving rank, its local expert]
        recv_rows_G = counts_GGe.sum(dim=(0, 2))
        overflow = (recv_rows_G > pool.capacity).any()
        pool.record_overflow(overflow, recv_rows_G.max())
        if self.debug:
            self._check_overflow(pool, block=True)
        keep = (~overflow).to(counts_E.dtype)  # on overflow every rank sends nothing: no write past a buffer
        counts_Ge = counts_GGe[:, self.ep_rank] * keep
        send_G = counts_E.view(G, e).sum(1) * keep
        src_of_em_C, em_of_src_C = padded_expert_major(counts_Ge, pool.capacity)
        route = _Route(
            pool=pool,
            order_R=order_R,
            token_R=token_R,
            inv_order_R=inverse_permutation(order_R),
            send_G=send_G,
            recv_G=counts_Ge.sum(1),
            src_of_em_C=src_of_em_C,
            em_of_src_C=em_of_src_C,
            num_tokens=x_TD.shape[0],
            top_k=self.top_k,
        )
        return _ToExperts.apply(x_TD, route), counts_Ge.sum(0), route

    @torch.compiler.disable
    def combine(self, y_RD: torch.Tensor, weights_TK: torch.Tensor, ctx: _Route) -> torch.Tensor:
        y_TKD = _ToTokens.apply(y_RD, ctx)
        # The K rows of each token reduced with its gates in one batched matmul (deterministic, no atomics).
        return torch.bmm(weights_TK.to(y_TKD.dtype).unsqueeze(1), y_TKD).squeeze(1)

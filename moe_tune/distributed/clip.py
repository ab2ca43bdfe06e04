"""Gradient clipping by the true global norm over every rank's gradient shard.

After ``parallelize`` every gradient is a DTensor: dense ones sharded over dp_shard (replicated over
dp_replicate), expert ones sharded over efsdp and holding only this ep rank's experts (replicated over
dp_replicate). dp_shard = efsdp x ep, so the squared norms of the local shards of *all* gradients, summed
over the dp_shard group, give the global squared norm exactly once per element; dp_replicate copies are
identical and are not summed. Plain (non-DTensor) gradients, from a model that was not FSDP-sharded, are
replicated, except local experts under EP, which are summed over ep.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist

from moe_tune.distributed.mesh import ParallelMesh


def _sq_norm(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    # fp32 island: per-tensor norms accumulated in fp32 whatever the gradient dtype (bf16 would lose digits).
    if not tensors:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch._foreach_norm(tensors, 2.0, dtype=torch.float32)
    return torch.stack(norms).square().sum()


def _local_grads(model, ep: int) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """(shards of sharded grads, plain local-expert grads under EP, plain replicated grads)."""
    expert_params = set()
    if ep > 1:
        expert_params = {id(p) for m in model.moe_layers() for p in m.experts.parameters()}
    sharded, ep_local, replicated = [], [], []
    for p in model.parameters():
        g = p.grad
        if g is None:
            continue
        if hasattr(g, "to_local"):
            sharded.append(g.to_local())
        elif id(p) in expert_params:
            ep_local.append(g)
        else:
            replicated.append(g)
    return sharded, ep_local, replicated


def _has_plain_experts(model) -> bool:
    return any(not hasattr(p, "to_local") for m in model.moe_layers() for p in m.experts.parameters())


@torch.no_grad()
def global_grad_norm(model, mesh: ParallelMesh) -> torch.Tensor:
    sharded, ep_local, replicated = _local_grads(model, mesh.dims.ep)
    device = next(model.parameters()).device
    sharded_sq = _sq_norm(sharded, device)
    if mesh.dims.dp_shard > 1:
        dist.all_reduce(sharded_sq, group=mesh.group("dp_shard"))  # mesh axis dp_shard (efsdp x ep), SUM
    ep_sq = _sq_norm(ep_local, device)
    # Decided from the model, not from which grads exist, so every rank of the ep group takes this collective.
    if mesh.dims.ep > 1 and _has_plain_experts(model):
        dist.all_reduce(ep_sq, group=mesh.group("ep"))  # mesh axis ep, SUM: each ep rank has other experts
    return (sharded_sq + ep_sq + _sq_norm(replicated, device)).sqrt()


@torch.no_grad()
def clip_divisor(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """What clipping divides every gradient by: ``max(1, (norm + 1e-6) / max_norm)``, the inverse of
    ``torch.nn.utils.clip_grad_norm_``'s coefficient. The trainer hands it to the optimizer as ``grad_scale``:
    its kernel divides each gradient as it reads it, instead of one more pass over all gradients."""
    return ((total_norm + 1e-6) / max_norm).clamp(min=1.0)


@torch.no_grad()
def clip_grad_norm_(model, max_norm: float, mesh: ParallelMesh) -> torch.Tensor:
    """Scale all gradients by ``min(1, max_norm / (norm + 1e-6))`` as ``torch.nn.utils.clip_grad_norm_`` does,
    with the norm taken over the whole model across ranks. Returns the norm before clipping (fp32, the same
    on every rank). ``max_norm <= 0`` only measures."""
    total = global_grad_norm(model, mesh)
    if max_norm <= 0:
        return total
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    groups: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for g in (t for part in _local_grads(model, mesh.dims.ep) for t in part):
        groups[(g.device, g.dtype)].append(g)
    for (_, dtype), grads in groups.items():
        torch._foreach_mul_(grads, coef.to(dtype))
    return total

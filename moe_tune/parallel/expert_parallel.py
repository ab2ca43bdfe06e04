"""Expert parallelism: each MoE layer keeps only its ep rank's block of experts and dispatches tokens to
the ranks that own theirs.

The local experts stay plain tensors (not DTensors over ep): FSDP2 then shards them over ``efsdp`` only, so
``full_tensor()`` on an expert parameter gathers over efsdp and returns this ep rank's E/ep experts. The
global index of the first local expert is kept in ``experts.expert_offset`` for loading and export.
"""

from __future__ import annotations

from torch import nn

from moe_tune.config import ConfigError
from moe_tune.dist.mesh import ParallelMesh
from moe_tune.moe.dispatch import build_dispatcher
from moe_tune.moe.experts import GroupedExperts


def shard_experts_(experts: GroupedExperts, first: int, num_local: int) -> None:
    """Keep experts [first, first + num_local) of a GroupedExperts, on meta or materialised."""
    for name, p in list(experts.named_parameters(recurse=False)):
        if hasattr(p, "device_mesh"):
            raise RuntimeError(f"apply_ep must run before apply_fsdp: experts.{name} is already a DTensor")
        rows = p.detach()[first : first + num_local].clone()
        setattr(experts, name, nn.Parameter(rows, requires_grad=p.requires_grad))
    experts.num_local_experts = num_local
    experts.expert_offset = first


def apply_ep(model, mesh: ParallelMesh, comm_name: str = "all_to_all", **comm_options) -> None:
    """Give every MoE layer its ep rank's E/ep experts and a ``comm_name`` dispatcher over the ep group.
    No-op when ep == 1 (the local dispatcher stays and every expert is local)."""
    ep = mesh.dims.ep
    if ep == 1:
        return
    ep_group, ep_rank = mesh.group("ep"), mesh.local_rank("ep")
    for moe in model.moe_layers():
        E, K = moe.spec.router.num_experts, moe.spec.router.top_k
        if E % ep:
            raise ConfigError(f"the model's number of experts ({E}) must be divisible by parallel.ep ({ep})")
        dispatcher = build_dispatcher(comm_name, E, K, ep_group, **comm_options)
        moe.set_dispatcher(dispatcher)
        e = dispatcher.num_local_experts
        shard_experts_(moe.experts, ep_rank * e, e)

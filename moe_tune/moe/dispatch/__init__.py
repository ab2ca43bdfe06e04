"""Token dispatch: send routed rows to the ranks that own their experts, and combine the results back.

Registry of backends by name; each lives in its own module and is imported only when asked for, so that
``import moe_tune`` works without DeepEP or a GPU.
"""

from __future__ import annotations

from moe_tune.moe.dispatch.base import Dispatcher


def build_dispatcher(name: str, num_experts: int, top_k: int, ep_group=None, **options) -> Dispatcher:
    """``name`` is a ``comm`` backend; with no expert-parallel group every backend reduces to ``local``."""
    if ep_group is None or _group_size(ep_group) == 1:
        from moe_tune.moe.dispatch.local import LocalDispatcher

        return LocalDispatcher(num_experts, top_k)
    if name == "all_to_all":
        from moe_tune.moe.dispatch.all_to_all import AllToAllDispatcher

        return AllToAllDispatcher(num_experts, top_k, ep_group)
    if name == "deepep":
        from moe_tune.moe.dispatch.deepep import DeepEPDispatcher

        return DeepEPDispatcher(num_experts, top_k, ep_group, **options)
    if name == "symm_mem":
        from moe_tune.moe.dispatch.symm_mem import SymmMemDispatcher

        return SymmMemDispatcher(num_experts, top_k, ep_group, **options)
    raise ValueError(f"unknown comm backend {name!r}; use all_to_all, deepep or symm_mem")


def _group_size(group) -> int:
    import torch.distributed as dist

    return dist.get_world_size(group)


__all__ = ["Dispatcher", "build_dispatcher"]

"""Token dispatch: send routed rows to the ranks that own their experts, and combine the results back.

A registry of backends by ``comm`` name; each lives in its own module, imported only when built (so that
``import moe_tune`` works without DeepEP or a GPU), and takes its own typed options (``moe_tune.config``'s
``AllToAllConfig``, ``DeepEPConfig``, ``SymmMemConfig``). A new backend is one entry here, an options class
there, and a parity test in the dispatcher contract test.
"""

from __future__ import annotations

import dataclasses
import importlib

from moe_tune.config import CommConfig, comm_config
from moe_tune.moe.dispatch.base import Dispatcher

DISPATCHERS = {
    "all_to_all": "moe_tune.moe.dispatch.all_to_all:AllToAllDispatcher",
    "deepep": "moe_tune.moe.dispatch.deepep:DeepEPDispatcher",
    "symm_mem": "moe_tune.moe.dispatch.symm_mem:SymmMemDispatcher",
}


def build_dispatcher(
    options: CommConfig, num_experts: int, top_k: int, ep_group=None, checked_after_step: bool = False
) -> Dispatcher:
    """The ``options.name`` backend over ``ep_group``; with no expert-parallel group every backend reduces to
    ``local``. ``checked_after_step``: the caller runs ``check()`` on every rank after each step, so the
    dispatcher leaves its own per-rank checks out of dispatch (ranks could reach them at different layers)."""
    if ep_group is None or _group_size(ep_group) == 1:
        from moe_tune.moe.dispatch.local import LocalDispatcher

        return LocalDispatcher(num_experts, top_k)
    if options.name not in DISPATCHERS:
        raise ValueError(f"unknown comm backend {options.name!r}; use one of {', '.join(DISPATCHERS)}")
    if type(options) is CommConfig:  # Config()'s default, built in code: the backend's own options, defaulted
        options = comm_config(dataclasses.asdict(options))
    module, _, cls = DISPATCHERS[options.name].partition(":")
    return getattr(importlib.import_module(module), cls)(num_experts, top_k, ep_group, options, checked_after_step)


def _group_size(group) -> int:
    import torch.distributed as dist

    return dist.get_world_size(group)


__all__ = ["DISPATCHERS", "Dispatcher", "build_dispatcher"]

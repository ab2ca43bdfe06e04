"""Expert parallelism: each MoE layer is built holding only its ep rank's block of experts, with a dispatcher
that sends tokens to the ranks that own theirs.

The local experts stay plain tensors (not DTensors over ep): FSDP2 then shards them over ``efsdp`` only, so
``full_tensor()`` on an expert parameter gathers over efsdp and returns this ep rank's E/ep experts. The
dispatcher decides which experts are local (``first_local_expert``, ``num_local_experts``), and the experts
are built with them: nothing is re-sliced after construction.
"""

from __future__ import annotations

from collections.abc import Callable

from moe_tune.config import CommConfig
from moe_tune.distributed.mesh import ParallelMesh
from moe_tune.moe.dispatch import Dispatcher, build_dispatcher


def ep_dispatchers(
    mesh: ParallelMesh, comm: CommConfig, checked_after_step: bool = False
) -> Callable[[int, int], Dispatcher] | None:
    """``make_dispatcher(num_experts, top_k)`` for ``moe_tune.models.model.build_model``: a ``comm.name``
    dispatcher over the ep mesh axis's group. None when ep == 1 (every expert local)."""
    if mesh.dims.ep == 1:
        return None
    group = mesh.group("ep")

    def make(num_experts: int, top_k: int) -> Dispatcher:
        return build_dispatcher(comm, num_experts, top_k, group, checked_after_step)

    return make

"""``parallelize``: the parallelisms applied to a built model in place, in this order: apply_ac -> apply_compile ->
apply_fsdp (expert parallelism is set up at construction: ``expert_parallel.ep_dispatchers``). The whole recipe
(build on meta, parallelize, materialize, load shard by shard) is ``moe_tune.build``'s."""

from __future__ import annotations

from moe_tune.distributed.activation_checkpoint import apply_ac
from moe_tune.distributed.compile import apply_compile
from moe_tune.distributed.fsdp import apply_fsdp
from moe_tune.distributed.mesh import ParallelMesh


def parallelize(model, mesh: ParallelMesh, cfg) -> None:
    """``cfg``: the run's Config (``parallel``, ``kernels.compile`` and ``train.precision`` are read)."""
    apply_ac(model, cfg.parallel.activation_checkpointing)
    apply_compile(model, cfg.kernels.compile, cfg.kernels.compile_dynamic)
    apply_fsdp(model, mesh, cfg.train.precision, cfg.parallel.reshard_after_forward)

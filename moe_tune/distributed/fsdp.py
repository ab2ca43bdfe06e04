"""FSDP2 (``fully_shard``) per decoder layer, experts as their own units on the efsdp mesh, and the root.

Units, innermost first:
  - each MoE layer's ``experts`` over ``expert_fsdp`` = (dp_replicate, efsdp), or efsdp alone when
    dp_replicate == 1. Its gradients are reduce-scattered over efsdp (and all-reduced over dp_replicate);
    they already hold the contributions of every ep rank's tokens (the all-to-all backward brought them),
    so they are divided by the whole data-parallel size, like dense gradients, not by efsdp x dp_replicate.
  - each decoder layer over ``dense_fsdp`` = (dp_replicate, dp_shard) (HSDP), or dp_shard alone.
  - the root: embeddings, final norm and lm_head.
Explicit prefetching: a layer's forward all-gathers the next layer and its experts, its backward the
previous ones, because the nested experts unit would otherwise break FSDP2's implicit backward order.

Precision (``train.precision``, the names in ``config.PRECISIONS``):
  ``bf16_fp32_master``: fp32 parameters and optimizer state, bf16 all-gathers and compute, fp32 reduce-scatter.
  ``bf16``: bf16 everything (parameters, compute, gradient reduction); build the model in bf16.
  ``fp32``: no casts.
  ``amp_bf16``: fp32 parameters; the train step runs under ``torch.autocast``, so FSDP casts nothing.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from moe_tune.config import PRECISIONS, ConfigError
from moe_tune.distributed.dims import ParallelDims
from moe_tune.distributed.mesh import ParallelMesh
from moe_tune.moe.experts import ExpertsOptions
from moe_tune.moe.layer import MoE


def mixed_precision_policy(precision: str) -> MixedPrecisionPolicy:
    if precision == "bf16_fp32_master":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    if precision in ("fp32", "amp_bf16"):
        return MixedPrecisionPolicy()
    raise ConfigError(f"train.precision={precision!r} is not one of {', '.join(PRECISIONS)}")


def experts_options(dims: ParallelDims, precision: str, impl: str = "grouped_mm") -> ExpertsOptions:
    """What the experts do themselves because FSDP2 does not for them (``dims.experts_outside_fsdp``): cast their
    weights to the compute dtype, and average their gradients over the data-parallel ranks."""
    if not dims.experts_outside_fsdp:
        return ExpertsOptions(impl=impl)
    return ExpertsOptions(
        impl=impl, compute_dtype=mixed_precision_policy(precision).param_dtype, grad_divide=float(dims.dp)
    )


def _moe_of(layer: nn.Module) -> MoE | None:
    moes = [m for m in layer.modules() if isinstance(m, MoE)]
    return moes[0] if moes else None


def _set_prefetch(units: list[list[FSDPModule]]) -> None:
    """``units[i]``: layer i's FSDP modules (the layer, then its experts if it has them)."""
    for i, unit in enumerate(units):
        if i + 1 < len(units):
            unit[0].set_modules_to_forward_prefetch(units[i + 1])
        if i > 0:
            unit[0].set_modules_to_backward_prefetch(units[i - 1])


def apply_fsdp(
    model, mesh: ParallelMesh, precision: str = "bf16_fp32_master", reshard_after_forward: bool = True
) -> None:
    """Shard ``model`` in place (call after apply_ep and apply_ac, before materialising meta parameters)."""
    dims = mesh.dims
    mp = mixed_precision_policy(precision)
    trained = [p for p in model.parameters() if p.requires_grad]
    lora = len(trained) < sum(1 for _ in model.parameters())
    stored_as_computed = mp.param_dtype is None or all(p.dtype == mp.param_dtype for p in trained)
    if dims.world_size == 1 and (stored_as_computed or lora):
        # One rank and no casts to do: FSDP2 would only add all-gather/reduce-scatter copies over a group of one, a
        # large share of a small step (benchmarks/README.md, "Three stacks in one run"). bf16_fp32_master keeps
        # FSDP2 on one rank: its mixed precision is the bf16 compute of the fp32 parameters. With LoRA the
        # frozen base is stored in bf16 already and the adapters cast themselves to the input's dtype.
        return
    # 1-D meshes when there is no replication: plain FSDP, no size-1 replicate dimension.
    dense_mesh = mesh["dense_fsdp"] if dims.dp_replicate > 1 else mesh["dp_shard"]
    expert_mesh = mesh["expert_fsdp"] if dims.dp_replicate > 1 else mesh["efsdp"]
    # Each ep rank alone holding its experts: they stay plain parameters outside FSDP2 (no all-gather copies, no
    # reduce-scatter, no resharding), built with ``experts_options`` to cast and average by themselves.
    plain_experts = dims.experts_outside_fsdp
    ignored: set[nn.Parameter] = set()
    units: list[list[FSDPModule]] = []
    for layer in model.layers:
        unit = []
        moe = _moe_of(layer)
        if moe is not None and plain_experts:
            ignored |= set(moe.experts.parameters())
        elif moe is not None:
            fully_shard(moe.experts, mesh=expert_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
            # Expert grads summed over ep by the all-to-all backward: average over all dp ranks (dp_replicate x
            # dp_shard), as FSDP does for dense grads, not over the efsdp x dp_replicate ranks that reduce them.
            moe.experts.set_gradient_divide_factor(float(dims.dp))
            unit.append(moe.experts)
        if moe is not None and moe.spec.router.score == "sigmoid" and mp.param_dtype is not None:
            # fp32 island: DeepSeek-V3/GLM-4-MoE routers select experts from fp32 weights (transformers keeps
            # them fp32 too); their own unit, so the layer's bf16 all-gather does not round them.
            fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
            fully_shard(moe.router, mesh=dense_mesh, mp_policy=fp32, reshard_after_forward=reshard_after_forward)
        fully_shard(
            layer, mesh=dense_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward, ignored_params=ignored
        )
        units.append([layer, *unit])
    fully_shard(model, mesh=dense_mesh, mp_policy=mp, ignored_params=ignored)
    _set_prefetch(units)
    if mesh.device_type == "cpu":
        _gloo_reductions(model, dims.dp, dims.dp_shard, dims.efsdp)


def _gloo_reductions(model, dp: int, dp_shard: int, efsdp: int) -> None:
    """gloo has no PREMUL_SUM (the reduce op behind a divide factor) and no AVG all-reduce: reduce with SUM
    and divide by the data-parallel size afterwards. Not when a unit's shard group has one rank: FSDP2 then
    skips the reduce-scatter and already divides while copying, and forcing SUM would divide a second time."""
    experts = {id(m.experts) for m in model.modules() if isinstance(m, MoE)}
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(float(dp))
            m.set_force_sum_reduction_for_comms((efsdp if id(m) in experts else dp_shard) > 1)

"""What one rank holds: the run's model built on the meta device under its real mesh, over a fake process group
of the layout's world size (no processes, nothing allocated), and counted.

``census(cfg, hf_config, world_size)`` runs the training build's own steps (``validate`` -> ``build_mesh`` ->
``build_model`` with the comm backend's dispatchers -> ``parallelize``: activation checkpointing, compile, FSDP2)
and reads every parameter's local shard (a DTensor's ``to_local()``: FSDP2's dim-0 shard of its mesh) and every
buffer (a quantized base's codes and scales). Rank 0 stands for every rank: the layouts moe_tune builds give every
rank the same shapes (FSDP2's last shard may be up to one row shorter; counted as rank 0's).
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass, field

import torch

from moe_tune.config import Config
from moe_tune.distributed.shard import local_bytes

ROOT = -1  # the FSDP unit of everything outside the decoder layers (embeddings, final norm, lm_head)


@dataclass
class Census:
    """Bytes one rank holds, by what they are. ``unit_gathered``: per FSDP unit (each decoder layer index, ROOT)
    the bytes FSDP2 all-gathers for compute (the unit's full parameters in the compute dtype); empty when FSDP2 is
    not applied (one rank with nothing to cast)."""

    dims: object  # ParallelDims
    params: int = 0  # stored parameters (every dtype, trained and frozen)
    trained: int = 0  # trained parameters' bytes (their gradients have the same dtype and size)
    frozen_buffers: int = 0  # buffers: a quantized base's codes and scales, rotary tables
    cast_experts_per_layer: int = 0  # experts outside FSDP2 cast to the compute dtype: one MoE layer's cast bytes
    unit_gathered: dict[int, int] = field(default_factory=dict)
    unit_grad_reduce: dict[int, int] = field(default_factory=dict)  # unsharded gradient bytes per unit (reduce dtype)
    fsdp: bool = False
    # Bytes FSDP2 copies per micro-batch (for the step time): each parameter it manages at its stored size on its
    # mesh (gathered whole), and the trained ones' gradients at the reduce dtype.
    fsdp_bytes: int = 0
    layers: int = 0
    moe_layers: int = 0
    num_experts: int = 0
    local_experts: int = 0
    top_k: int = 0
    hidden: int = 0
    vocab: int = 0
    total_params: int = 0  # the model's parameters as its checkpoint holds them (every expert, none of LoRA's)
    active_params: int = 0  # of those, what one token runs through (top-k experts per MoE layer)
    flops_matmul_per_token: dict[str, float] = field(default_factory=dict)  # forward, by "dense" / "experts" / "head"


def _layer_of(name: str) -> int:
    parts = name.split(".")
    if "layers" in parts:
        i = parts.index("layers")
        if i + 1 < len(parts) and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return ROOT


@contextlib.contextmanager
def fake_world(world_size: int):
    """A fake process group of ``world_size`` ranks (this process is rank 0) for the duration; none may exist.
    DTensor's sharding caches are emptied after: their keys' meshes compare equal to a real group's meshes of the
    same layout (DeviceMesh equality ignores the group and the rank), so a run planned in its own process
    (``auto``) would get back specs on the fake rank-0 meshes, and rank r > 0 would take rank 0's shards."""
    import torch.distributed as dist
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("moe-tune-plan builds under a fake process group and cannot run inside a real one")
    hook = sys.excepthook  # init_process_group wraps it to prefix "[rank0]": once per plan, a prefix each
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook
        _clear_sharding_prop_cache()


def census(cfg: Config, hf_config, world_size: int) -> Census:
    """Build ``cfg``'s model for ``world_size`` ranks on the meta device and count rank 0's share."""
    from torch.distributed.fsdp import FSDPModule

    from moe_tune.build import model_options
    from moe_tune.config import validate
    from moe_tune.distributed.expert_parallel import ep_dispatchers
    from moe_tune.distributed.fsdp import mixed_precision_policy
    from moe_tune.distributed.mesh import build_mesh
    from moe_tune.distributed.parallelize import parallelize
    from moe_tune.models.families import expert_dims, num_experts
    from moe_tune.models.model import build_model

    with fake_world(world_size):
        dims = validate(
            cfg, world_size=world_size, num_experts=num_experts(hf_config), expert_dims=expert_dims(hf_config)
        )
        mesh = build_mesh(dims, "cpu")
        options = model_options(cfg, dims)
        model = build_model(hf_config, options, ep_dispatchers(mesh, cfg.comm), None)
        moes = model.moe_layers()
        c = Census(dims=dims)
        _shapes(c, model, moes, cfg.train.seq_len)
        c.total_params, c.active_params = _param_counts(model, moes)
        parallelize(model, mesh, cfg)
        c.fsdp = isinstance(model, FSDPModule)
        mp = mixed_precision_policy(cfg.train.precision)
        compute = torch.empty(0, dtype=mp.param_dtype).element_size() if mp.param_dtype is not None else None
        reduce = torch.empty(0, dtype=mp.reduce_dtype).element_size() if mp.reduce_dtype is not None else None
        for name, p in model.named_parameters():
            b = local_bytes(p)
            c.params += b
            if p.requires_grad:
                c.trained += b
            if c.fsdp and hasattr(p, "to_local"):  # an FSDP2 parameter: gathered whole for compute
                unit = _layer_of(name)
                c.fsdp_bytes += p.numel() * p.element_size()
                c.unit_gathered[unit] = c.unit_gathered.get(unit, 0) + p.numel() * (compute or p.element_size())
                if p.requires_grad:
                    grad = p.numel() * (reduce or p.element_size())
                    c.unit_grad_reduce[unit] = c.unit_grad_reduce.get(unit, 0) + grad
                    c.fsdp_bytes += grad
        c.frozen_buffers = sum(local_bytes(b) for b in model.buffers())
        if dims.experts_outside_fsdp and moes and compute is not None:
            experts = moes[0].experts
            # each layer's cast copy is saved by its grouped GEMM for the backward: held like an activation
            cast = [p for n, p in experts.named_parameters() if "lora" not in n and p.element_size() != compute]
            c.cast_experts_per_layer = sum(p.numel() for p in cast) * compute
    return c


def _param_counts(model, moes) -> tuple[int, int]:
    """(total, active per token) parameters of the built, not yet parallelized model, counted as its checkpoint
    holds them: every MoE layer's experts (this rank builds its ep share), a quantized base's at their unquantized
    count; LoRA's adapters left out. Shared experts and routers run for every token."""
    from moe_tune.lora import is_adapter

    routed = {id(p) for m in moes for p in m.experts.parameters()}
    total = sum(p.numel() for n, p in model.named_parameters() if not is_adapter(n) and id(p) not in routed)
    active = total
    for m in moes:
        x, s = m.experts, m.spec
        biases = sum(p.numel() for n, p in x.named_parameters() if n.endswith("_bias") and not is_adapter(n))
        per_expert = 3 * s.experts.dim * s.experts.hidden + biases // max(x.num_local_experts, 1)
        total += s.router.num_experts * per_expert
        active += s.router.top_k * per_expert
    return total, active


def _shapes(c: Census, model, moes, seq_len: int) -> None:
    """The model's dims and its forward matmul FLOPs per token by kind (what the step-time model divides by rates)."""
    from moe_tune.metrics import active_matmul_params, attention_width

    conf = model.config
    c.layers = conf.num_hidden_layers
    c.moe_layers = len(moes)
    c.vocab = conf.vocab_size
    c.hidden = conf.hidden_size
    experts = 0
    if moes:
        s = moes[0].spec
        c.num_experts, c.top_k = s.router.num_experts, s.router.top_k
        c.local_experts = moes[0].experts.num_local_experts
        experts = len(moes) * s.router.top_k * 3 * s.experts.dim * s.experts.hidden
    head = conf.vocab_size * conf.hidden_size
    total = active_matmul_params(model)
    c.flops_matmul_per_token = {
        "experts": 2.0 * experts,
        "head": 2.0 * head,
        "dense": 2.0 * (total - experts - head),
        # causal attention: QK^T and AV, 2 x S x width multiply-adds each per token and layer, halved by the mask
        "attention": 2.0 * c.layers * seq_len * attention_width(conf),
    }

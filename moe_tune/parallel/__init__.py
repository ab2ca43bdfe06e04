"""Parallelism: expert parallelism at construction (``ep_dispatchers``), then applied to the model in place in
this order: apply_ac -> apply_compile -> apply_fsdp. The whole recipe (build on meta, parallelize, materialize,
load shard by shard) is ``moe_tune.build``'s."""

from __future__ import annotations

from moe_tune.dist.mesh import ParallelMesh
from moe_tune.parallel.activation_checkpoint import apply_ac
from moe_tune.parallel.clip import clip_divisor, clip_grad_norm_, global_grad_norm
from moe_tune.parallel.compile import apply_compile
from moe_tune.parallel.expert_parallel import ep_dispatchers
from moe_tune.parallel.fsdp import apply_fsdp, experts_options, mixed_precision_policy


def parallelize(model, mesh: ParallelMesh, cfg) -> None:
    """``cfg``: the run's Config (``parallel``, ``kernels.compile`` and ``train.precision`` are read)."""
    apply_ac(model, cfg.parallel.activation_checkpointing)
    apply_compile(model, cfg.kernels.compile, cfg.kernels.compile_dynamic)
    apply_fsdp(model, mesh, cfg.train.precision, cfg.parallel.reshard_after_forward)


def export_hf(
    model, out_dir: str, mesh: ParallelMesh, dtype=None, max_shard_bytes: int = 4 << 30, chat_template=None
) -> None:
    """Write a parallelized model as a Hugging Face checkpoint, streaming (a LoRA model: its PEFT adapter
    directory); every rank must call it.
    ``out_dir`` is replaced as a whole once every rank has written (``write_checkpoint_atomic``).

    Expert slices are written by efsdp rank 0 of dp_replicate rank 0 of each ep rank; full_tensor() gathers
    them over efsdp only. ``dtype``: a torch dtype or name forcing every tensor's dtype (default: the source
    checkpoint's dtypes, else the in-memory ones). ``chat_template``: the template the data was rendered with when
    it was not the tokenizer's (data.chat_template), written as chat_template.jinja."""
    import torch

    from moe_tune.models.export import write_checkpoint_atomic
    from moe_tune.models.lora import has_lora
    from moe_tune.models.peft_export import write_adapter

    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    if has_lora(model):  # a PEFT adapter directory (the merged model: moe-tune-export --merge)
        write_checkpoint_atomic(
            model, out_dir, writer=write_adapter, ep_group=mesh.group("ep"), dtype=dtype, chat_template=chat_template
        )
        return
    write_checkpoint_atomic(
        model,
        out_dir,
        max_shard_bytes=max_shard_bytes,
        expert_writer=mesh.is_expert_writer(),
        dtype=dtype,
        ep_group=mesh.group("ep"),
        chat_template=chat_template,
    )


__all__ = [
    "apply_ac",
    "apply_compile",
    "apply_fsdp",
    "clip_divisor",
    "clip_grad_norm_",
    "ep_dispatchers",
    "experts_options",
    "export_hf",
    "global_grad_norm",
    "mixed_precision_policy",
    "parallelize",
]

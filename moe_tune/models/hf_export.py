"""``export_hf``: a parallelized model to a Hugging Face checkpoint (``export.py``) or, for a LoRA model, a PEFT
adapter directory (``peft_export.py``); what ``hf/`` of a run and ``moe-tune-export`` write."""

from __future__ import annotations

import torch

from moe_tune.distributed.mesh import ParallelMesh
from moe_tune.models.export import write_checkpoint_atomic
from moe_tune.models.lora import has_lora
from moe_tune.models.peft_export import write_adapter


def export_hf(
    model, out_dir: str, mesh: ParallelMesh, dtype=None, max_shard_bytes: int = 4 << 30, chat_template=None
) -> None:
    """Write a parallelized model as a Hugging Face checkpoint, streaming (a LoRA model: its PEFT adapter
    directory); every rank must call it.
    ``out_dir`` is replaced as a whole once every rank has written (``write_checkpoint_atomic``).

    Expert slices are written by efsdp rank 0 of dp_replicate rank 0 of each ep rank; full_tensor() gathers
    them over efsdp only. ``dtype``: a torch dtype or name forcing every tensor's dtype but those transformers keeps
    in fp32 (``fp32_islands``; default: the source checkpoint's dtypes, else the in-memory ones). ``chat_template``:
    the template the data was rendered with when it was not the tokenizer's (data.chat_template), written as
    chat_template.jinja."""
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

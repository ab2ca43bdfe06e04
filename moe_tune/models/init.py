"""Random initialisation in place, identical for every parallel layout and for the plain Hugging Face model.

Each tensor is drawn whole from a generator seeded by (seed, its name), on its device, and each rank keeps
only the rows it owns (its experts, its FSDP shard). Parameter names are the Hugging Face model's, so the
Transformers baseline of a benchmark initialised with this function starts from the same weights.
"""

from __future__ import annotations

import zlib

import torch


@torch.no_grad()
def init_random(model, std: float | None = None, seed: int = 0, num_experts: int | None = None) -> None:
    """Normal(0, std) for matrices, ones for norm weights, zeros for biases and 1-D buffers."""
    from moe_tune.models.hf_io import EXPERT_PARAM, expert_offsets, local_rows, named_tensors

    std = std if std is not None else float(getattr(model.config, "initializer_range", 0.02))
    offsets = expert_offsets(model)
    for name, t in named_tensors(model):
        if not t.is_floating_point():
            continue
        if t.dim() <= 1:
            (t.to_local() if hasattr(t, "to_local") else t).fill_(1.0 if "norm" in name else 0.0)
            continue
        local, first = local_rows(t)
        first += offsets.get(name, 0)
        rows = local.shape[0]
        # Draw the whole global tensor so every layout gets the same values (all experts when known).
        global_rows = num_experts if EXPERT_PARAM.match(name) and num_experts is not None else t.shape[0]
        shape = (max(global_rows, first + rows), *t.shape[1:])
        g = torch.Generator(device=local.device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        full = torch.randn(shape, generator=g, device=local.device, dtype=torch.float32)
        local.copy_(full[first : first + rows].mul_(std))

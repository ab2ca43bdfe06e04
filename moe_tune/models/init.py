"""Random initialisation in place, identical for every parallel layout and for the plain Hugging Face model.

Each tensor is drawn whole from a generator seeded by (seed, its name), on its device, and each rank keeps
only the rows it owns (its experts, its FSDP shard). Parameter names are the Hugging Face model's, so the
Transformers baseline of a benchmark initialised with this function starts from the same weights.
"""

from __future__ import annotations

import zlib

import torch


def _owned_rows(name: str, t: torch.Tensor, expert_offsets: dict[str, int]) -> tuple[torch.Tensor, int, int, int]:
    """(local tensor, first global row, number of rows, global row count) of a plain tensor or DTensor."""
    offset = expert_offsets.get(name, 0)
    if hasattr(t, "to_local"):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, start = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        return t.to_local(), offset + (start[0] if shape[0] else 0), shape[0], t.shape[0]
    return t, offset, t.shape[0] if t.dim() else 1, t.shape[0] if t.dim() else 1


@torch.no_grad()
def init_random(model, std: float | None = None, seed: int = 0, num_experts: int | None = None) -> None:
    """Normal(0, std) for matrices, ones for norm weights, zeros for biases and 1-D buffers."""
    from moe_tune.models.hf_io import EXPERT_PARAM, expert_offsets, named_tensors

    std = std if std is not None else float(getattr(model.config, "initializer_range", 0.02))
    offsets = expert_offsets(model)
    for name, t in named_tensors(model):
        local, first, rows, global_rows = _owned_rows(name, t, offsets)
        if not local.is_floating_point():
            continue
        if local.dim() <= 1:
            local.fill_(1.0 if "norm" in name else 0.0)
            continue
        if EXPERT_PARAM.match(name) and num_experts is not None:
            global_rows = num_experts
        elif name in offsets:
            global_rows = first + rows  # enough rows to reach this rank's experts
        shape = (max(global_rows, first + rows), *t.shape[1:])
        g = torch.Generator(device=local.device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        full = torch.randn(shape, generator=g, device=local.device, dtype=torch.float32)
        local[:rows].copy_(full[first : first + rows].mul_(std))

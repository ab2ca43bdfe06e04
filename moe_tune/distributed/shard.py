"""This rank's part of a tensor that may be an FSDP2/EP DTensor."""

from __future__ import annotations

import torch


def local(t: torch.Tensor) -> torch.Tensor:
    """The rank's shard of a DTensor (same storage), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def local_bytes(t: torch.Tensor) -> int:
    """Bytes this rank holds of ``t``."""
    shard = local(t)
    return shard.numel() * shard.element_size()

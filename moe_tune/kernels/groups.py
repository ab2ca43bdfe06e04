"""Rows sorted by group, as the grouped GEMMs take them: ``offs_e`` holds each group's end row (int32, on the
device); rows past the last end are a dispatcher's fixed-capacity padding."""

from __future__ import annotations

import torch


def row_groups(offs_e: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Each row's group; rows past ``offs_e[-1]`` get group e (one past the last). On the device, the output size
    given: no host sync."""
    e = offs_e.shape[0]
    offs = offs_e.long()
    counts = torch.diff(offs, prepend=offs.new_zeros(1))
    tail = (num_rows - offs[-1:]).clamp(min=0)
    ids = torch.arange(e + 1, device=offs.device)
    return torch.repeat_interleave(ids, torch.cat([counts, tail]), output_size=num_rows)

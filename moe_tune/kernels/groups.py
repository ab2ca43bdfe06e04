"""Rows sorted by group, as the grouped GEMMs take them: ``offs_e`` holds each group's end row (int32, on the
device); rows past the last end are a dispatcher's fixed-capacity padding. Padding each group to a multiple of
``ROW_ALIGN`` rows (the FP8 weight gradient's operands)."""

from __future__ import annotations

import torch

# The FP8 grouped GEMMs' rows start on 16-byte boundaries for the kernel's bulk copies: the weight-gradient GEMM
# contracts over tokens, so each expert's group of rows is padded to this many.
ROW_ALIGN = 16


def row_groups(offs_e: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Each row's group; rows past ``offs_e[-1]`` get group e (one past the last). On the device, the output size
    given: no host sync."""
    e = offs_e.shape[0]
    offs = offs_e.long()
    counts = group_counts(offs)
    tail = (num_rows - offs[-1:]).clamp(min=0)
    ids = torch.arange(e + 1, device=offs.device)
    return torch.repeat_interleave(ids, torch.cat([counts, tail]), output_size=num_rows)


def group_counts(offs: torch.Tensor) -> torch.Tensor:
    """Each group's rows, from the group ends ``offs`` (int64)."""
    return torch.diff(offs, prepend=offs.new_zeros(1))


def padded_row_bound(num_rows: int, num_groups: int) -> int:
    """The rows after padding each group to a multiple of 16, at most: a bound known on the host (no sync)."""
    return -(-(num_rows + (ROW_ALIGN - 1) * num_groups) // ROW_ALIGN) * ROW_ALIGN


def padded_counts(offs_e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each group's rows, its rows padded to a multiple of 16, and the padded groups' ends (int64)."""
    offs = offs_e.long()
    counts_e = group_counts(offs)
    padded_counts_e = (counts_e + ROW_ALIGN - 1) // ROW_ALIGN * ROW_ALIGN
    return counts_e, padded_counts_e, torch.cumsum(padded_counts_e, 0)


def pad_groups(offs_e: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Where each of ``num_rows`` rows goes when every group is padded to a multiple of 16 rows, all on the device
    (output sizes are bounded on the host: no sync). Rows past ``offs_e[-1]`` (a dispatcher's fixed-capacity
    padding) land after the last group, where the kernel never reads.

    Returns (dest_R: each row's padded index, group_B: each 16-row block's group, e for the tail,
    padded offs_e (int32), P: the padded row count)."""
    e = offs_e.shape[0]
    num_padded = padded_row_bound(num_rows, e)
    offs = offs_e.long()
    counts_e, padded_counts_e, padded_offs_e = padded_counts(offs)
    # Group e is the tail: rows past offs_e[-1], placed after the last padded group.
    starts = torch.cat([offs - counts_e, offs[-1:]])
    padded_starts = torch.cat([padded_offs_e - padded_counts_e, padded_offs_e[-1:]])
    ids = torch.arange(e + 1, device=offs.device)
    group_R = row_groups(offs_e, num_rows)
    dest_R = padded_starts[group_R] + torch.arange(num_rows, device=offs.device) - starts[group_R]
    num_blocks = num_padded // ROW_ALIGN
    blocks_e = padded_counts_e // ROW_ALIGN
    tail_blocks = num_blocks - blocks_e.sum(0, keepdim=True)
    group_B = torch.repeat_interleave(ids, torch.cat([blocks_e, tail_blocks]), output_size=num_blocks)
    return dest_R, group_B, padded_offs_e.to(torch.int32), num_padded

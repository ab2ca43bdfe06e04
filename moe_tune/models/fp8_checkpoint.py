"""Checkpoints published in block-scaled FP8 (DeepSeek-V3's own release, Qwen3-*-FP8): read dequantized.

Such a checkpoint says so in config.json, ``"quantization_config": {"quant_method": "fp8", "weight_block_size":
[128, 128], ...}`` (transformers' FineGrainedFP8 format), and stores each quantized weight ``<key>`` ([N, K],
float8_e4m3fn) beside ``<key>_scale_inv`` ([ceil(N / bn), ceil(K / bk)], fp32): the factor each (bn x bk) block's
values are multiplied by to give the weight. ``hf_io.CheckpointReader`` hands such weights out dequantized (fp32), row
range by row range, so a rank reads only its rows and never a whole model in bf16; everything downstream (a bf16
or fp32 model, ``peft.quantize_base=fp8|nf4`` quantizing again shard by shard, exports, merges) sees those values
as it would a bf16 checkpoint's. Exports write them as bf16, and their config.json carries no quantization_config.
An E4M3 tensor without its scales (no quantization_config, or the scale tensor missing) is refused by name.

Any other ``quant_method`` (GPTQ, AWQ, bitsandbytes, compressed-tensors, GPT-OSS's MXFP4) is refused when the
checkpoint is checked, with the fix: the model's bf16 release.
"""

from __future__ import annotations

import json
import os

import torch

from moe_tune.config import CheckpointError

SCALE_SUFFIX = "_scale_inv"
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FP8_NAMES = ("F8_E4M3", "F8_E5M2")  # the same, as safetensors headers name them


def block_size(cfg: dict, file: str) -> tuple[int, int] | None:
    """(rows, cols) of one scale's block for a block-scaled FP8 config.json (``cfg``, read from ``file``); None
    without a quantization_config. Raises CheckpointError for a quantization moe_tune does not read."""
    q = cfg.get("quantization_config")
    if q is None:
        return None
    method = q.get("quant_method") if isinstance(q, dict) else None
    bf16 = "give the model's bf16 release (or dequantize it with transformers first)"
    if method != "fp8":
        raise CheckpointError(
            f"{file}: quantization_config.quant_method={method!r}; moe_tune reads bf16, fp16 or fp32 checkpoints "
            f"and block-scaled fp8 ones (DeepSeek-V3, Qwen3-*-FP8): {bf16}"
        )
    block = q.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise CheckpointError(
            f"{file}: quantization_config.weight_block_size={block!r}; moe_tune reads fp8 checkpoints scaled per "
            f"block ([128, 128] in DeepSeek-V3's and Qwen's releases), not per tensor or channel: {bf16}"
        )
    if q.get("fmt", "e4m3") != "e4m3":
        raise CheckpointError(f"{file}: quantization_config.fmt={q['fmt']!r}; moe_tune reads e4m3 weights: {bf16}")
    return block[0], block[1]


def checkpoint_block_size(path: str) -> tuple[int, int] | None:
    """``block_size`` of the checkpoint directory ``path`` (None without a config.json)."""
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        return None
    with open(file, encoding="utf-8") as f:
        return block_size(json.load(f), file)


def unscaled_fp8(path: str, key: str, block: tuple[int, int] | None) -> str:
    """The line for an FP8 tensor the reader cannot scale: without a quantization_config, or without its scales."""
    if block is None:
        return (
            f"checkpoint {path}: {key} is stored in fp8, but config.json has no quantization_config saying how it "
            "is scaled; copy config.json from the model's original release, or give its bf16 release"
        )
    return f"checkpoint {path}: {key} is stored in fp8 without {key}{SCALE_SUFFIX}, its block scales; is it complete?"


def scale_problem(
    path: str, key: str, weight_dtype: str, weight_shape: list[int], scale_shape: list[int], block: tuple[int, int]
) -> str | None:
    """The line for a weight whose ``_scale_inv`` cannot be its block scales, else None: the weight not stored in
    fp8 (a checkpoint dequantized in part, its scales left behind), or a scale grid other than ceil(shape / block)
    (scales made for another weight_block_size)."""
    if weight_dtype not in FP8_NAMES:
        return (
            f"checkpoint {path}: {key} is stored in {weight_dtype}, not fp8, yet has {key}{SCALE_SUFFIX}; a checkpoint "
            "dequantized in part? Give the release as published, or drop the stale scale tensors"
        )
    if len(weight_shape) != 2:
        return f"checkpoint {path}: {key} has shape {tuple(weight_shape)}; moe_tune reads 2-d block-scaled fp8 weights"
    grid = [-(-n // b) for n, b in zip(weight_shape, block)]
    if list(scale_shape) != grid:
        return (
            f"checkpoint {path}: {key}{SCALE_SUFFIX} has shape {tuple(scale_shape)}, but {key} "
            f"{tuple(weight_shape)} in blocks of {list(block)} (config.json's weight_block_size) needs {tuple(grid)}; "
            "does config.json belong to these weights?"
        )
    return None


def check_headers(path: str, entries: dict[str, dict], block: tuple[int, int] | None) -> None:
    """Every fp8 tensor has block scales that fit it, and every scale tensor is an fp8 weight's (``entries``: the
    safetensors headers' key -> {"dtype", "shape"}): the reader's checks, before anything is built."""
    for key in sorted(entries):
        if entries[key].get("dtype") in FP8_NAMES and (block is None or key + SCALE_SUFFIX not in entries):
            raise CheckpointError(unscaled_fp8(path, key, block))
        name = key.removesuffix(SCALE_SUFFIX)
        if block is not None and name != key and name in entries:
            weight, scale = entries[name], entries[key]
            problem = scale_problem(path, name, weight.get("dtype"), weight.get("shape"), scale.get("shape"), block)
            if problem:
                raise CheckpointError(problem)


def dequantize_rows(q_rK: torch.Tensor, scale_bK: torch.Tensor, start: int, block: tuple[int, int]) -> torch.Tensor:
    """fp32 rows [start, start + r) of a block-scaled weight: ``q_rK`` those rows' E4M3 values, ``scale_bK`` the
    scale rows of the blocks they fall in (the first being block ``start // block[0]``). fp32 as transformers
    computes it; the model's dtype then rounds it once (bf16 parameters, an export)."""
    r, K = q_rK.shape
    bn, bk = block
    rows = torch.arange(start, start + r) // bn - start // bn
    scale_rK = scale_bK.float()[rows].repeat_interleave(bk, dim=1)[:, :K]
    return q_rK.float() * scale_rK


__all__ = [
    "FP8_DTYPES",
    "FP8_NAMES",
    "SCALE_SUFFIX",
    "block_size",
    "check_headers",
    "checkpoint_block_size",
    "dequantize_rows",
    "scale_problem",
    "unscaled_fp8",
]

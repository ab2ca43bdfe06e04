"""The Python API's arguments (``moe_tune.AutoModelForCausalLM.from_pretrained``) as the model's construction
options, each checked: a bad one is a ConfigError naming the value and the fix."""

from __future__ import annotations

import dataclasses
import difflib

import torch

from moe_tune.config import ConfigError
from moe_tune.config.schema import KERNEL_SETS
from moe_tune.models.model import ModelOptions

# transformers' names of what from_pretrained takes under another name
RENAMED = {"torch_dtype": "transformers' older name of dtype: give dtype="}


def model_options(dtype, kernels: str, options: dict) -> ModelOptions:
    """``ModelOptions(dtype=..., kernels=..., **options)`` once each argument is one it takes."""
    if kernels not in KERNEL_SETS:
        raise ConfigError(f"kernels={kernels!r} is not one of {', '.join(KERNEL_SETS)}")
    names = {f.name for f in dataclasses.fields(ModelOptions)} - {"dtype", "kernels"}
    for key in options:
        if key in RENAMED:
            raise ConfigError(f"{key} is {RENAMED[key]}{options[key]}")
        if key not in names:
            close = difflib.get_close_matches(key, sorted(names), n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise ConfigError(
                f"{key} is not an option of the model; {hint}the options: {', '.join(sorted(names))} "
                "(moe_tune.models.model.ModelOptions)"
            )
    return ModelOptions(dtype=torch_dtype(dtype), kernels=kernels, **options)


def torch_dtype(dtype) -> torch.dtype:
    """A torch dtype given as itself or by its name in torch (``"bfloat16"``); a floating-point one."""
    value = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ConfigError(
            f"dtype={dtype!r} is not a floating-point torch dtype; give torch.bfloat16 or 'bfloat16' (or float32)"
        )
    return value

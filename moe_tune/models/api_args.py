"""The Python API's arguments (``moe_tune.AutoModelForCausalLM.from_pretrained``) as the model's construction
options, each checked: a bad one is a ConfigError naming the value and the fix."""

from __future__ import annotations

import dataclasses
import difflib
import math

import torch

from moe_tune.config import ConfigError
from moe_tune.config.constraints import choice_hint
from moe_tune.config.overrides import BNB_SWITCHES
from moe_tune.config.schema import FP8_MODES, KERNEL_SETS
from moe_tune.lora import LoRASpec
from moe_tune.models.model import ModelOptions
from moe_tune.moe.experts import ExpertsOptions

# transformers' names of what from_pretrained takes under another name
RENAMED = {"torch_dtype": "transformers' older name of dtype: give dtype="}
# transformers' arguments for a bitsandbytes base: the storage of moe_tune's frozen routed experts that stands for each
QUANTIZED_PEERS = {**BNB_SWITCHES, "quantization_config": "nf4"}
# Options that are moe_tune's own dataclasses (their class, its import path, what None means or None if refused):
# a dict or a string in their place reached the build and failed there on an attribute.
OPTION_CLASSES = {
    "lora": (LoRASpec, "moe_tune.lora.LoRASpec", "full fine-tuning"),
    "experts": (ExpertsOptions, "moe_tune.moe.experts.ExpertsOptions", None),
}


def model_options(dtype, kernels: str, options: dict) -> ModelOptions:
    """``ModelOptions(dtype=..., kernels=..., **options)`` once each argument is one it takes."""
    if kernels not in KERNEL_SETS:
        hint = choice_hint("kernels", kernels, KERNEL_SETS)
        raise ConfigError(f"kernels={kernels!r} is not one of {', '.join(KERNEL_SETS)}" + (f"; {hint}" if hint else ""))
    names = {f.name for f in dataclasses.fields(ModelOptions)} - {"dtype", "kernels"}
    for key in options:
        if key in RENAMED:
            raise ConfigError(f"{key} is {RENAMED[key]}{options[key]}")
        if key in QUANTIZED_PEERS:
            raise ConfigError(
                f"{key} is transformers' argument for a bitsandbytes base; moe_tune holds the frozen routed experts "
                f"quantized under LoRA: give experts=moe_tune.moe.experts.ExpertsOptions(quantized_base="
                f"'{QUANTIZED_PEERS[key]}') and lora=moe_tune.lora.LoRASpec(...)"
            )
        if key not in names and (nested := nested_option(key, options[key])):
            raise ConfigError(nested)
        if key not in names:
            close = difflib.get_close_matches(key, sorted(names), n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise ConfigError(
                f"{key} is not an option of the model; {hint}the options: {', '.join(sorted(names))} "
                "(moe_tune.models.model.ModelOptions)"
            )
    problem = class_problem(options) or option_problem(options) or switch_problem(kernels, options)
    if problem:
        raise ConfigError(problem)
    return ModelOptions(dtype=torch_dtype(dtype), kernels=kernels, **options)


def nested_option(key: str, value) -> str | None:
    """The line for a field of ``OPTION_CLASSES`` given to from_pretrained itself (``quantized_base="nf4"``,
    ``rank=8``, or the CLI's spelling: ``quantize_base``, ``target``): where it goes; None for anything else."""
    for option, (cls, path, _) in OPTION_CLASSES.items():
        close = difflib.get_close_matches(key, [f.name for f in dataclasses.fields(cls)], n=1, cutoff=0.85)
        if close:
            where = f"{cls.__name__} takes it" + ("" if close[0] == key else f" as {close[0]}")
            return f"{key} is not an option of the model; {where}: give {option}={path}({close[0]}={value!r})"
    return None


def _is_real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def class_problem(options: dict) -> str | None:
    """The line for an option of ``OPTION_CLASSES`` given as anything but its class (a dict of its fields, a
    string), or None."""
    for key, (cls, path, none) in OPTION_CLASSES.items():
        if key not in options or isinstance(options[key], cls) or (options[key] is None and none):
            continue
        value = options[key]
        fields = ", ".join(f"{k}={v!r}" for k, v in value.items()) if isinstance(value, dict) else "..."
        alternative = f", or {key}=None ({none})" if none else ""
        return f"{key}={value!r} is not {cls.__name__}(...): give {key}={path}({fields}){alternative}"
    return None


def option_problem(options: dict) -> str | None:
    """The line for an option the run's config would refuse (``kernels.loss_chunk_size`` >= 1, a LoRA rank on
    grouped-GEMM experts a multiple of 8, ``train.aux_loss_coef`` and ``train.z_loss_coef`` >= 0), or None. A
    negative chunk size runs no chunk at all (a cross-entropy of 0); a negative or NaN coefficient turns the
    balancing loss on in the model but off in its layers (which then record none)."""
    chunk = options.get("loss_chunk_size")
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        return (
            f"loss_chunk_size={chunk!r} must be an integer >= 1 (kernels.loss_chunk_size) or None (plain "
            "cross-entropy over full logits); try loss_chunk_size=4096"
        )
    lora, experts = options.get("lora"), options.get("experts")
    grouped = experts is None or experts.impl in ("grouped_mm", "grouped_mm_fp8")
    if lora is not None and lora.experts and grouped and lora.rank % 8:
        return (
            f"LoRASpec(rank={lora.rank}) with experts among its targets: the grouped GEMMs need the rank to be a "
            "multiple of 8 (16-byte rows in bf16, as peft.rank); try rank=8 or rank=16"
        )
    for key in ("aux_loss_coef", "z_loss_coef"):
        if key not in options or (key == "aux_loss_coef" and options[key] is None):
            continue
        value = options[key]
        if not (_is_real(value) and value >= 0):
            none = " or None (the checkpoint's, as transformers adds it)" if key == "aux_loss_coef" else ""
            return f"{key}={value!r} must be a finite number >= 0 (train.{key}){none}; try {key}=0.0"
    return None


def switch_problem(kernels: str, options: dict) -> str | None:
    """The line for a switch the model would not act on as asked, or None: an ``fp8`` recipe other than
    TransformerEngine's (``kernels.fp8``: kernels='torch' builds no FP8 module and ran in full precision),
    ``fp8_options`` without a recipe, a flag that is no bool (``force_balanced_routing="false"`` turned it on)."""
    fp8 = options.get("fp8", "none")
    if fp8 not in FP8_MODES:
        hint = choice_hint("fp8", fp8, FP8_MODES)
        return f"fp8={fp8!r} is not one of {', '.join(map(repr, FP8_MODES))}" + (f"; {hint}" if hint else "")
    if fp8 != "none" and kernels != "te":
        return (
            f"fp8={fp8!r} is TransformerEngine's FP8 recipe (kernels.fp8) and needs kernels='te' (got "
            f"kernels={kernels!r}, which has no FP8 modules); add kernels='te' or drop fp8"
        )
    if options.get("fp8_options") and fp8 == "none":
        given = options["fp8_options"]
        return f"fp8_options={given!r} apply to an FP8 recipe and fp8='none'; give fp8='current' or drop them"
    for key in ("force_balanced_routing", "packed_attention"):
        if key in options and not isinstance(options[key], bool):
            return f"{key}={options[key]!r} is not a bool; give {key}=True or {key}=False"
    return None


def torch_dtype(dtype) -> torch.dtype:
    """A torch dtype given as itself or by its name in torch (``"bfloat16"``); a floating-point one."""
    value = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ConfigError(
            f"dtype={dtype!r} is not a floating-point torch dtype; give torch.bfloat16 or 'bfloat16' (or float32)"
        )
    if value.itemsize == 1:  # FP8 formats store weights for FP8 GEMMs; no norm, softmax or embedding computes in one
        raise ConfigError(
            f"dtype={dtype!r} is a storage format, not a model dtype; give dtype=torch.bfloat16 (FP8 experts: "
            "experts=moe_tune.moe.experts.ExpertsOptions(impl='grouped_mm_fp8'), or quantized_base='fp8' with LoRA)"
        )
    return value

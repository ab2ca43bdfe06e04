"""Random initialisation in place, identical for every parallel layout and for the plain Hugging Face model.

Each tensor is drawn whole from a generator seeded by (seed, its name), on its device, and each rank keeps
only the rows it owns (its experts, its FSDP shard). Parameter names are the Hugging Face model's, so the
Transformers baseline of a benchmark initialised with this function starts from the same weights.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch

from moe_tune.distributed.shard import local

# (shape, generator, device) -> a float32 sample of that shape
Sampler = Callable[[tuple, torch.Generator, torch.device], torch.Tensor]


def _normal(shape: tuple, g: torch.Generator, device: torch.device) -> torch.Tensor:
    return torch.randn(shape, generator=g, device=device, dtype=torch.float32)


def generator_for(name: str, seed: int, device) -> torch.Generator:
    """The generator a tensor named ``name`` is drawn from: the same for every layout and every model class."""
    return torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


@torch.no_grad()
def draw_rows(
    model, name: str, t: torch.Tensor, seed: int, sample: Sampler, scale: float, num_experts: int | None
) -> None:
    """Fill this rank's rows of ``t`` (parameter ``name``) from ``scale * sample`` of the whole global tensor (all
    ``num_experts`` experts when known, unsharded): every layout gets the same values."""
    from moe_tune.models.hf_io import EXPERT_PARAM, expert_offsets, local_rows

    mine, first = local_rows(t)
    first += expert_offsets(model).get(name, 0)
    rows = mine.shape[0]
    global_rows = num_experts if EXPERT_PARAM.match(name) and num_experts else t.shape[0]
    shape = (max(global_rows, first + rows), *t.shape[1:])
    g = generator_for(name, seed, mine.device)
    mine.copy_(sample(shape, g, mine.device)[first : first + rows].mul_(scale))


@torch.no_grad()
def init_random(model, std: float | None = None, seed: int = 0, num_experts: int | None = None) -> None:
    """Normal(0, std) for matrices, ones for norm weights, zeros for biases and 1-D buffers. LoRA adapters are
    left to ``moe_tune.models.lora.init_lora``."""
    from moe_tune.lora import is_adapter
    from moe_tune.models.hf_io import named_tensors

    std = std if std is not None else float(getattr(model.config, "initializer_range", 0.02))
    for name, t in named_tensors(model):
        if not t.is_floating_point() or is_adapter(name):
            continue
        if t.dim() <= 1:
            local(t).fill_(1.0 if "norm" in name else 0.0)
            continue
        draw_rows(model, name, t, seed, _normal, std, num_experts)
    _init_quantized(model, std, seed, num_experts)


def _init_quantized(model, std: float, seed: int, num_experts: int | None) -> None:
    """A quantized base's experts (``peft.quantize_base``): drawn as the bf16 base's would be, then quantized."""
    from moe_tune.lora.experts import PROJECTIONS
    from moe_tune.moe.experts import GroupedExperts

    for name, module in model.named_modules():
        if isinstance(module, GroupedExperts) and module.quantized:
            lora = model.options.lora  # a quantized base is a LoRA run's
            dtype = lora.base_dtype or model.options.dtype
            device = next(module.gate_up_quantized.buffers()).device
            for proj in PROJECTIONS:
                w = torch.empty(module.base_shape(proj), dtype=dtype, device=device)
                draw_rows(model, f"{name}.{proj}_proj", w, seed, _normal, std, num_experts)
                module.fill_base_(proj, 0, w)

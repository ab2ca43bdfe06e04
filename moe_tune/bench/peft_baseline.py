"""The Transformers + PEFT baseline of LoRA runs (``peft=lora``): what a PEFT user runs, on moe_tune's workload.

``peft.get_peft_model`` with a ``LoraConfig`` of the run's rank, alpha and dropout on the same targets as
moe_tune's adapters: ``target_modules`` the same linears (``moe_tune.models.lora.lora_linears``), and for the
routed experts PEFT's parameter targeting of transformers' fused expert tensors (``target_parameters``
``<block>.experts.gate_up_proj`` / ``down_proj``), which adds ``B @ A`` to the whole stacked weight at every
forward. The base is loaded in bf16 (fp32 for train.precision=fp32) and frozen; PEFT keeps the adapters in fp32
(its ``autocast_adapter_dtype``). FSDP2 shards the decoder layers and the root after PEFT wrapped them.
"""

from __future__ import annotations

import torch
from torch import nn

from moe_tune.bench.plans import BNB_INSTALL, quantized_base_problem
from moe_tune.config import Config, ConfigError


def base_dtype(cfg: Config) -> torch.dtype:
    return torch.float32 if cfg.train.precision == "fp32" else torch.bfloat16


def lora_config(cfg: Config, hf_model: nn.Module, block_attr: str, bnb4: bool = False):
    """PEFT's LoraConfig for ``cfg.peft`` on the plain transformers model ``hf_model`` (``bnb4``: its linears in
    bitsandbytes 4-bit, ``quantize_linears_4bit``)."""
    from peft import LoraConfig

    from moe_tune.models.lora import lora_linears

    p = cfg.peft
    linears = sorted(lora_linears(hf_model, block_attr, tuple(p.target)))
    params = [f"{block_attr}.experts.gate_up_proj", f"{block_attr}.experts.down_proj"] if "experts" in p.target else []
    if params and p.dropout:
        raise ConfigError(
            f"peft.dropout={p.dropout}: PEFT's parameter adapters (the experts) refuse dropout, so the Transformers + "
            "PEFT baseline cannot run it; benchmark with peft.dropout=0"
        )
    if p.train_router:
        raise ConfigError("peft.train_router=true has no Transformers + PEFT baseline row; benchmark without it")
    if quantized_base_problem(cfg) and not bnb4:
        raise ConfigError(quantized_base_problem(cfg))
    return LoraConfig(
        r=p.rank,
        lora_alpha=p.alpha,
        lora_dropout=p.dropout,
        target_modules=linears or None,
        target_parameters=params or None,
    )


def quantize_linears_4bit(model: nn.Module, device) -> int:
    """What transformers' ``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
    bnb_4bit_compute_dtype=torch.bfloat16)`` makes of a loaded model: every ``nn.Linear`` but the lm_head becomes
    bitsandbytes' ``Linear4bit`` (NF4, blocks of 64), quantized from the loaded weights as it moves to ``device``.
    Fused 3-D expert tensors are no ``nn.Linear`` and stay as they are (benchmarks/bnb_fused_experts.py shows
    transformers doing the same). Returns how many weights were quantized."""
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise ConfigError(f"the bnb4 baseline row needs bitsandbytes: {BNB_INSTALL}") from None
    quantized = 0
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear or f"{parent_name}.{name}".endswith("lm_head"):
                continue
            layer = bnb.nn.Linear4bit(
                child.in_features,
                child.out_features,
                bias=child.bias is not None,
                compute_dtype=torch.bfloat16,
                quant_type="nf4",
            )
            layer.weight = bnb.nn.Params4bit(child.weight.data.to("cpu"), requires_grad=False, quant_type="nf4")
            if child.bias is not None:
                layer.bias = nn.Parameter(child.bias.data, requires_grad=False)
            setattr(parent, name, layer.to(device))
            quantized += child.weight.numel()
    return quantized


def apply_peft(hf_model: nn.Module, cfg: Config, block_attr: str, bnb4: bool = False) -> nn.Module:
    """The PEFT model (base frozen, adapters trainable) around a materialised, loaded transformers model, its
    adapters starting where moe_tune's do (A drawn by name as ``init_lora`` draws it, B zero): both rows train
    the same model from the same point."""
    try:
        from peft import get_peft_model
    except ImportError:
        raise ConfigError(
            "peft=lora's Transformers + PEFT baseline needs peft: pip install 'moe_tune[bench]'"
        ) from None
    model = get_peft_model(hf_model, lora_config(cfg, hf_model, block_attr, bnb4))
    _init_like_moe_tune(model, cfg.train.seed)
    return model


@torch.no_grad()
def _init_like_moe_tune(model: nn.Module, seed: int) -> None:
    from moe_tune.models.lora import initial_A
    from moe_tune.models.peft_export import EXPERT_TARGETS, peft_tensors

    params = dict(model.named_parameters())
    r = model.peft_config["default"].r
    for name, module in model.get_base_model().named_modules():
        if name.endswith(".experts") and hasattr(module, "get_base_layer"):  # PEFT's parameter wrappers
            experts = module.get_base_layer()
            for proj in EXPERT_TARGETS:
                weight = getattr(experts, f"{proj}_proj")  # [E, out, in], or GPT-OSS's transposed [E, in, out]
                n_in = weight.shape[1] if getattr(experts, "is_transposed", False) else weight.shape[2]
                ours = f"{name}.lora.{proj}_A"
                _copy(params, *peft_tensors(ours, initial_A(ours, (weight.shape[0], r, n_in), seed)))
        elif hasattr(module, "lora_A") and hasattr(module, "in_features") and ".experts" not in name:
            ours = f"{name}.lora.A"
            _copy(params, *peft_tensors(ours, initial_A(ours, (r, module.in_features), seed)))


def _copy(params: dict, key: str, value: torch.Tensor) -> None:
    target = params[key.replace(".weight", ".default.weight")]
    target.copy_(value.to(target.device, target.dtype))


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a transformers model, PEFT-wrapped or not."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return inner.model.layers

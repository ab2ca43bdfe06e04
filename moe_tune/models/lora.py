"""LoRA on a built model: which linears ``peft.target`` names, freezing the base, initialising and merging the
adapters. (The adapters themselves are ``moe_tune.lora``'s; the experts' are built by the MoE layers.)"""

from __future__ import annotations

import math

import torch
from torch import nn

from moe_tune.config import ConfigError
from moe_tune.distributed.shard import local
from moe_tune.lora import LINEAR_GROUPS, TARGET_GROUPS, LoRASpec, apply_linear_adapters, is_adapter
from moe_tune.moe.experts import GroupedExperts
from moe_tune.moe.layer import MoE


def _is_linear(module: nn.Module) -> bool:
    # nn.Linear and TransformerEngine's Linear alike: a 2-D weight with in/out features.
    return hasattr(module, "in_features") and hasattr(module, "out_features") and hasattr(module, "weight")


def linear_groups(hf: nn.Module, block_attr: str) -> dict[str, dict[str, nn.Module]]:
    """Every decoder layer's linears by ``LINEAR_GROUPS`` word, keyed by their names in the model. "mlp": the
    MLP block's linears but the router and the shared expert's gate (Qwen2-MoE's sigmoid gate)."""
    groups: dict[str, dict[str, nn.Module]] = {g: {} for g in LINEAR_GROUPS}
    for i, layer in enumerate(hf.model.layers):
        prefix = f"model.layers.{i}"
        for name, m in layer.self_attn.named_modules():
            if _is_linear(m):
                groups["attention"][f"{prefix}.self_attn.{name}"] = m
        block = getattr(layer, block_attr)
        skip = set()
        if isinstance(block, MoE):
            skip = {block.spec.router_attr, block.spec.shared_gate_attr, "experts"}
        for name, m in block.named_modules():
            if _is_linear(m) and name.split(".")[0] not in skip:
                groups["mlp"][f"{prefix}.{block_attr}.{name}"] = m
    return groups


def _gates(hf: nn.Module) -> list[str]:
    """The MoE layers' routers and shared experts' gates, by name: linears that take no adapter."""
    moes = [(n, m.spec) for n, m in hf.named_modules() if isinstance(m, MoE)]
    return [f"{n}.{a}" for n, spec in moes for a in (spec.router_attr, spec.shared_gate_attr) if a is not None]


def _outside_layers(name: str, module: nn.Module) -> bool:
    """A linear or an embedding of the model that no decoder layer holds (``lm_head``, ``model.embed_tokens``)."""
    return not name.startswith("model.layers.") and (_is_linear(module) or isinstance(module, nn.Embedding))


def lora_linears(hf: nn.Module, block_attr: str, targets: tuple[str, ...]) -> dict[str, nn.Module]:
    """The linears ``targets`` name: group words, or the end of a linear's dotted name (``q_proj``)."""
    groups = linear_groups(hf, block_attr)
    every = {n: m for g in groups.values() for n, m in g.items()}
    chosen: dict[str, nn.Module] = {}
    for t in targets:
        if t in groups and not groups[t]:  # a word that adapts nothing would be silently ignored
            raise ConfigError(
                f"peft.target names {t}, but this {hf.config.model_type} model has no such linear (no dense MLP "
                f"or shared expert); drop it from peft.target, e.g. peft.target=[attention,experts]"
            )
        if t in groups:
            chosen.update(groups[t])
        elif t != "experts":
            hits = {n: m for n, m in every.items() if n == t or n.endswith("." + t)}
            if not hits and any(g.endswith("." + t) for g in _gates(hf)):
                raise ConfigError(
                    f"peft.target names {t!r}, a router or a shared expert's gate: gates take no adapter here "
                    f"(peft.train_router=true trains the routers whole); drop {t!r} from peft.target"
                )
            outside = [n for n, m in hf.named_modules() if _outside_layers(n, m) and (n == t or n.endswith("." + t))]
            if not hits and outside:
                where = "" if outside[0] == t else f" ({outside[0]})"
                raise ConfigError(
                    f"peft.target names {t!r}{where}, which is outside the decoder layers: adapters go on "
                    f"their linears only, and the embeddings and head stay frozen under peft=lora; drop {t!r} from "
                    "peft.target (peft=none trains every weight)"
                )
            if not hits:
                names = sorted({n.split(".layers.")[1].split(".", 1)[1] for n in every})
                raise ConfigError(
                    f"peft.target names {t!r}, which is no linear of this model; give words of "
                    f"{', '.join(TARGET_GROUPS)} or linear names such as {', '.join(names[:8])}"
                )
            chosen.update(hits)
    return chosen


def apply_lora(hf: nn.Module, block_attr: str, spec: LoRASpec, dtype: torch.dtype) -> None:
    """Adapters on the targeted linears (the experts' were built with the MoE layers); then only adapters (and
    the routers, with ``train_router``) train. Frozen weights are stored in ``spec.base_dtype``: no gradient, no
    optimizer state and no fp32 master copy for them. The routers keep their dtype (DeepSeek-V3's fp32 island) unless
    the base is held wider: a bf16 model on an fp32 base (``build.from_checkpoint`` of a ``train.precision=bf16``
    run) holds its frozen routers as the base's files do, as PEFT and the merged export read them."""
    if spec.experts and not any(isinstance(m, MoE) for m in hf.modules()):
        raise ConfigError("peft.target names experts, but this model has no MoE layer")
    apply_linear_adapters(lora_linears(hf, block_attr, spec.targets), spec, dtype)
    routers = {id(p) for m in hf.modules() if isinstance(m, MoE) for p in m.router.parameters()}
    for name, p in hf.named_parameters():
        trainable = is_adapter(name) or (spec.train_router and id(p) in routers)
        p.requires_grad_(trainable)
        keep = trainable or spec.base_dtype is None or not p.is_floating_point()
        if not keep and id(p) in routers:
            keep = spec.base_dtype.itemsize <= p.dtype.itemsize
        if not keep and p.dtype == dtype:
            p.data = p.data.to(spec.base_dtype)


def has_lora(model: nn.Module) -> bool:
    return any(is_adapter(n) for n, _ in model.named_parameters())


def _uniform(shape: tuple, g: torch.Generator, device: torch.device) -> torch.Tensor:
    return torch.rand(shape, generator=g, device=device, dtype=torch.float32) * 2 - 1


def initial_A(name: str, shape: tuple, seed: int, device="cpu") -> torch.Tensor:
    """The whole initial A of adapter ``name`` (all experts): what ``init_lora`` gives every layout its rows of."""
    from moe_tune.models.init import generator_for

    return _uniform(shape, generator_for(name, seed, device), device) / math.sqrt(shape[-1])


@torch.no_grad()
def init_lora(model: nn.Module, seed: int = 0) -> None:
    """A uniform in +-1/sqrt(fan_in), as PEFT (Kaiming-uniform, a = sqrt(5)), B zero: training starts from the
    base model. Drawn by name like ``init_random``: the same values at every parallel layout."""
    from moe_tune.models.init import draw_rows

    for name, t in model.named_parameters():
        if not is_adapter(name):
            continue
        if name.endswith("B"):
            local(t).zero_()
            continue
        draw_rows(model, name, t, seed, _uniform, 1.0 / math.sqrt(t.shape[-1]), model.num_experts)


@torch.no_grad()
def merge_lora(model: nn.Module) -> None:
    """Fold every adapter into its base weight and remove it (one process, unsharded tensors): the model is
    then the plain fine-tuned model, for a full export (``moe-tune-export --merge``). Experts held quantized
    (``quantized_base``) with adapters are refused before anything is merged: they hold no weight to merge into."""
    held = {n: m for n, m in model.named_modules() if isinstance(m, GroupedExperts) and m.quantized and m.lora}
    if held:
        name, experts = next(iter(held.items()))
        more = f" (and {len(held) - 1} more)" if len(held) > 1 else ""
        raise ConfigError(
            f"merge_lora: the experts of {name}{more} are held quantized "
            f"(quantized_base={experts.options.quantized_base}) with adapters, so there is no weight to merge "
            "into: save_pretrained writes the adapters, which PEFT's merge_and_unload merges onto the source's "
            "weights, or build the model without quantized_base to merge here"
        )
    for module in list(model.modules()):
        lora = getattr(module, "lora", None)
        if lora is None:
            continue
        if isinstance(module, GroupedExperts):
            for proj in ("gate_up", "down"):
                weight = getattr(module, f"{proj}_proj")
                delta = lora.delta_weight(proj)  # [e, out, in]
                if module.spec.layout != "out_in":
                    delta = delta.transpose(-2, -1)
                weight.copy_((weight.float() + delta).to(weight.dtype))
        else:
            module.weight.copy_((module.weight.float() + lora.delta_weight()).to(module.weight.dtype))
        module.lora = None  # its forward hook adds nothing from now on

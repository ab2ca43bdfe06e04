"""``kernels=te``: TransformerEngine for the dense parts of every layer. The only importer of transformer_engine.

What changes (parameter names stay Hugging Face's, so loading and export are untouched):
  - every RMSNorm -> ``te.pytorch.RMSNorm`` (fused kernel; fp32 statistics inside);
  - attention projections and dense/shared MLP linears (``nn.Linear`` inside decoder layers, not the router,
    not ``lm_head``) -> ``te.pytorch.Linear``: these are the GEMMs FP8 applies to;
  - attention -> ``te.pytorch.DotProductAttention`` (causal, GQA, sliding window) registered as a transformers
    attention function. A call it cannot express (an explicit mask, e.g. packed sequences with a block mask)
    falls back to SDPA, logged once per reason; GPT-OSS's attention sinks keep eager attention.
Experts stay on grouped_mm (TE's GroupedLinear loops over experts: 28 TFLOP/s against 582 for
``torch._grouped_mm`` on an H200); the router, the norms' statistics and the loss stay in higher precision.

``kernels.fp8``: ``current`` (per-tensor current scaling) or ``delayed`` (amax history) wraps the forward in
TE's fp8 autocast; ``mxfp8`` needs Blackwell and is refused before this module is reached.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger("moe_tune")
ATTN_NAME = "moe_tune_te"
_warned: set[str] = set()


def _te():
    import transformer_engine.pytorch as te

    return te


def _is_rmsnorm(module: nn.Module) -> bool:
    return type(module).__name__.endswith("RMSNorm") and hasattr(module, "weight") and module.weight.dim() == 1


def _te_module(child: nn.Module, router_ids: set[int]) -> nn.Module | None:
    """The TE replacement of ``child`` (same parameter names, loaded weights copied), or None to keep it."""
    te = _te()
    device = child.weight.device if hasattr(child, "weight") else torch.device("meta")
    if _is_rmsnorm(child):
        eps = getattr(child, "variance_epsilon", getattr(child, "eps", 1e-6))
        new = te.RMSNorm(child.weight.shape[0], eps=eps, params_dtype=child.weight.dtype, device=device)
    elif isinstance(child, nn.Linear) and id(child) not in router_ids:
        new = te.Linear(
            child.in_features,
            child.out_features,
            bias=child.bias is not None,
            params_dtype=child.weight.dtype,
            device=device,
        )
    else:
        return None
    if device.type != "meta":
        new.load_state_dict(child.state_dict())
    return new


def _swap(root: nn.Module, router_ids: set[int]) -> None:
    for parent in list(root.modules()):
        for name, child in list(parent.named_children()):
            new = _te_module(child, router_ids)
            if new is not None:
                setattr(parent, name, new)


def _fallback(reason: str, *args, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if reason not in _warned:
        _warned.add(reason)
        log.info("kernels=te: %s; this call uses SDPA", reason)
    return sdpa_attention_forward(*args, **kwargs)


def te_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers attention function: q/k/v arrive [B, heads, S, head_dim]; returns ([B, S, heads, head_dim], None)."""
    if attention_mask is not None:
        return _fallback(
            "an explicit attention mask", module, query, key, value, attention_mask, dropout, scaling, **kwargs
        )
    if query.shape[-1] != value.shape[-1]:
        return _fallback(
            "different q/k and v head sizes", module, query, key, value, attention_mask, dropout, scaling, **kwargs
        )
    dpa = getattr(module, "_te_dpa", None)
    if dpa is None:
        window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
        dpa = _te().DotProductAttention(
            num_attention_heads=query.shape[1],
            kv_channels=query.shape[-1],
            num_gqa_groups=key.shape[1],
            attention_dropout=dropout,
            qkv_format="bshd",
            attn_mask_type="causal",
            softmax_scale=scaling,
            window_size=(window - 1, 0) if window else None,
        )
        module._te_dpa = dpa  # not a submodule: no parameters, and state dicts stay Hugging Face's
    q, k, v = (t.transpose(1, 2).contiguous() for t in (query, key, value))
    out = dpa(q, k, v)  # [B, S, heads * head_dim]
    return out.view(q.shape[0], q.shape[1], q.shape[2], -1), None


def apply_te(model, fp8: str = "none", experts: str = "grouped_mm") -> None:
    from transformers import AttentionInterface

    router_ids = {id(m.router) for m in model.moe_layers()}
    for layer in model.layers:
        _swap(layer, router_ids)
    final_norm = _te_module(model.model.norm, router_ids) if hasattr(model.model, "norm") else None
    if final_norm is not None:
        model.model.norm = final_norm
    if model.config._attn_implementation == "sdpa":
        AttentionInterface.register(ATTN_NAME, te_attention_forward)
        model.config._attn_implementation = ATTN_NAME
    else:
        log.info("kernels=te: %s attention kept (%s)", model.config._attn_implementation, model.config.model_type)
    if fp8 != "none":
        _wrap_fp8(model, fp8)


def _wrap_fp8(model, fp8: str) -> None:
    """Run every decoder layer under TE's fp8 autocast; the router (F.linear), norms and loss are not TE
    GEMMs, so they stay in bf16/fp32."""
    from transformer_engine.common import recipe

    r = recipe.Float8CurrentScaling() if fp8 == "current" else recipe.DelayedScaling()
    te = _te()
    autocast = getattr(te, "autocast", None) or te.fp8_autocast
    for layer in model.layers:
        inner = layer.forward

        def forward(*args, _inner=inner, **kwargs):
            kw = {"recipe": r} if autocast is not te.fp8_autocast else {"fp8_recipe": r}
            with autocast(enabled=True, **kw):
                return _inner(*args, **kwargs)

        layer.forward = forward

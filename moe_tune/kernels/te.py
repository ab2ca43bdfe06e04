"""``kernels=te``: TransformerEngine for the dense parts of every layer. The only importer of transformer_engine.

What changes (parameter names stay Hugging Face's, so loading and export are untouched):
  - every RMSNorm -> ``te.pytorch.RMSNorm`` (fused kernel; fp32 statistics inside);
  - attention projections and dense/shared MLP linears (``nn.Linear`` inside decoder layers, not the router,
    not ``lm_head``) -> ``te.pytorch.Linear``: these are the GEMMs FP8 applies to;
  - attention -> ``te.pytorch.DotProductAttention`` (causal, GQA, sliding window) registered as a transformers
    attention function; packed rows arrive as ``cu_seq_lens_q`` and run in TE's ``thd`` layout. A call it
    cannot express (v head size unlike q's, attention dropout) falls back to SDPA with the same causal, window
    and per-sequence masking, logged once per reason; GPT-OSS's attention sinks keep eager attention.
Experts stay on grouped_mm (TE's GroupedLinear loops over experts, where ``torch._grouped_mm`` runs them as one
grouped GEMM); the router, the norms' statistics and the loss stay in higher precision.

``kernels.fp8``: ``current`` (per-tensor current scaling), ``delayed`` (amax history) or ``blockwise`` (a scale
per 128 values of activations and gradients, per 128 x 128 block of weights, E4M3 throughout, as DeepSeek-V3
trained) wraps the forward in TE's fp8 autocast; ``mxfp8`` needs Blackwell and is refused before this module is
reached.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from moe_tune.kernels.attention import packed_sdpa

log = logging.getLogger("moe_tune")
ATTN_NAME = "moe_tune_te"
_warned: set[str] = set()


def _te():
    import transformer_engine.pytorch as te

    return te


def _is_rmsnorm(module: nn.Module) -> bool:
    return type(module).__name__.endswith("RMSNorm") and hasattr(module, "weight") and module.weight.dim() == 1


def _fp8_shape_ok(linear: nn.Linear, fp8_dim_multiple: int = 16) -> bool:
    # TE's FP8 GEMMs need both dims to be multiples of 16 (Qwen2-MoE's 1-wide shared_expert_gate is not); block
    # scaling, of its block length (128).
    return linear.in_features % fp8_dim_multiple == 0 and linear.out_features % fp8_dim_multiple == 0


def _te_module(child: nn.Module, router_ids: set[int], fp8_dim_multiple: int = 16) -> nn.Module | None:
    """The TE replacement of ``child`` (same parameter names, loaded weights copied), or None to keep it."""
    te = _te()
    device = child.weight.device if hasattr(child, "weight") else torch.device("meta")
    if _is_rmsnorm(child):
        eps = getattr(child, "variance_epsilon", getattr(child, "eps", 1e-6))
        new = te.RMSNorm(child.weight.shape[0], eps=eps, dtype=child.weight.dtype, device=device)
    elif isinstance(child, nn.Linear) and id(child) not in router_ids and _fp8_shape_ok(child, fp8_dim_multiple):
        new = te.Linear(
            child.in_features,
            child.out_features,
            bias=child.bias is not None,
            params_dtype=child.weight.dtype,
            device=str(device),  # TE compares with the string "meta" to defer its initialisation
        )
    else:
        return None
    if device.type != "meta":
        with torch.no_grad():
            for name, p in child.named_parameters():
                getattr(new, name).copy_(p)
    return new


def _swap(root: nn.Module, router_ids: set[int], fp8_dim_multiple: int = 16) -> None:
    for parent in list(root.modules()):
        for name, child in list(parent.named_children()):
            new = _te_module(child, router_ids, fp8_dim_multiple)
            if new is not None:
                setattr(parent, name, new)


def _log_once(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        log.info("kernels=te: %s; those calls use SDPA", reason)


def _dpa(module, query, key, window, scale):
    """The layer's TE DotProductAttention, made at its first call. Held outside ``_modules``: it has no
    parameters, and the model's state dict stays Hugging Face's (no ``_extra_state`` keys)."""
    dpa = module.__dict__.get("_te_dpa")
    if dpa is None:
        dpa = _te().DotProductAttention(
            num_attention_heads=query.shape[1],
            kv_channels=query.shape[-1],
            num_gqa_groups=key.shape[1],
            attention_dropout=0.0,
            qkv_format="bshd",
            attn_mask_type="causal",
            window_size=(window - 1, 0) if window else None,
            softmax_scale=scale,  # fixed per layer (transformers' module.scaling)
        )
        module.__dict__["_te_dpa"] = dpa
    return dpa


def te_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers attention function: q/k/v arrive [B, heads, S, head_dim] (kv heads not repeated); returns
    ([B, S, heads, head_dim], None). Packed rows arrive with ``cu_seq_lens_q`` (MoECausalLM passes it) and
    run in TE's ``thd`` layout with a per-sequence causal mask."""
    B, H, S, d = query.shape
    cu = kwargs.get("cu_seq_lens_q")
    # No mask ever arrives here (transformers builds none for a registered function; MoECausalLM refuses one).
    reason = None
    if d != value.shape[-1]:
        reason = "different q/k and v head sizes"
    elif dropout:
        reason = "attention dropout"
    window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
    if reason is not None:
        _log_once(reason)
        return packed_sdpa(query, key, value, scaling, cu, window, dropout), None
    dpa = _dpa(module, query, key, window, scaling if scaling is not None else d**-0.5)
    if cu is None:
        q, k, v = (t.transpose(1, 2).contiguous() for t in (query, key, value))  # bshd
        out = dpa(q, k, v, qkv_format="bshd", attn_mask_type="causal")
    else:
        q, k, v = (t.transpose(1, 2).reshape(B * S, t.shape[1], d) for t in (query, key, value))  # thd
        out = dpa(
            q,
            k,
            v,
            qkv_format="thd",
            attn_mask_type="padding_causal",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            max_seqlen_q=kwargs.get("max_length_q", S),
            max_seqlen_kv=kwargs.get("max_length_k", S),
        )
    return out.reshape(B, S, H, d), None


def apply_te(model, keep: set[int], fp8: str = "none", fp8_options: dict | None = None) -> bool:
    """Swap TE modules into a Hugging Face causal LM (``model.model.layers``, ``model.model.norm``, ``model.config``)
    in place, leaving the modules whose ids are in ``keep`` (the routers) torch; with ``fp8`` != none, run each
    decoder layer under TE's autocast with the recipe ``fp8_recipe(fp8, **fp8_options)``. Returns whether TE
    took the attention (then the model must pass packed rows' boundaries as cu_seq_lens_q/k)."""
    from transformers import AttentionInterface

    decoder = model.model
    fp8_dim_multiple = 128 if fp8 == "blockwise" else 16
    for layer in decoder.layers:
        _swap(layer, keep, fp8_dim_multiple)
    if fp8 != "none":
        _log_kept_out_of_fp8(decoder.layers, keep, fp8, fp8_dim_multiple)
    final_norm = _te_module(decoder.norm, keep) if hasattr(decoder, "norm") else None
    if final_norm is not None:
        decoder.norm = final_norm
    if fp8 != "none":
        _wrap_fp8(decoder.layers, fp8_recipe(fp8, **(fp8_options or {})))
    if model.config._attn_implementation != "sdpa":
        log.info("kernels=te: %s attention kept (%s)", model.config._attn_implementation, model.config.model_type)
        return False
    AttentionInterface.register(ATTN_NAME, te_attention_forward)
    model.config._attn_implementation = ATTN_NAME
    return True


def _log_kept_out_of_fp8(layers: nn.Module, keep: set[int], fp8: str, multiple: int) -> None:
    kept = [
        n
        for n, m in layers.named_modules()
        if isinstance(m, nn.Linear) and id(m) not in keep and not _fp8_shape_ok(m, multiple)
    ]
    if kept:
        log.info(
            "kernels.fp8=%s: %d linears stay torch (outside FP8): a dimension is not a multiple of %d (%s%s)",
            fp8,
            len(kept),
            multiple,
            ", ".join(kept[:3]),
            ", ..." if len(kept) > 3 else "",
        )


def fp8_recipe(
    fp8: str,
    amax_history_len: int = 1024,
    amax_compute_algo: str = "max",
    fprop_split_accumulator: bool = False,
    backward: str = "fp8",
    fp8_format: str | None = None,
):
    """TE's recipe for ``kernels.fp8``. The amax options apply to ``delayed`` only, the split accumulator to
    ``current`` only, ``backward`` to all but ``delayed`` (config validation refuses them elsewhere). With
    ``backward="fp8"`` TE's own default stands (its NVTE_BACKWARD_OVERRIDE variable included), and with
    ``fp8_format=None`` the recipe's own format."""
    from transformer_engine.common import recipe

    override = {} if backward == "fp8" else {"backward_override": backward}
    if fp8_format is not None:
        override["fp8_format"] = getattr(recipe.Format, fp8_format.upper())
    if fp8 == "current":
        split = recipe.MMParams(use_split_accumulator=fprop_split_accumulator)
        return recipe.Float8CurrentScaling(fp8_gemm_fprop=split, **override)
    if fp8 == "delayed":
        return recipe.DelayedScaling(amax_history_len=amax_history_len, amax_compute_algo=amax_compute_algo, **override)
    if fp8 == "blockwise":
        return recipe.Float8BlockScaling(**override)
    if fp8 == "mxfp8":
        return recipe.MXFP8BlockScaling(**override)
    raise ValueError(f"kernels.fp8={fp8!r} is not one of current, delayed, blockwise, mxfp8")


def _wrap_fp8(layers: nn.Module, recipe) -> None:
    """Run every decoder layer under TE's fp8 autocast with ``recipe`` (entered by a forward pre-hook, left by a
    forward hook that runs even when the forward raises): its te.Linear GEMMs run in FP8; the router (F.linear),
    the experts (grouped_mm), norms' statistics, attention's softmax and the loss stay in bf16/fp32."""
    autocast = _FP8Autocast(_te(), recipe)
    for layer in layers:
        layer.register_forward_pre_hook(autocast.enter)
        layer.register_forward_hook(autocast.exit, always_call=True)


class _FP8Autocast:
    """TE's autocast context around a module's forward, as hooks; a stack, for forwards that nest (activation
    checkpointing recomputes a layer's forward inside the backward)."""

    def __init__(self, te, recipe):
        self.te, self.recipe, self.active = te, recipe, []

    def enter(self, module, args) -> None:
        context = self.te.autocast(enabled=True, recipe=self.recipe)
        context.__enter__()
        self.active.append(context)

    def exit(self, module, args, output) -> None:
        self.active.pop().__exit__(None, None, None)

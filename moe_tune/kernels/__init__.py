"""Kernel sets by name: which kernels run the dense parts of each layer, the experts and the loss.

``torch`` (default): SDPA attention, grouped_mm experts, chunked linear cross-entropy.
``te``: TransformerEngine norms/attention/linears; only ``moe_tune.kernels.te`` imports transformer_engine.
"""

from __future__ import annotations

import functools

from moe_tune.config import ConfigError


def apply_kernels(
    model,
    name: str = "torch",
    experts: str = "grouped_mm",
    fused_loss: bool = True,
    loss_chunk_size: int = 4096,
    fp8: str = "none",
    fp8_options: dict | None = None,
) -> None:
    """``fp8_options``: keyword arguments of ``moe_tune.kernels.te.fp8_recipe`` (``KernelsConfig.fp8_options()``)."""
    if name not in ("torch", "te"):
        raise ConfigError(f"kernels={name!r} is not one of torch, te")
    for moe in model.moe_layers():
        moe.experts.impl = "loop" if experts == "loop" else "grouped_mm"
    if fused_loss:
        from moe_tune.kernels.loss import linear_cross_entropy

        model.loss_fn = functools.partial(linear_cross_entropy, chunk_size=loss_chunk_size)
    else:
        model.loss_fn = None
    if name == "te":
        from moe_tune.kernels.te import apply_te

        apply_te(model, fp8=fp8, experts=experts, fp8_options=fp8_options)

"""Activation checkpointing per decoder layer, without renaming parameters.

Modes (``parallel.activation_checkpointing``):
  ``none``: keep every activation.
  ``full``: recompute each whole decoder layer in backward. Only the layer's input is kept. The recompute
      repeats the layer's token dispatch (its all-to-alls and their one host sync) and the expert GEMMs. An NF4
      base's projections there keep the recompute's dequantized experts for the input gradient (one layer's at a
      time) rather than dequantize them a third time.
  ``selective``: recompute only each layer's attention (q/k/v/o projections, rotary, the attention kernel's
      saved state). The MoE half keeps its activations: routed rows, expert GEMM outputs and the gathered
      results, so backward runs no extra all-to-all, host sync or expert GEMM. Attention is the cheap part to
      recompute at fine-tuning sequence lengths; the experts are the expensive one.

The checkpointed module's ``forward`` is wrapped in place (non-reentrant ``torch.utils.checkpoint``) rather
than wrapping the module in another, so parameter names stay Hugging Face's for loading and export, and
FSDP2 (applied afterwards) hooks the same module.
"""

from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint

from moe_tune.config import AC_MODES, ConfigError
from moe_tune.moe.quantized_base import FrozenNF4Projection


def checkpoint_forward_(module: nn.Module, inner=None) -> None:
    """Make ``module`` recompute its forward (or ``inner``, a stand-in for it such as its compiled form) in
    backward instead of keeping its activations. The wrapper keeps the function it checkpoints as
    ``forward.checkpointed``."""
    inner = inner or module.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    forward.checkpointed = inner
    module.forward = forward


def _attention(layer: nn.Module) -> nn.Module:
    for name in ("self_attn", "attention", "attn"):
        if isinstance(getattr(layer, name, None), nn.Module):
            return getattr(layer, name)
    raise ConfigError(
        f"parallel.activation_checkpointing=selective found no attention module in {type(layer).__name__}; "
        f"use parallel.activation_checkpointing=full"
    )


def apply_ac(model, mode: str) -> None:
    if mode not in AC_MODES:
        raise ConfigError(f"parallel.activation_checkpointing={mode!r} is not one of {', '.join(AC_MODES)}")
    if mode == "none":
        return
    for layer in model.layers:
        checkpoint_forward_(layer if mode == "full" else _attention(layer))
        if mode == "full":  # NF4 base projections: the recompute's dequantized experts serve the input gradient
            for module in layer.modules():
                if isinstance(module, FrozenNF4Projection):
                    module.recomputed = True

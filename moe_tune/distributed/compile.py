"""``kernels.compile=true``: torch.compile each decoder layer, not the whole model.

Per-layer compilation keeps compile time to one layer's graph (all layers share it) and leaves the
expert-parallel dispatch's host sync and collectives as graph breaks between compiled regions instead of
forcing them into one whole-model graph. ``nn.Module.compile`` compiles in place, so parameter names and
FSDP2's hooks on the layer are unchanged. Applied after activation checkpointing, before FSDP2.

A layer under full activation checkpointing has its own forward compiled *inside* the checkpoint, not the
checkpoint: dynamo traces a checkpoint as one higher-order op and runs it eagerly as a whole when its body has a
graph break (the MoE dispatch has them), which left full AC + compile at eager speed (benchmarks/README.md, "LoRA
on the full Qwen3-30B-A3B").
"""

from __future__ import annotations

import torch

from moe_tune.distributed.activation_checkpoint import checkpoint_forward_


def apply_compile(model, enabled: bool, dynamic: bool | None = None) -> None:
    """``dynamic``: torch.compile's. The default (None) lets the regions after the dispatch's host sync, whose
    row counts change every step, compile once with symbolic sizes; with False they recompile for each new
    count until torch's recompile limit and then run eagerly (seen in the compiled rows' logs on 2 x H200, EP=2:
    "hit config.recompile_limit (8)" for the frames after the dispatch's sync)."""
    if not enabled:
        return
    for layer in model.layers:
        inner = getattr(layer.forward, "checkpointed", None)
        if inner is not None:
            checkpoint_forward_(layer, torch.compile(inner, fullgraph=False, dynamic=dynamic))
        else:
            layer.compile(fullgraph=False, dynamic=dynamic)

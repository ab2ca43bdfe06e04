"""``kernels.compile=true``: torch.compile each decoder layer, not the whole model.

Per-layer compilation keeps compile time to one layer's graph (all layers share it) and leaves the
expert-parallel dispatch's host sync and collectives as graph breaks between compiled regions instead of
forcing them into one whole-model graph. ``nn.Module.compile`` compiles in place, so parameter names and
FSDP2's hooks on the layer are unchanged. Applied after activation checkpointing, before FSDP2.
"""

from __future__ import annotations


def apply_compile(model, enabled: bool) -> None:
    if not enabled:
        return
    for layer in model.layers:
        layer.compile(fullgraph=False, dynamic=False)

"""Per-forward routing statistics, gathered in one object instead of left on the MoE layers for whoever reads next.

Each MoE layer is given its ``LayerStats`` slot at construction (``MoEStatsCollector.layer``) and puts its
forward's rows per expert and balancing losses there; the model's forward takes them all at its end
(``MoEStatsCollector.take``) as one ``MoEStats`` value in its output. A reader holds the statistics of the forward
it ran, whatever runs after it (an evaluation after a training step, say). One slot object per layer, written by
attribute: under torch.compile a shared dict or list would be guarded on its contents, which grow from layer to
layer, and every layer would compile anew.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MoEStats:
    """One forward's statistics, one entry per MoE layer in model order: ``layer_idx`` (its decoder layer),
    ``counts_E`` (rows per global expert, detached) and the balancing losses a training forward computes (with
    graph; empty when none was)."""

    layer_idx: tuple[int | None, ...] = ()
    counts_E: tuple[torch.Tensor, ...] = ()
    aux_loss: tuple[torch.Tensor, ...] = ()
    z_loss: tuple[torch.Tensor, ...] = ()

    def counts_LE(self, layers: Collection[int] | None = None) -> torch.Tensor:
        """Rows per expert of the MoE layers in decoder layers ``layers`` (default: every one), stacked [L, E]."""
        return torch.stack([c for i, c in zip(self.layer_idx, self.counts_E) if layers is None or i in layers])


class LayerStats:
    """One MoE layer's slot: what its forward put, until the collector takes it."""

    def __init__(self, layer_idx: int | None):
        self.layer_idx = layer_idx
        self.clear()

    def put(self, counts_E: torch.Tensor, aux_loss: torch.Tensor | None, z_loss: torch.Tensor | None) -> None:
        self.counts_E, self.aux_loss, self.z_loss = counts_E, aux_loss, z_loss

    def clear(self) -> None:
        self.counts_E: torch.Tensor | None = None
        self.aux_loss: torch.Tensor | None = None
        self.z_loss: torch.Tensor | None = None


class MoEStatsCollector:
    """The slots of one model's MoE layers, in the order they were made (the model's): ``start`` before a
    forward, ``take`` after it."""

    def __init__(self):
        self._slots: list[LayerStats] = []

    def layer(self, layer_idx: int | None = None) -> LayerStats:
        """A new slot, for the MoE layer of decoder layer ``layer_idx``."""
        slot = LayerStats(layer_idx)
        self._slots.append(slot)
        return slot

    def start(self) -> None:
        """Forget what earlier forwards put (a recomputation under activation checkpointing puts again)."""
        for slot in self._slots:
            slot.clear()

    def take(self) -> MoEStats:
        """What the layers put since ``start``, as one value; the slots are cleared."""
        ran = [slot for slot in self._slots if slot.counts_E is not None]
        stats = MoEStats(
            layer_idx=tuple(slot.layer_idx for slot in ran),
            counts_E=tuple(slot.counts_E for slot in ran),
            aux_loss=tuple(slot.aux_loss for slot in ran if slot.aux_loss is not None),
            z_loss=tuple(slot.z_loss for slot in ran if slot.z_loss is not None),
        )
        self.start()
        return stats

"""The MoE layer that takes the place of every family's Hugging Face sparse-MoE block."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moe_tune.lora import LoRASpec
from moe_tune.moe.dispatch import Dispatcher
from moe_tune.moe.dispatch.local import LocalDispatcher
from moe_tune.moe.experts import ExpertsOptions, ExpertsSpec, GroupedExperts
from moe_tune.moe.overlap import routed_in_halves
from moe_tune.moe.router import Router, RouterSpec, expert_counts, load_balancing_loss, z_loss
from moe_tune.moe.stats import LayerStats


@dataclass(frozen=True)
class MoESpec:
    router: RouterSpec
    experts: ExpertsSpec
    # Attribute names kept from Hugging Face so that parameter names match its state dict.
    router_attr: str = "gate"
    # Names of the Hugging Face block's shared-expert modules we adopt as they are (dense MLPs).
    shared_attr: str | None = None
    # Qwen2-MoE: a Linear(D, 1) whose sigmoid scales the shared expert's output.
    shared_gate_attr: str | None = None
    # GPT-OSS's block returns (hidden, router_scores).
    returns_tuple: bool = False
    # Mixtral's router_jitter_noise: in training, the block's input is scaled by U(1 - j, 1 + j) per element.
    input_jitter: float = 0.0
    # Which balancing losses forward computes (run options: the model adds only those with a coefficient, and
    # computing an unused one still costs kernels on every layer).
    aux_loss: bool = True
    z_loss: bool = False


class MoE(nn.Module):
    """Router, dispatcher and this rank's experts. The dispatcher decides which experts are local (all of them
    without expert parallelism); ``shared`` are the Hugging Face block's shared-expert modules, adopted as is.
    ``lora``: adapters on the routed experts (given when LoRA targets them). ``layer_idx``: the decoder layer it
    sits in (DeepSeek-V3's and GLM-4-MoE's leading layers are dense), which names its load in the logs.
    ``stats``: where each forward puts its rows per expert and balancing losses (``moe_tune.moe.stats``; the
    model's forward takes them); None: computed for routing only, kept nowhere."""

    def __init__(
        self,
        spec: MoESpec,
        shared: dict[str, nn.Module] | None = None,
        dispatcher: Dispatcher | None = None,
        experts: ExpertsOptions | None = None,
        lora: LoRASpec | None = None,
        layer_idx: int | None = None,
        stats: LayerStats | None = None,
    ):
        super().__init__()
        self.spec, self.layer_idx, self.stats = spec, layer_idx, stats
        setattr(self, spec.router_attr, Router(spec.router, spec.experts.dim))
        self.dispatcher = dispatcher or LocalDispatcher(spec.router.num_experts, spec.router.top_k)
        d = self.dispatcher
        self.experts = GroupedExperts(
            spec.experts, experts or ExpertsOptions(), d.first_local_expert, d.num_local_experts, lora
        )
        for name, module in (shared or {}).items():
            setattr(self, name, module)

    @property
    def router(self) -> Router:
        # Read _modules directly: for GPT-OSS the attribute is itself called "router" and getattr would recurse.
        return self._modules[self.spec.router_attr]

    def forward(self, x: torch.Tensor):
        shape = x.shape
        if self.training and self.spec.input_jitter > 0:
            j = self.spec.input_jitter
            x = x * torch.empty_like(x).uniform_(1.0 - j, 1.0 + j)
        x_TD = x.reshape(-1, shape[-1])
        weights_TK, ids_TK, scores_TE, logits_TE = self.router(x_TD)
        counts_E = expert_counts(ids_TK, self.spec.router.num_experts)
        if self.stats is not None:  # rows per expert (detached); balancing losses (with graph) in training
            aux = z = None
            if self.training and self.spec.aux_loss:
                aux = load_balancing_loss(scores_TE, counts_E, self.spec.router.top_k)
            if self.training and self.spec.z_loss:
                z = z_loss(logits_TE)
            self.stats.put(counts_E.detach(), aux, z)

        shared = self._shared if self.spec.shared_attr is not None else None
        if self.dispatcher.overlap:  # comm.overlap: two halves, communication beside compute (moe/overlap.py)
            out_TD, shared_TD = routed_in_halves(
                self.dispatcher, self.experts, x_TD, ids_TK, weights_TK, counts_E, shared
            )
        else:
            x_RD, counts_e, ctx = self.dispatcher.dispatch(x_TD, ids_TK, counts_E)
            y_RD = self.experts(x_RD, counts_e)
            out_TD = self.dispatcher.combine(y_RD, weights_TK, ctx)
            shared_TD = shared(x_TD) if shared is not None else None
        if shared_TD is not None:
            out_TD = out_TD + shared_TD
        out = out_TD.view(shape).to(x.dtype)
        if self.spec.returns_tuple:
            return out, weights_TK
        return out

    def _shared(self, x_TD: torch.Tensor) -> torch.Tensor:
        shared_TD = getattr(self, self.spec.shared_attr)(x_TD)
        if self.spec.shared_gate_attr is not None:
            shared_TD = F.sigmoid(getattr(self, self.spec.shared_gate_attr)(x_TD)) * shared_TD
        return shared_TD

"""``MoECausalLM``: a Hugging Face decoder with moe_tune's MoE layers in place of its sparse blocks.

The model is built once, on the meta device; the loader then reads tensors straight into place. Parameter
names equal the Hugging Face model's (``model.layers.3.mlp.experts.gate_up_proj``...), so the state dict
maps onto transformers v5 without renaming.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moe_tune.models.families import Family, get_family
from moe_tune.moe.layer import MoE


@dataclass
class CausalLMOutput:
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None
    z_loss: torch.Tensor | None = None
    ce_loss: torch.Tensor | None = None


def _torch_dtype(dtype) -> torch.dtype:
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


class MoECausalLM(nn.Module):
    def __init__(self, hf_model: nn.Module, family: Family, source_dir: str | None = None):
        super().__init__()
        # Hold the Hugging Face submodules directly so state-dict keys stay "model.*" and "lm_head.*".
        self.model = hf_model.model
        self.lm_head = hf_model.lm_head
        self.config = hf_model.config
        self.family = family
        self.source_dir = source_dir
        self.aux_loss_coef = float(getattr(self.config, "router_aux_loss_coef", 0.0) or 0.0)
        self.z_loss_coef = 0.0
        self.loss_fn = None  # set by kernels: a (hidden_ND, weight_VD, labels_N) -> sum loss function
        # Set by kernels=te: its attention needs packed rows' sequence boundaries (transformers builds no mask
        # for a registered attention function), passed as transformers' cu_seq_lens_q/k keyword arguments.
        self.wants_cu_seqlens = False
        self._hf_class = type(hf_model)

    # -- structure -------------------------------------------------------------------------------
    @property
    def layers(self) -> nn.ModuleList:
        return self.model.layers

    def moe_layers(self) -> list[MoE]:
        # Cached: the MoE layers are fixed once built (parallelisms wrap them in place), and the trainer asks
        # for them on every micro-batch.
        if getattr(self, "_moe_layers", None) is None:
            self._moe_layers = [m for m in self.modules() if isinstance(m, MoE)]
        return self._moe_layers

    @property
    def num_experts(self) -> int:
        moes = self.moe_layers()
        return moes[0].spec.router.num_experts if moes else 0

    # -- forward ---------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        loss_normalizer: torch.Tensor | float | None = None,
        return_logits: bool | None = None,
    ) -> CausalLMOutput:
        """Like transformers: ``labels`` are aligned with ``input_ids`` and shifted here; -100 is ignored.
        The loss is the token sum divided by ``loss_normalizer`` (default: this batch's label tokens)."""
        extra = {}
        if self.wants_cu_seqlens:
            if attention_mask is not None:
                # transformers gives a registered attention function no mask at all: refuse, never ignore it.
                raise ValueError(
                    "kernels=te takes no attention_mask (transformers passes none to its attention): give rows "
                    "without padding, or packed rows with position_ids restarting at 0 at each sequence"
                )
            if position_ids is not None:
                extra = packed_sequence_kwargs(position_ids.expand(input_ids.shape))
        hidden = self.model(
            input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, use_cache=False, **extra
        ).last_hidden_state
        out = CausalLMOutput()
        want_logits = labels is None if return_logits is None else return_logits
        if want_logits:
            out.logits = self.lm_head(hidden)
        if labels is None:
            return out
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
        flat_labels = shift_labels.reshape(-1)
        if loss_normalizer is None:
            loss_normalizer = (flat_labels != -100).sum().clamp(min=1)
        h = hidden.reshape(-1, hidden.shape[-1])
        if self.loss_fn is not None:
            ce_sum = self.loss_fn(h, self.lm_head.weight, flat_labels)
        else:
            logits = out.logits if out.logits is not None else self.lm_head(h)
            # fp32 island: cross-entropy on fp32 logits, as transformers does.
            ce_sum = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]).float(), flat_labels, ignore_index=-100, reduction="sum"
            )
        out.ce_loss = ce_sum / loss_normalizer
        out.loss = out.ce_loss
        if self.training:
            moes = self.moe_layers()
            if moes and self.aux_loss_coef:
                out.aux_loss = torch.stack([m.aux_loss for m in moes]).mean()
                out.loss = out.loss + self.aux_loss_coef * out.aux_loss
            if moes and self.z_loss_coef:
                out.z_loss = torch.stack([m.z_loss for m in moes]).mean()
                out.loss = out.loss + self.z_loss_coef * out.z_loss
        return out

    # -- Hugging Face I/O ------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str, dtype=torch.float32, kernels: str = "torch", device=None) -> MoECausalLM:
        from moe_tune.models.hf_io import load_pretrained

        return load_pretrained(path, dtype=_torch_dtype(dtype), kernels=kernels, device=device)

    def save_pretrained(self, out_dir: str) -> None:
        from moe_tune.models.hf_io import save_pretrained

        save_pretrained(self, out_dir)


def packed_sequence_kwargs(position_ids: torch.Tensor) -> dict:
    """transformers' packed-sequence keywords for rows whose positions restart at 0 at every sequence start:
    ``cu_seq_lens_q/k`` (int32 offsets of each sequence in the flattened batch, every row start included) and
    ``max_length_q/k`` (the row length, an upper bound, so no host sync for it). One host sync (nonzero)."""
    B, S = position_ids.shape
    start = position_ids == 0
    start[:, 0] = True  # a row always starts a sequence
    starts = torch.nonzero(start.reshape(-1)).flatten()  # host sync: the number of sequences
    cu = torch.cat([starts, starts.new_tensor([B * S])]).to(torch.int32)
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": S, "max_length_k": S}


def build_model(config, dtype: torch.dtype = torch.float32, attn_implementation: str | None = None) -> MoECausalLM:
    """The Hugging Face model for ``config`` on the meta device, its sparse blocks replaced by ``MoE``.

    ``attn_implementation``: None takes the family's (``sdpa``, or ``eager`` where transformers has no SDPA path).
    """
    from transformers import AutoModelForCausalLM

    family = get_family(config.model_type, getattr(config, "architectures", None))
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation=attn_implementation or family.attn_implementation
        )
        for layer in hf.model.layers:
            block = getattr(layer, family.block_attr)
            if not hasattr(block, "experts"):
                continue  # a dense layer (DeepSeek-V3's first_k_dense_replace, Qwen's mlp_only_layers)
            spec = family.moe_spec(config)
            shared = {}
            for name in (spec.shared_attr, spec.shared_gate_attr):
                if name is not None:
                    shared[name] = getattr(block, name)
            moe = MoE(spec, shared)
            _match_dtypes(moe, block, dtype)
            setattr(layer, family.block_attr, moe)
    return MoECausalLM(hf, family)


def _match_dtypes(moe: MoE, block: nn.Module, dtype: torch.dtype) -> None:
    """Give each MoE tensor the dtype transformers gives the tensor of the same name in its block: the model
    dtype, except the fp32 islands it keeps whatever the dtype (DeepSeek-V3 and GLM-4-MoE create the router
    weight and ``e_score_correction_bias`` in fp32, so bf16 rounding never decides which experts are chosen)."""
    theirs = {**dict(block.named_parameters()), **dict(block.named_buffers())}
    for name, t in [*moe.named_parameters(), *moe.named_buffers()]:
        ref = theirs.get(name)
        t.data = t.data.to(ref.dtype if ref is not None else dtype)


def materialize(model: MoECausalLM, device: torch.device | str) -> None:
    """Allocate meta parameters on ``device`` (uninitialised) and rebuild computed buffers (rotary tables)."""
    model.to_empty(device=device)
    with torch.device(device):
        for parent in model.modules():
            for name, child in list(parent.named_children()):
                if hasattr(child, "inv_freq") and hasattr(child, "config"):
                    fresh = type(child)(child.config)
                    setattr(parent, name, fresh.to(device))
    if getattr(model.config, "tie_word_embeddings", False):
        model.lm_head.weight = model.model.embed_tokens.weight

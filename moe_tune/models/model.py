"""``MoECausalLM``: a Hugging Face decoder with moe_tune's MoE layers in place of its sparse blocks.

The model is built once, on the meta device; the loader then reads tensors straight into place. Parameter
names equal the Hugging Face model's (``model.layers.3.mlp.experts.gate_up_proj``...), so the state dict
maps onto transformers v5 without renaming.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from moe_tune.config import ConfigError
from moe_tune.config.constraints import choice_hint
from moe_tune.config.schema import EXPERT_KERNELS, QUANTIZED_GEMMS
from moe_tune.config.validate import blocked_dims_problem, grouped_mm_dims_problem, quantized_base_fix
from moe_tune.lora import LoRASpec
from moe_tune.models.export import remove_stale_weights, write_checkpoint
from moe_tune.models.families import Family, as_stored, get_family
from moe_tune.moe.dispatch import Dispatcher
from moe_tune.moe.experts import ExpertsOptions
from moe_tune.moe.layer import MoE
from moe_tune.moe.quantized_base import PROJECTION_CLASSES
from moe_tune.moe.stats import MoEStats, MoEStatsCollector

# The activation dtypes torch's grouped GEMM (and the FP8 one's unquantized operands) take.
GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
GROUPED_MM_NAMES = "float32, bfloat16 or float16"


@dataclass(frozen=True)
class ModelOptions:
    """How a run builds the model: its options, given at construction (the family's maths is its spec)."""

    dtype: torch.dtype = torch.float32
    # "torch": transformers' attention (SDPA or eager); "te": TransformerEngine norms, attention and linears.
    kernels: str = "torch"
    fp8: str = "none"
    # Keyword arguments of ``moe_tune.kernels.te.fp8_recipe`` (``KernelsConfig.fp8_options()``).
    fp8_options: dict = field(default_factory=dict)
    experts: ExpertsOptions = field(default_factory=ExpertsOptions)
    # Chunked linear cross-entropy over this many rows at a time (never the full logits); None: full logits.
    loss_chunk_size: int | None = 4096
    # Balancing losses' coefficients; None: the checkpoint's, as transformers' forward adds it
    # (checkpoint_aux_loss_coef: router_aux_loss_coef where output_router_logits is set, else 0).
    aux_loss_coef: float | None = None
    z_loss_coef: float = 0.0
    force_balanced_routing: bool = False
    # None: the family's (``sdpa``, or ``eager`` where transformers has no SDPA path).
    attn_implementation: str | None = None
    # Rows hold several packed sequences (position ids restart at 0): attention runs per sequence through a
    # variable-length kernel (``moe_tune.kernels.attention``; kernels=te: TE's thd layout) instead of a dense
    # block mask; rows of one sequence run SDPA's causal kernel. The model then takes no attention_mask, and
    # transformers builds none (no host sync to look for packed sequences). Applies where the family's attention
    # is SDPA, or eager (GPT-OSS: its own eager attention with a per-sequence mask). Training builds set it whether
    # or not the data is packed.
    packed_attention: bool = False
    # LoRA adapters (``peft=lora``), the base frozen; None: every weight trains.
    lora: LoRASpec | None = None


@dataclass
class CausalLMOutput:
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None
    z_loss: torch.Tensor | None = None
    ce_loss: torch.Tensor | None = None
    # The forward's routing statistics (rows per expert, each layer's balancing losses), one value per forward.
    moe_stats: MoEStats | None = None


class MoECausalLM(nn.Module):
    """Built by ``build_model``. ``packed_attention``: the attention takes packed rows' sequence boundaries as
    transformers' cu_seq_lens_q/k keyword arguments (TransformerEngine's: transformers builds no mask for a
    registered attention function). ``moe_stats``: the collector its MoE layers were given their slots by; each
    forward's output carries what they put."""

    def __init__(
        self,
        hf_model: nn.Module,
        family: Family,
        options: ModelOptions,
        source_dir: str | None = None,
        packed_attention: bool = False,
        moe_stats: MoEStatsCollector | None = None,
    ):
        super().__init__()
        # Hold the Hugging Face submodules directly so state-dict keys stay "model.*" and "lm_head.*".
        self.model = hf_model.model
        self.lm_head = hf_model.lm_head
        self.config = hf_model.config
        self.family, self.options, self.source_dir = family, options, source_dir
        self.packed_attention = packed_attention
        aux = options.aux_loss_coef
        self.aux_loss_coef = checkpoint_aux_loss_coef(self.config) if aux is None else aux
        self.z_loss_coef = options.z_loss_coef
        self.loss_fn: Callable | None = None  # (hidden_ND, weight_VD, labels_N) -> summed token losses
        if options.loss_chunk_size is not None:
            from moe_tune.kernels.loss import linear_cross_entropy

            self.loss_fn = functools.partial(linear_cross_entropy, chunk_size=options.loss_chunk_size)
        self._hf_class = type(hf_model)
        self._moe_layers = [m for m in self.modules() if isinstance(m, MoE)]
        self._moe_stats = moe_stats or MoEStatsCollector()

    # -- structure -------------------------------------------------------------------------------
    @property
    def layers(self) -> nn.ModuleList:
        return self.model.layers

    def moe_layers(self) -> list[MoE]:
        # Found once at construction: parallelisms wrap the layers in place, and the trainer asks on every step.
        return self._moe_layers

    @property
    def num_experts(self) -> int:
        moes = self.moe_layers()
        return moes[0].spec.router.num_experts if moes else 0

    # -- forward ---------------------------------------------------------------------------------
    def _packed_kwargs(self, input_ids, position_ids, attention_mask) -> dict:
        """The sequence boundaries of packed rows for an attention that takes them (none otherwise)."""
        if not self.packed_attention:
            return {}
        if attention_mask is not None:
            # transformers gives a registered attention function no mask at all: refuse, never ignore it.
            raise ValueError(
                "this model attends over packed rows (kernels=te, or packed_attention) and takes no "
                "attention_mask (transformers passes none to its attention): give rows without padding, or "
                "packed rows with position_ids restarting at 0 at each sequence"
            )
        if position_ids is None:
            return {}
        return packed_sequence_kwargs(position_ids.expand(input_ids.shape))

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
        The loss is the token sum divided by ``loss_normalizer`` (default: this batch's label tokens).
        ``return_logits`` None: logits whenever no backward can follow (no labels, eval mode or torch.no_grad())
        or the loss is plain cross-entropy (``loss_chunk_size=None``); a training forward with labels otherwise
        leaves them None, as the fused loss never builds them (the memory saving)."""
        extra = self._packed_kwargs(input_ids, position_ids, attention_mask)
        self._moe_stats.start()
        hidden = self.model(
            input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, use_cache=False, **extra
        ).last_hidden_state
        out = CausalLMOutput(moe_stats=self._moe_stats.take())
        training = self.training and torch.is_grad_enabled()
        # Without a fused loss (loss_chunk_size=None) the loss builds the full logits: returned, as transformers.
        built_anyway = labels is None or not training or self.loss_fn is None
        want_logits = built_anyway if return_logits is None else return_logits
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
        if self.training and self.moe_layers():
            stats = out.moe_stats
            if self.aux_loss_coef:
                out.aux_loss = torch.stack(stats.aux_loss).mean()
                out.loss = out.loss + self.aux_loss_coef * out.aux_loss
            if self.z_loss_coef:
                out.z_loss = torch.stack(stats.z_loss).mean()
                out.loss = out.loss + self.z_loss_coef * out.z_loss
        return out

    # -- Hugging Face I/O (loading: ``moe_tune.build.from_pretrained``) -----------------------------
    def save_pretrained(self, out_dir: str, max_shard_bytes: int = 4 << 30) -> None:
        """Single-process export (no sharding): Hugging Face keys, shapes and dtypes as in the source checkpoint.
        With LoRA adapters, as PEFT's ``save_pretrained``: the adapters alone, a PEFT adapter directory for
        ``PeftModel.from_pretrained`` onto the source (``moe_tune.models.lora.merge_lora(model)`` first: the merged
        model instead)."""
        from moe_tune.models.lora import has_lora
        from moe_tune.models.peft_export import ADAPTER_FILES, check_not_base, write_adapter

        if has_lora(self):
            check_not_base(out_dir, self.source_dir)
            write_adapter(self, out_dir)
            remove_stale_weights(out_dir, written=set())  # an earlier full save's, which moe_tune would read
            return
        write_checkpoint(self, out_dir, max_shard_bytes=max_shard_bytes)
        for name in ADAPTER_FILES:  # transformers loads a directory holding adapter_config.json as base + adapters
            if os.path.exists(path := os.path.join(out_dir, name)):
                os.remove(path)


def packed_sequence_kwargs(position_ids: torch.Tensor) -> dict:
    """transformers' packed-sequence keywords for rows whose positions restart at 0 at every sequence start:
    ``cu_seq_lens_q/k`` (int32 offsets of each sequence in the flattened batch, every row start included) and
    ``max_length_q/k``, the longest sequence: varlen kernels size their grids by it (the row length instead
    launched a block per 128 rows of it for every short sequence, nearly all idle)."""
    B, S = position_ids.shape
    start = position_ids == 0
    start[:, 0] = True  # a row always starts a sequence
    starts = torch.nonzero(start.reshape(-1)).flatten()  # host sync: the number of sequences
    cu = torch.cat([starts, starts.new_tensor([B * S])]).to(torch.int32)
    longest = int((cu[1:] - cu[:-1]).max())  # host sync, right after the one above: the device is idle already
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


def build_model(
    config,
    options: ModelOptions | None = None,
    make_dispatcher: Callable[[int, int], Dispatcher] | None = None,
    source_dir: str | None = None,
) -> MoECausalLM:
    """The Hugging Face model for ``config`` on the meta device, its sparse blocks replaced by ``MoE`` and, with
    ``options.kernels="te"``, TransformerEngine modules swapped in, and with ``options.lora`` the adapters. ``make_dispatcher(num_experts, top_k)`` gives
    each MoE layer its dispatcher, which decides the experts this rank holds (default: all, locally).
    ``source_dir``: the checkpoint the weights come from (its dtypes and side files are kept on export)."""
    from transformers import AutoModelForCausalLM

    options = options or ModelOptions()
    moe_stats = MoEStatsCollector()
    family = get_family(config.model_type, getattr(config, "architectures", None))
    if source_dir is not None and family.disk_renames:
        from moe_tune.models.hf_io import CheckpointReader

        family = as_stored(family, CheckpointReader(source_dir).weight_map)
    check_experts_options(options, family.moe_spec(config).experts)
    attn = options.attn_implementation or family.attn_implementation
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config, dtype=options.dtype, attn_implementation=attn)
        for i, layer in enumerate(hf.model.layers):
            block = getattr(layer, family.block_attr)
            if not hasattr(block, "experts"):
                continue  # a dense layer (DeepSeek-V3's first_k_dense_replace, Qwen's mlp_only_layers)
            spec = _run_spec(family.moe_spec(config), options, hf)
            shared = {n: getattr(block, n) for n in (spec.shared_attr, spec.shared_gate_attr) if n is not None}
            r = spec.router
            dispatcher = make_dispatcher(r.num_experts, r.top_k) if make_dispatcher else None
            expert_lora = options.lora if options.lora is not None and options.lora.experts else None
            moe = MoE(spec, shared, dispatcher, options.experts, expert_lora, layer_idx=i, stats=moe_stats.layer(i))
            _match_dtypes(moe, block, options.dtype)
            setattr(layer, family.block_attr, moe)
        packed_attention = False
        if options.kernels == "te":
            from moe_tune.kernels.te import apply_te

            routers = {id(m.router) for m in hf.modules() if isinstance(m, MoE)}
            packed_attention = apply_te(hf, routers, options.fp8, options.fp8_options)
        # TE takes SDPA's attention only: an eager family (GPT-OSS) keeps its own under kernels=te too
        if not packed_attention and options.packed_attention and hf.config._attn_implementation in ("sdpa", "eager"):
            packed_attention = _use_packed_attention(hf)
        if options.lora is not None:
            from moe_tune.models.lora import apply_lora

            apply_lora(hf, family.block_attr, options.lora, options.dtype)
    return MoECausalLM(hf, family, options, source_dir, packed_attention, moe_stats)


def _check_choice(name: str, value, choices, siblings: dict, otherwise: str) -> None:
    if value not in choices:
        hint = choice_hint(name, value, choices, siblings)
        raise ConfigError(f"{name}={value!r} is not one of {', '.join(map(repr, choices))}; {hint or otherwise}")


def check_experts_options(options: ModelOptions, experts) -> None:
    """``options.experts`` (the Python API's spelling of ``kernels.experts``, ``kernels.quantized_base`` and
    ``peft.quantize_base``) before anything is built: choices there are, and a quantized storage under LoRA (the
    quantized experts are frozen) for the model's routed ``experts`` (an ``ExpertsSpec``) dims. One ConfigError
    line naming the values and the fix."""
    o = options.experts
    dtype = o.compute_dtype or options.dtype  # the GEMMs' dtype: the activations'
    name = str(dtype).removeprefix("torch.")
    loop = "experts=moe_tune.moe.experts.ExpertsOptions(impl='loop')"
    if o.impl != "loop" and dtype not in GROUPED_MM_DTYPES:
        raise ConfigError(f"impl={o.impl!r}: the grouped GEMMs take {GROUPED_MM_NAMES}, not {name}; use {loop}")
    grouped = grouped_mm_dims_problem("impl='grouped_mm'", experts.dim, experts.hidden, name, dtype.itemsize, loop)
    _check_choice("impl", o.impl, EXPERT_KERNELS, {}, "pick one of those")
    _check_choice(
        "quantized_gemm", o.quantized_gemm, QUANTIZED_GEMMS, {"quantized_base": PROJECTION_CLASSES}, "pick one of those"
    )
    mode = o.quantized_base
    if mode is None:
        if o.impl == "grouped_mm" and grouped:
            raise ConfigError(grouped)
        return
    _check_choice(
        "quantized_base",
        mode,
        PROJECTION_CLASSES,
        {"quantized_gemm": QUANTIZED_GEMMS},
        "pick one of those, or None for experts that are parameters",
    )
    if options.lora is None:
        raise ConfigError(
            f"quantized_base={mode!r} holds the routed experts frozen, for LoRA, and lora is None (every weight "
            f"trains): add lora=LoRASpec(...), or drop quantized_base"
        )
    if o.impl == "grouped_mm_fp8":  # the quantized experts' GEMMs are their own: impl would be ignored
        raise ConfigError(
            f"impl='grouped_mm_fp8' quantizes trained expert weights at every step; with quantized_base={mode!r} the "
            "frozen experts are quantized once, at load, and their GEMMs read them as stored: drop impl (or give "
            "impl='grouped_mm')"
        )
    dim, hidden = experts.dim, experts.hidden
    # A fix that passes in turn: None's bf16 grouped GEMMs need their own alignment, else the loop of experts.
    loop_too = " with impl='loop'" if grouped and o.impl == "grouped_mm" else ""
    none, fp8_or_none = f"quantized_base=None{loop_too}", f"quantized_base='fp8' or None{loop_too}"
    fix = none if mode == "fp8" else quantized_base_fix(dim, hidden, fp8_or_none, none)
    problem = blocked_dims_problem(f"quantized_base={mode!r}", mode, dim, hidden, fix)
    if problem:
        raise ConfigError(problem)


def _use_packed_attention(hf: nn.Module) -> bool:
    """Attention that keeps packed sequences apart: the varlen kernel in place of SDPA; for an eager family
    (GPT-OSS) its own eager attention with a per-sequence mask (transformers' eager masks ignore the boundaries)."""
    import sys

    from transformers import AttentionInterface

    from moe_tune.kernels.attention import ATTN_NAME, packed_eager_forward, varlen_attention_forward

    config = hf.config
    name, forward = ATTN_NAME, varlen_attention_forward
    if config._attn_implementation == "eager":
        name = f"{ATTN_NAME}_eager_{config.model_type}"
        eager = sys.modules[type(hf).__module__].eager_attention_forward
        forward = functools.partial(packed_eager_forward, eager=eager)
    AttentionInterface.register(name, forward)
    config._attn_implementation = name
    return True


def checkpoint_aux_loss_coef(config) -> float:
    """The load-balancing loss's coefficient a checkpoint's config gives transformers' training forward: its
    ``router_aux_loss_coef`` where it outputs the router logits (``output_router_logits``), else none."""
    if not getattr(config, "output_router_logits", False):
        return 0.0
    return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)


def _run_spec(spec, options: ModelOptions, hf: nn.Module):
    """The family's MoE spec with this run's switches: forced balanced routing, which balancing losses to compute."""
    aux = checkpoint_aux_loss_coef(hf.config) if options.aux_loss_coef is None else options.aux_loss_coef
    router = dataclasses.replace(spec.router, force_balanced=options.force_balanced_routing)
    return dataclasses.replace(spec, router=router, aux_loss=aux > 0, z_loss=options.z_loss_coef > 0)


def _match_dtypes(moe: MoE, block: nn.Module, dtype: torch.dtype) -> None:
    """Give each MoE tensor the dtype transformers gives the tensor of the same name in its block: the model
    dtype, except the fp32 islands it keeps whatever the dtype (DeepSeek-V3 and GLM-4-MoE create the router
    weight and ``e_score_correction_bias`` in fp32, so bf16 rounding never decides which experts are chosen). A
    quantized base's buffers (``peft.quantize_base``) are transformers' own tensors of no name and keep their dtypes."""
    theirs = {**dict(block.named_parameters()), **dict(block.named_buffers())}
    for name, t in [*moe.named_parameters(), *moe.named_buffers()]:
        ref = theirs.get(name)
        if ref is None and "_quantized." in name:
            continue
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

"""Per-family specs: where the MoE block sits, how it routes, and how its experts are named on disk.

A family is data, not a fork of the model: everything else (attention, norms, embeddings) is the Hugging
Face model as published. ``build_moe_spec`` reads the routing semantics from the Hugging Face config so
they are computed exactly as transformers computes them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from moe_tune.config import ConfigError
from moe_tune.moe.experts import ExpertsSpec
from moe_tune.moe.layer import MoESpec
from moe_tune.moe.router import RouterSpec


@dataclass(frozen=True)
class Family:
    model_type: str
    moe_spec: Callable[[object], MoESpec]
    # Attribute of the decoder layer that holds the MoE block (in memory, transformers v5 names).
    block_attr: str = "mlp"
    # On disk, experts stored one tensor per expert: in-memory stacked name -> per-expert parts
    # concatenated along dim 0 (gate rows then up rows). None: stored stacked, as in memory (GPT-OSS).
    disk_experts: dict[str, tuple[str, ...]] | None = field(
        default_factory=lambda: {
            "gate_up_proj": ("gate_proj.weight", "up_proj.weight"),
            "down_proj": ("down_proj.weight",),
        }
    )
    # (in-memory fragment, on-disk fragment) renames, e.g. Mixtral's block_sparse_moe.
    disk_renames: tuple[tuple[str, str], ...] = ()
    # Attention kernel for the (unchanged) Hugging Face attention. GPT-OSS's attention sinks have no SDPA path
    # in transformers, so it runs eager attention as Hugging Face does.
    attn_implementation: str = "sdpa"


def _swiglu_hidden(c, key: str) -> int:
    """The routed experts' hidden size; refuses activations other than SwiGLU (silu) rather than run them wrong."""
    act = getattr(c, "hidden_act", "silu")
    if act not in ("silu", "swish"):  # transformers runs both names as SiLU
        raise ConfigError(
            f"{c.model_type}: hidden_act={act!r}, but moe_tune's experts compute SwiGLU only (silu(gate_proj) * "
            f"up_proj), so experts trained with {act!r} would run wrong; give a model with hidden_act='silu' (a "
            "preset: drop model.overrides.hidden_act)"
        )
    return getattr(c, key)


def _softmax_family(num_experts_key: str, hidden_key: str, norm: bool | None, shared: bool = False):
    def spec(c) -> MoESpec:
        E = getattr(c, num_experts_key)
        return MoESpec(
            # Mixtral only: multiplicative noise on the block's input in training (0 in published configs).
            input_jitter=float(getattr(c, "router_jitter_noise", 0.0) or 0.0),
            router=RouterSpec(
                num_experts=E,
                top_k=c.num_experts_per_tok,
                score="softmax",
                norm_topk_prob=bool(c.norm_topk_prob) if norm is None else norm,
            ),
            experts=ExpertsSpec(num_experts=E, dim=c.hidden_size, hidden=_swiglu_hidden(c, hidden_key)),
            shared_attr="shared_expert" if shared else None,
            shared_gate_attr="shared_expert_gate" if shared else None,
        )

    return spec


def _routing_groups(c, E: int) -> tuple[int, int]:
    """(n_group, topk_group) of a group-limited router, refused unless transformers' routing is defined for them:
    the experts split into n_group equal groups of at least two (a group scores by its two best experts), at most
    n_group groups kept, and enough experts in the kept groups for num_experts_per_tok (past them the choice is
    among -inf scores, an arbitrary tie)."""
    groups, kept, top_k = c.n_group, c.topk_group, c.num_experts_per_tok
    divisors = ", ".join(str(d) for d in range(1, E + 1) if E % d == 0 and (d == 1 or E // d >= 2))
    fix = f"set n_group to one of {divisors} (1: no group limit) and topk_group to at most n_group"
    for key, value in (("n_group", groups), ("topk_group", kept)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{c.model_type}: {key}={value!r} must be a whole number >= 1; {fix}")
    if E % groups or (groups > 1 and E // groups < 2):
        raise ConfigError(
            f"{c.model_type}: n_group={groups} does not split n_routed_experts={E} into equal groups of at least "
            f"2 experts; {fix}"
        )
    if kept > groups:
        raise ConfigError(f"{c.model_type}: topk_group={kept} is more than n_group={groups}; {fix}")
    if top_k > kept * (E // groups):
        raise ConfigError(
            f"{c.model_type}: num_experts_per_tok={top_k} is more than the {kept * (E // groups)} experts of the "
            f"topk_group={kept} groups kept (n_group={groups} of {E // groups} experts); raise topk_group or "
            f"lower num_experts_per_tok to at most {kept * (E // groups)}"
        )
    return groups, kept


def _sigmoid_family(c) -> MoESpec:
    E = c.n_routed_experts
    groups, kept = _routing_groups(c, E)
    return MoESpec(
        router=RouterSpec(
            num_experts=E,
            top_k=c.num_experts_per_tok,
            score="sigmoid",
            norm_topk_prob=bool(c.norm_topk_prob),
            routed_scaling_factor=float(c.routed_scaling_factor),
            num_groups=groups,
            topk_groups=kept,
            correction_bias=True,
        ),
        experts=ExpertsSpec(num_experts=E, dim=c.hidden_size, hidden=_swiglu_hidden(c, "moe_intermediate_size")),
        shared_attr="shared_experts",
    )


def _gpt_oss(c) -> MoESpec:
    E = c.num_local_experts
    return MoESpec(
        router=RouterSpec(num_experts=E, top_k=c.num_experts_per_tok, score="topk_softmax", bias=True),
        experts=ExpertsSpec(
            num_experts=E,
            dim=c.hidden_size,
            hidden=c.intermediate_size,
            layout="in_out",
            bias=True,
            activation="clamped_swiglu",
            swiglu_alpha=float(getattr(c, "swiglu_alpha", 1.702)),
            swiglu_limit=float(getattr(c, "swiglu_limit", 7.0)),
        ),
        router_attr="router",
        returns_tuple=True,
    )


FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family("qwen3_moe", _softmax_family("num_experts", "moe_intermediate_size", None)),
        Family("qwen2_moe", _softmax_family("num_experts", "moe_intermediate_size", None, shared=True)),
        Family(
            "mixtral",
            _softmax_family("num_local_experts", "intermediate_size", True),
            disk_experts={"gate_up_proj": ("w1.weight", "w3.weight"), "down_proj": ("w2.weight",)},
            disk_renames=((".mlp.", ".block_sparse_moe."),),
        ),
        Family("olmoe", _softmax_family("num_experts", "intermediate_size", None)),
        Family("deepseek_v3", _sigmoid_family),
        Family("glm4_moe", _sigmoid_family),
        Family("gpt_oss", _gpt_oss, disk_experts=None, attn_implementation="eager"),
    )
}


def get_family(model_type: str, architectures: list[str] | None = None) -> Family:
    if model_type not in FAMILIES:
        arch = f" ({', '.join(architectures)})" if architectures else ""
        raise ConfigError(
            f"model_type {model_type!r}{arch} is not a supported MoE family; supported families: "
            f"{', '.join(sorted(FAMILIES))}. Give a checkpoint of one of those"
        )
    return FAMILIES[model_type]


def as_stored(family: Family, keys: Iterable[str]) -> Family:
    """``family`` with only the on-disk renames a source's ``keys`` use: transformers v5's own layout
    (``save_pretrained(save_original_format=False)``) keeps the in-memory names (Mixtral's ``.mlp.``, not
    ``.block_sparse_moe.``), and loading and export then read and write those."""
    keys = list(keys)
    renames = tuple(r for r in family.disk_renames if any(r[1] in k for k in keys))
    return family if renames == family.disk_renames else replace(family, disk_renames=renames)


def _moe_spec(config):
    return get_family(config.model_type, getattr(config, "architectures", None)).moe_spec(config)


def num_experts(config) -> int:
    """Routed experts per MoE layer of a Hugging Face config (known before any model is built)."""
    return _moe_spec(config).router.num_experts


def expert_dims(config) -> tuple[int, int]:
    """(model dim, expert hidden dim) of the routed experts of a Hugging Face config."""
    experts = _moe_spec(config).experts
    return experts.dim, experts.hidden

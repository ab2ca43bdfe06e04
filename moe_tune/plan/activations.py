"""Activation bytes per token, measured: what autograd keeps for the backward of one decoder layer, found by running
the run's own layer code forward on the CPU, in the compute dtype, and adding up the storages it saves.

The model is the run's (its family, dims, LoRA and quantized base, moe_tune's MoE layer and attention path) with
two changes that leave bytes per token unchanged: fewer routed experts (only the router's [tokens, experts] tensors grow with
them: counted at the real number) and a small vocabulary (no layer sees it). A
model with dense layers (DeepSeek-V3's and GLM-4-MoE's leading ones, Qwen-MoE's ``mlp_only_layers`` or
``decoder_sparse_step``) keeps one, and is measured as dense and MoE layer.
The weights are zeros (the bytes saved depend on shapes alone, and drawing billions of
random values would take minutes). Parameters are not activations and are left out (FSDP2's gathered copies and cast experts are counted apart).

Eager kernels on the CPU: what a GPU's eager step saves, but for the attention kernel (the CPU's flash kernel
saves the same output and log-sum-exp) and compiled layers, which fuse the norms' fp32 copies and the expert
activation away (``moe_tune.plan.memory`` scales the measurement by a calibrated factor for kernels.compile).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moe_tune.models.source_check import EXPERT_COUNTS, dense_layers

# One row of this many tokens (never a routed-expert count measured, 8 or 16, nor a model dim).
TOKENS = 40


@dataclass(frozen=True)
class LayerBytes:
    """Saved bytes per token of one decoder layer: its attention module's (``attention``, recomputed under
    selective checkpointing) and the rest (norms, router, dispatch, experts, shared experts)."""

    attention: float
    rest: float
    routed: float = 0.0  # the part of ``rest`` in routed rows (top_k per token): what routing imbalance grows

    @property
    def total(self) -> float:
        return self.attention + self.rest


@dataclass(frozen=True)
class Activations:
    moe: LayerBytes
    dense: LayerBytes | None  # None: every layer is a MoE layer
    outside: float  # after the last layer: final norm and the loss's saved state, per token


def _reduced(hf_config, num_experts: int):
    d = hf_config.to_dict()
    key = next(k for k in EXPERT_COUNTS if d.get(k))
    d[key] = num_experts
    # Layer 0 dense where the model has dense layers, then one MoE layer, whichever keys made them dense.
    dense = int(bool(dense_layers(d)))
    if "first_k_dense_replace" in d:
        d["first_k_dense_replace"] = dense
    if "decoder_sparse_step" in d:
        d["decoder_sparse_step"] = 1
    if isinstance(d.get("mlp_only_layers"), list):
        d["mlp_only_layers"] = list(range(dense))
    layers = dense + 1
    d["num_hidden_layers"] = layers
    if isinstance(d.get("layer_types"), list):
        d["layer_types"] = d["layer_types"][:layers]
    d["vocab_size"] = 512
    for token in ("bos_token_id", "eos_token_id", "pad_token_id"):  # ids of the real vocabulary: none here
        d[token] = None
    d.pop("architectures", None)
    return type(hf_config).from_dict(d)


def _expert_counts(hf_config) -> tuple[int, int]:
    """(real, measured) routed expert counts: twice top_k and at least 8, a whole number of DeepSeek's groups."""
    d = hf_config.to_dict()
    real = next(int(d[k]) for k in EXPERT_COUNTS if d.get(k))
    top_k = int(d.get("num_experts_per_tok") or 2)
    groups = int(d.get("n_group") or 1)
    first = groups * math.ceil(max(2 * top_k, 8) / groups)
    return real, min(first, real)


def measure(hf_config, options) -> Activations:
    """Saved bytes per token of ``hf_config``'s layers built with ``options`` (a ``ModelOptions``)."""
    real, fewer = _expert_counts(hf_config)
    return _measure_once(_reduced(hf_config, fewer), options, fewer, real)


def _measure_once(hf_config, options, num_experts: int, real_experts: int) -> Activations:
    from moe_tune.models.model import build_model, materialize

    top_k = int(hf_config.to_dict().get("num_experts_per_tok") or 0)
    model = build_model(hf_config, options)
    materialize(model, "cpu")
    with torch.no_grad():  # zeros: what is saved depends on shapes only (tied router scores still pick top_k)
        for t in [*model.parameters(), *model.buffers()]:
            if t.is_floating_point():
                t.zero_()
        _fast_cpu_layout(model)
    model.train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    params |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    where: list = ["outside"]
    seen: set[int] = set()
    saved: dict = {}

    # The router's per-expert tensors ([tokens, experts] scores) grow with the experts: counted at the real number.
    scale = real_experts / num_experts

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        # Where the CPU has no flash kernel for a layer's attention (MLA's v head unlike its qk head) it saves the
        # [heads, S, S] scores or mask; a GPU's kernel saves none of them.
        square = t.dim() >= 2 and t.shape[-1] == t.shape[-2] == length[0]
        if key not in params and key not in seen and storage.nbytes() and not square:
            seen.add(key)
            per_expert = where[0][1:] == ("rest",) and t.dim() >= 2 and t.shape[-1] == num_experts
            nbytes = storage.nbytes() * (scale if per_expert else 1.0)
            saved[where[0]] = saved.get(where[0], 0) + nbytes
            if where[0][1:] == ("rest",) and t.dim() >= 1 and t.shape[0] == length[0] * top_k:
                routed = (where[0][0], "routed")
                saved[routed] = saved.get(routed, 0) + nbytes
        return t

    kinds = _attribute(model, where)
    length = [TOKENS]
    ids = torch.zeros(1, TOKENS, dtype=torch.long)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids, labels=ids)
    saved = {k: v / TOKENS for k, v in saved.items()}

    def layer(kind: str) -> LayerBytes | None:
        idx = [i for i, k in kinds.items() if k == kind]
        if not idx:
            return None
        i = idx[-1]
        return LayerBytes(saved.get((i, "attention"), 0), saved.get((i, "rest"), 0), saved.get((i, "routed"), 0))

    return Activations(layer("moe"), layer("dense"), saved.get("outside", 0))


_CACHE: dict[tuple[str, str], Activations] = {}


def measured(hf_config, options) -> Activations:
    """``measure``, once per model and options in a process (a search asks for the same layers many times)."""
    key = (hf_config.to_json_string(), repr(options))
    if key not in _CACHE:
        _CACHE[key] = measure(hf_config, options)
    return _CACHE[key]


def _attribute(model, where: list) -> dict[int, str]:
    """Hooks that keep ``where[0]`` naming the part running: (layer, "attention"), (layer, "rest") or "outside".
    Returns each layer's kind ("moe" or "dense")."""
    from moe_tune.moe.layer import MoE

    def enter(label):
        return lambda *_: where.__setitem__(0, label)

    kinds = {}
    for i, layer in enumerate(model.layers):
        kinds[i] = "moe" if any(isinstance(m, MoE) for m in layer.modules()) else "dense"
        layer.register_forward_pre_hook(enter((i, "rest")))
        layer.register_forward_hook(enter("outside"))
        attention = next(getattr(layer, n) for n in ("self_attn", "attention", "attn") if hasattr(layer, n))
        attention.register_forward_pre_hook(enter((i, "attention")))
        attention.register_forward_hook(enter((i, "rest")))
    return kinds


def _fast_cpu_layout(model) -> None:
    """Experts stored [e, in, out] (the "in_out" layout) as the transpose of a contiguous [e, out, in]: the CPU's
    bf16 grouped GEMM takes minutes on a contiguous [e, in, out] operand of GPT-OSS's size and a second on its
    transpose. Weights are parameters, never counted, so their memory layout changes nothing measured."""
    from moe_tune.moe.experts import GroupedExperts

    for m in model.modules():
        if isinstance(m, GroupedExperts) and m.spec.layout == "in_out":
            for p in m.parameters(recurse=False):
                if p.dim() == 3:
                    e, k, n = p.shape
                    p.data = torch.zeros(e, n, k, dtype=p.dtype).transpose(-2, -1)

"""Tiny random Hugging Face checkpoints for tests, built locally (no hub), and the error measure that compares
models.

Every MoE family: 2 layers, hidden 48, 8 experts of intermediate size 40 (gate/up 80 x 48), top-2, vocabulary
VOCAB. Every other size differs too (attention heads of 16 where the family takes a head_dim, so q_proj is 64 x 48;
OLMoE's q_proj is 48 x 48, its q_norm spanning the hidden size; dense MLPs 88, Qwen2-MoE's shared expert 56), so
that a transposed weight or a swapped dimension cannot pass a test (all multiples of 8: grouped GEMMs on a GPU take
them). DeepSeek-V3 and GLM-4-MoE have one leading dense
layer, four expert groups of which 2 (GLM: 3) are kept, and a nonzero ``e_score_correction_bias``; GPT-OSS keeps
its attention sinks, sliding window and YaRN rotary; Qwen2-MoE its gated shared expert; OLMoE clips q/k/v.
``llama`` is a dense model (an architecture moe_tune refuses). Every weight is random (``randomize_``).

In tests, the ``tiny_checkpoint`` fixture (tests/conftest.py) saves one into the test's temporary directory.
"""

from __future__ import annotations

import os

import torch
from transformers import AutoConfig, AutoModelForCausalLM

FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3", "gpt_oss", "glm4_moe")
DENSE = ("llama",)
VOCAB = 128
# LoRA in fp32, ``rel_err`` of the logits: PEFT's adapters on transformers and the merged model (each W + B @ A
# rounded to fp32 once) against moe_tune's adapters. Measured on every tiny family, trained routers included: PEFT
# up to 7.4e-7, merged up to 2.0e-6 (GPT-OSS); the adapters themselves move the logits by more than 0.1.
LORA_TOL = 5e-6

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=None,
)
_FAMILY = {
    "qwen3_moe": dict(num_experts=8, moe_intermediate_size=40, intermediate_size=88, head_dim=16, norm_topk_prob=True),
    "qwen2_moe": dict(
        num_experts=8, moe_intermediate_size=40, intermediate_size=88, shared_expert_intermediate_size=56, head_dim=16
    ),
    "mixtral": dict(num_local_experts=8, intermediate_size=40, head_dim=16),
    "olmoe": dict(num_experts=8, intermediate_size=40, clip_qkv=8.0),
    "deepseek_v3": dict(
        n_routed_experts=8,
        n_shared_experts=1,
        moe_intermediate_size=40,
        intermediate_size=88,
        first_k_dense_replace=1,
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        num_key_value_heads=4,
        q_lora_rank=24,
        kv_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=24,
    ),
    "gpt_oss": dict(
        num_local_experts=8,
        intermediate_size=40,
        head_dim=16,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
    ),
    "glm4_moe": dict(
        n_routed_experts=8,
        n_shared_experts=1,
        moe_intermediate_size=40,
        intermediate_size=88,
        first_k_dense_replace=1,
        n_group=4,
        topk_group=3,
        norm_topk_prob=True,
        routed_scaling_factor=1.5,
        head_dim=16,
        use_qk_norm=True,
    ),
    "llama": dict(intermediate_size=88),
}


def tiny_config(model_type: str, **overrides):
    """The family's tiny config; ``overrides`` replace any field (``num_hidden_layers=1``, ``router_aux_loss_coef``)."""
    moe = {"num_experts_per_tok": 2} if model_type in FAMILIES else {}
    return AutoConfig.for_model(model_type, **{**_COMMON, **moe, **_FAMILY[model_type], **overrides})


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int = 0) -> None:
    """Every parameter and persistent buffer drawn at random. Hugging Face initialises routers (and DeepSeek's
    correction bias) to zero, which would make every token pick the same experts."""
    torch.manual_seed(seed)
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if not t.is_floating_point() or "inv_freq" in name:
            continue
        if "norm" in name:
            t.normal_(1.0, 0.1)
        elif "e_score_correction_bias" in name:
            t.normal_(0.0, 0.1)
        elif name.endswith(("gate.weight", "router.weight", "router.bias")) or "sinks" in name:
            t.normal_(0.0, 0.5)
        else:
            t.normal_(0.0, 0.2)


def build_hf(model_type: str, dtype: torch.dtype = torch.float32, seed: int = 0, **overrides):
    """The tiny model in transformers (eager attention), every weight random."""
    model = AutoModelForCausalLM.from_config(
        tiny_config(model_type, **overrides), dtype=dtype, attn_implementation="eager"
    )
    randomize_(model, seed)
    return model


def save_tiny(
    out_dir, model_type: str = "qwen3_moe", dtype: torch.dtype = torch.float32, seed: int = 0, **overrides
) -> str:
    """``build_hf(...)`` saved with ``save_pretrained`` in ``out_dir``; returns the directory as a string."""
    out_dir = os.fspath(out_dir)
    build_hf(model_type, dtype=dtype, seed=seed, **overrides).save_pretrained(out_dir)
    return out_dir


def load_hf(path, dtype: torch.dtype = torch.float32):
    """The reference: plain transformers, eager attention and eager (per-expert loop) experts."""
    return AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation="eager", experts_implementation="eager"
    )


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` in float64 (the absolute error ``||a - b||`` when b is zero)."""
    a, b = a.detach().double(), b.detach().double()
    den = b.norm().item()
    return (a - b).norm().item() / den if den else (a - b).norm().item()


def packed_positions(B: int, S: int, lengths: list[int]) -> torch.Tensor:
    """Position ids of B packed rows of S tokens: sequences of ``lengths`` (cycled, each row starting one further
    along) back to back, positions restarting at 0 at every sequence."""
    rows = []
    for b in range(B):
        row, i = [], b
        while len(row) < S:
            row += list(range(lengths[i % len(lengths)]))
            i += 1
        rows.append(row[:S])
    return torch.tensor(rows)

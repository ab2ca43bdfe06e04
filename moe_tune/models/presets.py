"""Built-in models: a tiny MoE for the embedded default run, and published architectures' configs for
random-initialised benchmarks (no hub access: the shapes are written here, from each model's published
config.json). ``overrides`` (e.g. ``num_hidden_layers``) reduce a preset where memory forces it.
"""

from __future__ import annotations

import json
import os
import shutil

from moe_tune.config import ConfigError

PRESETS: dict[str, dict] = {
    # The embedded default: Qwen3-MoE architecture, tiny dimensions, trains in seconds on a CPU. No two sizes of
    # one weight are equal (experts' gate/up 192 x 128, down 128 x 96; q_proj 160 x 128), so a transposed weight
    # cannot pass for the right one; each a multiple of 16, as FP8 GEMMs need.
    "tiny_qwen3_moe": dict(
        model_type="qwen3_moe",
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=40,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        router_aux_loss_coef=0.001,
    ),
    # Tiny DeepSeek-V3 architecture (sigmoid router, correction bias, group-limited top-k, a shared expert,
    # one leading dense layer): exercises aux-loss-free balancing on a CPU. Sizes distinct as above (experts' gate/up
    # 96 x 128; q_proj 160 x 128, o_proj 128 x 96).
    "tiny_deepseek_v3": dict(
        model_type="deepseek_v3",
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=48,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=1.0,
        norm_topk_prob=True,
        q_lora_rank=None,
        kv_lora_rank=32,
        qk_nope_head_dim=24,
        qk_rope_head_dim=16,
        v_head_dim=24,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    ),
    # Qwen/Qwen3-30B-A3B config.json (48 layers; 30.5B parameters, 3.3B active).
    "qwen3_30b_a3b": dict(
        model_type="qwen3_moe",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        router_aux_loss_coef=0.001,
    ),
    # allenai/OLMoE-1B-7B-0924 config.json.
    "olmoe_1b_7b": dict(
        model_type="olmoe",
        vocab_size=50304,
        hidden_size=2048,
        intermediate_size=1024,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=16,
        num_experts=64,
        num_experts_per_tok=8,
        norm_topk_prob=False,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        clip_qkv=None,
        router_aux_loss_coef=0.01,
        tie_word_embeddings=False,
    ),
    # Qwen/Qwen1.5-MoE-A2.7B config.json.
    "qwen2_moe_a2_7b": dict(
        model_type="qwen2_moe",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=5632,
        moe_intermediate_size=1408,
        shared_expert_intermediate_size=5632,
        num_hidden_layers=24,
        num_attention_heads=16,
        num_key_value_heads=16,
        num_experts=60,
        num_experts_per_tok=4,
        norm_topk_prob=False,
        max_position_embeddings=8192,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
    ),
    # mistralai/Mixtral-8x7B-v0.1 config.json.
    "mixtral_8x7b": dict(
        model_type="mixtral",
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
    ),
    # deepseek-ai/DeepSeek-V3 config.json (61 layers, 3 dense; reduce num_hidden_layers for benchmarks).
    "deepseek_v3": dict(
        model_type="deepseek_v3",
        vocab_size=129280,
        hidden_size=7168,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        num_hidden_layers=61,
        first_k_dense_replace=3,
        num_attention_heads=128,
        num_key_value_heads=128,
        n_routed_experts=256,
        n_shared_experts=1,
        num_experts_per_tok=8,
        n_group=8,
        topk_group=4,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        max_position_embeddings=163840,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    ),
    # zai-org/GLM-4.5-Air config.json.
    "glm4_5_air": dict(
        model_type="glm4_moe",
        vocab_size=151552,
        hidden_size=4096,
        intermediate_size=10944,
        moe_intermediate_size=1408,
        num_hidden_layers=46,
        first_k_dense_replace=1,
        num_attention_heads=96,
        num_key_value_heads=8,
        head_dim=128,
        n_routed_experts=128,
        n_shared_experts=1,
        num_experts_per_tok=8,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
        norm_topk_prob=True,
        partial_rotary_factor=0.5,
        use_qk_norm=False,
        attention_bias=True,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
    ),
    # openai/gpt-oss-20b config.json (bf16 weights; the published MXFP4 expert blocks are not read).
    "gpt_oss_20b": dict(
        model_type="gpt_oss",
        vocab_size=201088,
        hidden_size=2880,
        intermediate_size=2880,
        num_hidden_layers=24,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        num_local_experts=32,
        num_experts_per_tok=4,
        sliding_window=128,
        max_position_embeddings=131072,
        rope_theta=150000.0,
        tie_word_embeddings=False,
        router_aux_loss_coef=0.9,
    ),
}


def preset_config(name: str, overrides: dict | None = None, vocab_size: int | None = None):
    """A transformers config for a built-in model name, with ``overrides`` applied."""
    from transformers import AutoConfig

    if name == "hf":
        raise ConfigError("model=hf needs model.path=<local Hugging Face checkpoint directory>")
    if name not in PRESETS:
        raise ConfigError(f"model={name!r} is not a built-in model ({', '.join(PRESETS)}); or set model.path=<HF dir>")
    fields = dict(PRESETS[name])
    if vocab_size is not None:
        fields["vocab_size"] = vocab_size
    fields.update(overrides or {})
    model_type = fields.pop("model_type")
    return AutoConfig.for_model(model_type, **fields)


# ChatML, as Qwen's models use it: ``<|im_start|>role\ncontent<|im_end|>\n`` per message, tools listed in the
# system turn, ``add_generation_prompt`` opens an assistant turn. The ``{% generation %}`` block marks what an
# assistant message adds (content, <|im_end|> and its newline), so transformers returns exact assistant masks.
CHATML_TEMPLATE = (
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages[0]['role'] == 'system' -%}{{- messages[0]['content'] + '\\n\\n' -}}{%- endif -%}"
    "{{- '# Tools\\n' -}}{%- for tool in tools -%}{{- tool | tojson + '\\n' -}}{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if not (tools and loop.first and message['role'] == 'system') -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['role'] == 'assistant' -%}"
    "{%- generation -%}"
    "{{- message['content'] or '' -}}"
    "{%- for call in message.get('tool_calls') or [] -%}"
    "{{- '<tool_call>' + (call.get('function') or call) | tojson + '</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endgeneration -%}"
    "{%- else -%}"
    "{{- message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
CHAT_TOKENS = ["<|im_start|>", "<|im_end|>"]


def build_tokenizer(out_dir: str | None = None):
    """A real Hugging Face fast tokenizer built locally: one token per printable ASCII character and newline,
    plus <pad>, <bos>, <eos>, <unk> and ChatML's <|im_start|> and <|im_end|> (special tokens), with the ChatML
    chat template. Saved with ``save_pretrained`` (tokenizer files and chat_template.jinja) when ``out_dir`` is
    given."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<bos>", "<eos>", "<unk>"]
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {tok: i for i, tok in enumerate(specials + chars + CHAT_TOKENS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every character, newlines too
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials + CHAT_TOKENS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>"
    )
    fast.chat_template = CHATML_TEMPLATE
    if out_dir is not None:
        fast.save_pretrained(out_dir)
    return fast


def trained_config(name: str, overrides: dict | None = None):
    """The transformers config of the model ``moe-tune model=<name>`` trains: a tiny preset's vocabulary is its local
    tokenizer's (``build_tiny_checkpoint``), a published architecture's its own."""
    if name.startswith("tiny_"):
        return preset_config(name, overrides, vocab_size=len(build_tokenizer()))
    return preset_config(name, overrides)


def build_tiny_checkpoint(
    out_dir: str, name: str = "tiny_qwen3_moe", overrides: dict | None = None, seed: int = 0
) -> str:
    """Create a random-initialised Hugging Face checkpoint with a local tokenizer in ``out_dir`` (once)."""
    import torch
    from transformers import AutoModelForCausalLM

    from moe_tune.models.hf_io import DRAWN_WITH

    if os.path.isfile(os.path.join(out_dir, "config.json")):
        return out_dir
    tokenizer = build_tokenizer()
    config = preset_config(name, overrides, vocab_size=len(tokenizer))
    config.bos_token_id, config.eos_token_id, config.pad_token_id = (
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tmp = out_dir + ".tmp"
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own progress and log lines only
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        with open(os.path.join(tmp, DRAWN_WITH), "w") as f:
            json.dump({"seed": seed}, f)
    except BaseException:  # a full disk, Ctrl-C: no partial copy stays to hold the space
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    from moe_tune.models.export import as_umask_allows

    for name in os.listdir(tmp):
        if name.endswith(".safetensors"):
            as_umask_allows(os.path.join(tmp, name))
    os.replace(tmp, out_dir)
    return out_dir

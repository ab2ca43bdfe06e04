"""Tiny tokenizers carrying a family's real chat template (tests/data/chat_templates/<model_type>.jinja, as
published with the family's checkpoints): one token per character, plus the family's special tokens."""

from __future__ import annotations

from pathlib import Path

TEMPLATES = Path(__file__).parent / "chat_templates"
# model_type -> (special tokens its template writes, bos, eos)
SPECIALS = {
    "qwen3_moe": (["<|im_start|>", "<|im_end|>", "<|endoftext|>"], None, "<|im_end|>"),
    "gpt_oss": (
        ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>", "<|constrain|>"],
        "<|startoftext|>",
        "<|return|>",
    ),
    "glm4_moe": (["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"], None, "<|user|>"),
    "deepseek_v3": (
        [
            "<｜User｜>",
            "<｜Assistant｜>",
            "<｜tool▁calls▁begin｜>",
            "<｜tool▁calls▁end｜>",
            "<｜tool▁call▁begin｜>",
            "<｜tool▁call▁end｜>",
            "<｜tool▁sep｜>",
            "<｜tool▁outputs▁begin｜>",
            "<｜tool▁outputs▁end｜>",
            "<｜tool▁output▁begin｜>",
            "<｜tool▁output▁end｜>",
        ],
        "<｜begin▁of▁sentence｜>",
        "<｜end▁of▁sentence｜>",
    ),
}


def original_template(model_type: str) -> str:
    return (TEMPLATES / f"{model_type}.jinja").read_text(encoding="utf-8")


def family_tokenizer(model_type: str):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials, bos, eos = SPECIALS[model_type]
    named = [t for t in ("<pad>", "<unk>", bos, eos) if t is not None]
    added = named + [t for t in specials if t not in named]
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {tok: i for i, tok in enumerate(added + chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in added])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", bos_token=bos, eos_token=eos
    )
    fast.chat_template = original_template(model_type)
    return fast

"""What an export writes for generation beside the weights: the chat template training rendered with, and a
generation_config.json that stops at the end of the turn that template closes."""

from __future__ import annotations

import logging
import os

log = logging.getLogger("moe_tune")


def write_chat_template(out_dir: str, text: str | None) -> None:
    """chat_template.jinja (which transformers prefers to a tokenizer_config.json's template), unless ``text`` is
    None."""
    if text is not None:
        with open(os.path.join(out_dir, "chat_template.jinja"), "w", encoding="utf-8") as f:
            f.write(text)


def end_of_turn_id(tokenizer) -> int | None:
    """The special token a chat template closes an assistant turn with (ChatML's <|im_end|>, Llama 3's
    <|eot_id|>, ...): the first token after the assistant's words in a rendered two-message chat, if special;
    None when the template renders no such token or takes other messages."""
    import jinja2

    probe = "moe_tune probe"
    chat = [{"role": "user", "content": "?"}, {"role": "assistant", "content": probe}]
    try:
        text = tokenizer.apply_chat_template(chat, tokenize=False)
    except (jinja2.TemplateError, ValueError, TypeError, KeyError):
        return None
    if probe not in text:
        return None
    ids = tokenizer(text.split(probe, 1)[1], add_special_tokens=False)["input_ids"]
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    return ids[0] if ids and ids[0] in special else None


def stop_at_end_of_turn(out_dir: str, config_dir: str | None = None) -> None:
    """generation_config.json's ``eos_token_id`` gains the chat template's end-of-turn token when it lacks it, so
    that ``generate`` stops at the end of the answer the model was trained to close (a base model's config stops
    at its end-of-text token only, while a chat template ends each turn with its own). Without a
    generation_config.json, one is made from ``config_dir``'s config.json (default ``out_dir``: an adapter
    directory has none of its own)."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    if not os.path.isfile(os.path.join(out_dir, "tokenizer_config.json")):
        return
    try:
        tokenizer = AutoTokenizer.from_pretrained(out_dir)
    except (OSError, ValueError, ImportError) as e:  # e.g. a tokenizer class that needs trust_remote_code
        log.warning("%s: tokenizer not loadable here (%s); generation_config.json is the source's", out_dir, e)
        return
    eot = end_of_turn_id(tokenizer) if tokenizer.chat_template else None
    if eot is None:
        return
    if os.path.isfile(os.path.join(out_dir, "generation_config.json")):
        generation = GenerationConfig.from_pretrained(out_dir)
    else:
        generation = GenerationConfig.from_model_config(AutoConfig.from_pretrained(config_dir or out_dir))
    eos = generation.eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    if eot not in eos:
        generation.eos_token_id = [*eos, eot]
        generation._from_model_config = False  # else transformers may rebuild it from config.json, losing eot
        generation.save_pretrained(out_dir)

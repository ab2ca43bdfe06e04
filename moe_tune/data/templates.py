"""Training chat templates: for the families whose own template renders earlier turns differently once later
turns follow (dropping their reasoning), a variant shipped in ``chat_templates/`` that keeps every turn as the
original renders a final turn, with ``{% generation %}`` blocks marking the assistant's tokens.

The family is recognised by its template's text (strings no other family's template has), so a tokenizer saved
from any checkpoint of the family is recognised whatever its model_type; a template that already has
``{% generation %}`` blocks is used as it is. A variant is used only if it renders a probe chat exactly as the
tokenizer's template does (another revision of the family's template is left alone).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")
# model_type -> (name in log lines, strings only that family's chat template has)
FAMILIES: dict[str, tuple[str, tuple[str, ...]]] = {
    "qwen3_moe": ("qwen3", ("<|im_start|>", "ns.last_query_index", "reasoning_content")),
    "gpt_oss": ("gpt-oss", ("<|start|>", "<|channel|>", "future_final_message")),
    "glm4_moe": ("glm4-moe", ("[gMASK]<sop>", "<|assistant|>", "ns.last_user_index")),
    "deepseek_v3": ("deepseek-v3", ("<｜Assistant｜>", "<｜User｜>", "ns.is_output_first")),
}
TEMPLATE_DIR = os.path.join(os.path.dirname(__file__), "chat_templates")
PROBE = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "1+2="},
    {"role": "assistant", "content": "3", "reasoning_content": "one plus two", "thinking": "one plus two"},
]


@dataclass(frozen=True)
class TrainingTemplate:
    family: str  # model_type
    name: str
    text: str


def family_of(template: str | None) -> str | None:
    """The model_type whose chat template ``template`` is, among the families with a training template."""
    if not template:
        return None
    return next((f for f, (_, marks) in FAMILIES.items() if all(m in template for m in marks)), None)


def training_template(tokenizer, template: str | None) -> TrainingTemplate | None:
    """The training variant of ``template`` (the tokenizer's), or None: not a family's, already marked, or a
    revision the variant does not render like."""
    family = family_of(template)
    if family is None or GENERATION_BLOCK.search(template):
        return None
    with open(os.path.join(TEMPLATE_DIR, f"{family}_training.jinja"), encoding="utf-8") as f:
        text = f.read()
    if _render(tokenizer, text) != _render(tokenizer, template):
        return None
    return TrainingTemplate(family, FAMILIES[family][0], text)


def _render(tokenizer, template: str) -> str | None:
    try:
        return tokenizer.apply_chat_template(PROBE, chat_template=template, tokenize=False)
    except Exception:  # jinja's own, or the template's raise_exception
        return None


def end_of_turn_token(tokenizer, template: str | None) -> str | None:
    """The special token ``template`` closes an assistant turn with (<|im_end|>, <|return|>, ...): the first
    token after the assistant's words in a rendered two-message chat, if special; None if there is none (GLM
    closes a turn with the next role's token)."""
    probe = "moe_tune probe"
    chat = [{"role": "user", "content": "?"}, {"role": "assistant", "content": probe}]
    try:
        text = tokenizer.apply_chat_template(chat, chat_template=template, tokenize=False)
    except Exception:  # jinja's own, or the template's raise_exception
        return None
    if not template or probe not in text:
        return None
    ids = tokenizer(text.split(probe, 1)[1], add_special_tokens=False)["input_ids"]
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    return tokenizer.convert_ids_to_tokens(ids[0]) if ids and ids[0] in special else None

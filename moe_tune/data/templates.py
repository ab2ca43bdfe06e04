"""Training chat templates: for the families whose own template renders earlier turns differently once later
turns follow (dropping their reasoning), a variant shipped in ``chat_templates/`` that keeps every turn as the
original renders a final turn, with ``{% generation %}`` blocks marking the assistant's tokens.

The family is recognised by its template's text (strings no other family's template has), so a tokenizer saved
from any checkpoint of the family is recognised whatever its model_type; a template that already has
``{% generation %}`` blocks is used as it is. A variant is used only if it renders a probe chat exactly as the
tokenizer's template does (another revision of the family's template is left alone).

Every render is bounded in time (``render_chat``): a template whose loops do not end in time (nested
``range(100000)``) stops the run with a line naming the record, instead of hanging it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
from dataclasses import dataclass

from moe_tune.config import DataError

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


# CPU seconds one render of one record may take. An ordinary render takes milliseconds at most; CPU time, not wall
# time, so that a loaded machine does not stop a run that would finish.
RENDER_LIMIT_S = 10.0


class RenderTimeout(BaseException):
    """A render ran past RENDER_LIMIT_S. A BaseException: the ``except Exception`` that turns a template's own
    errors into a skippable bad record must not catch it (the template's fault stops the run, see records.py's
    SETTING_FAULTS)."""

    def __init__(self, seconds: float):
        super().__init__(
            f"the chat template did not finish rendering it within {seconds:g} s of CPU time (the limit on one "
            "render: a loop in the template that does not end, or not in time); fix the template, or give another "
            "with data.chat_template=<jinja file>"
        )


def render_chat(tokenizer, messages: list[dict], **kwargs):
    """``tokenizer.apply_chat_template(messages, **kwargs)``, stopped with RenderTimeout once the process has
    spent RENDER_LIMIT_S of user CPU time in it: ITIMER_VIRTUAL's SIGVTALRM, whose handler Python runs between two
    bytecodes of the template's compiled code, wherever its loops are. Costs two timer system calls a render, small
    beside the render itself. Unbounded where Python cannot take
    the signal (a thread other than the main one) or where SIGVTALRM has another handler or another virtual timer
    runs (a profiler's: not ours to replace)."""
    if not _can_time():
        return tokenizer.apply_chat_template(messages, **kwargs)
    _rendering.seconds = RENDER_LIMIT_S
    signal.setitimer(signal.ITIMER_VIRTUAL, RENDER_LIMIT_S)
    try:
        return tokenizer.apply_chat_template(messages, **kwargs)
    finally:
        _rendering.seconds = 0.0  # first: a signal arriving from here on is ignored
        signal.setitimer(signal.ITIMER_VIRTUAL, 0)


class _Rendering:
    seconds = 0.0  # the limit of the render in progress; 0: none is
    handler: bool | None = None  # SIGVTALRM goes to _expire (None: not asked yet)


_rendering = _Rendering()


def _expire(signum, frame) -> None:
    if _rendering.seconds:
        seconds, _rendering.seconds = _rendering.seconds, 0.0
        raise RenderTimeout(seconds)


def _can_time() -> bool:
    """SIGVTALRM reaches ``_expire`` and no other virtual timer runs. The handler is installed at the first render
    where SIGVTALRM has the default one, and kept (outside a render it does nothing; the default action would end
    the process): asking for the handler at every render costs more than the render's timer (signal.getsignal
    converts it to an enum by raising and catching)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    if _rendering.handler is None:
        _rendering.handler = signal.getsignal(signal.SIGVTALRM) in (signal.SIG_DFL, _expire)
        if _rendering.handler:
            signal.signal(signal.SIGVTALRM, _expire)
    return _rendering.handler and not signal.getitimer(signal.ITIMER_VIRTUAL)[0]


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
        return render_chat(tokenizer, PROBE, chat_template=template, tokenize=False)
    except Exception:  # jinja's own, or the template's raise_exception
        return None
    except RenderTimeout as e:  # the tokenizer's own template, before any record: no record to name
        raise DataError(f"rendering a three-message probe chat: {e}") from None


def end_of_turn_token(tokenizer, template: str | None) -> str | None:
    """The special token ``template`` closes an assistant turn with (<|im_end|>, <|return|>, ...): the first
    token after the assistant's words in a rendered two-message chat, if special; None if there is none (GLM
    closes a turn with the next role's token)."""
    return _token_after_answer(tokenizer, template, [])


def next_turn_token(tokenizer, template: str | None) -> str | None:
    """For a template that closes no assistant turn (``end_of_turn_token`` None), the special token that opens the
    turn after it, the one the model writes to stop (GLM's <|user|>, on which its generation config stops); None
    otherwise, or if no special token follows."""
    if end_of_turn_token(tokenizer, template) is not None:
        return None
    return _token_after_answer(tokenizer, template, [{"role": "user", "content": "?"}])


def special_ids(tokenizer) -> set[int]:
    return set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}


def _token_after_answer(tokenizer, template: str | None, after: list[dict]) -> str | None:
    """The first token after the assistant's words in a rendered user-assistant chat followed by ``after``, if
    special."""
    probe = "moe_tune probe"
    chat = [{"role": "user", "content": "?"}, {"role": "assistant", "content": probe}, *after]
    try:
        text = render_chat(tokenizer, chat, chat_template=template, tokenize=False)
    except Exception:  # jinja's own, or the template's raise_exception
        return None
    if not template or probe not in text:
        return None
    ids = tokenizer(text.split(probe, 1)[1], add_special_tokens=False)["input_ids"]
    return tokenizer.convert_ids_to_tokens(ids[0]) if ids and ids[0] in special_ids(tokenizer) else None


def turn_end_text(tokenizer, template: str | None) -> str | None:
    """What ``template`` renders between an assistant's answer and the words of the user turn after it (None: it
    renders no such chat)."""
    probe, later = "moe_tune probe", "moe_tune later"
    chat = [
        {"role": "user", "content": "?"},
        {"role": "assistant", "content": probe},
        {"role": "user", "content": later},
    ]
    try:
        text = render_chat(tokenizer, chat, chat_template=template, tokenize=False)
    except Exception:  # jinja's own, or the template's raise_exception
        return None
    if not template or probe not in text or later not in text.split(probe, 1)[1]:
        return None
    return text.split(probe, 1)[1].split(later, 1)[0]


def takes_text_arguments(tokenizer, template: str | None) -> bool:
    """Whether ``template`` renders a tool call whose arguments are JSON text but not one whose arguments are an
    object (DeepSeek-V3's appends them to a string), the form transformers documents and records are read in."""

    def renders(arguments) -> bool:
        call = {"type": "function", "function": {"name": "probe", "arguments": arguments}}
        chat = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
        try:
            render_chat(tokenizer, chat, chat_template=template, tokenize=False)
        except Exception:  # jinja's own, or the template's raise_exception
            return False
        return True

    return template is not None and not renders({"a": 1}) and renders('{"a": 1}')


def with_text_arguments(call):
    """``call`` (a chat message's tool call, OpenAI's ``{"function": {...}}`` or flat) with its arguments as JSON
    text, written as transformers' tojson writes them."""
    if not isinstance(call, dict):
        return call
    if isinstance(call.get("function"), dict):
        return {**call, "function": with_text_arguments(call["function"])}
    if "arguments" not in call or isinstance(call["arguments"], str):
        return call
    return {**call, "arguments": json.dumps(call["arguments"], ensure_ascii=False)}

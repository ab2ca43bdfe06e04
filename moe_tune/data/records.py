"""Record formats: detection (per file, from its first usable record), field checks, and normalisation into
three kinds of sample: ``Chat`` (rendered with the chat template), ``Completion`` and ``Text`` (tokenized as is).

| format            | a record                                                                  |
|-------------------|---------------------------------------------------------------------------|
| chat              | ``{"messages": [{"role", "content"}, ...], "system"?: str, "tools"?: [...]}`` |
| sharegpt          | ``{"conversations": [{"from", "value"}, ...], "system"?: str, "tools"?: [...]}`` |
| alpaca            | ``{"instruction": str, "input"?: str, "output": str, "system"?: str}``: user and assistant turns |
| prompt_completion | ``{"prompt": str, "response" or "completion": str}``; TRL's conversational form: lists of messages |
| text              | ``{"text": str}``                                                          |

A record that cannot be used raises ``BadRecord(reason, detail)``; the loader counts it or stops (on_bad_record).
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field

from moe_tune.config import DataConfig

FORMATS = ("chat", "sharegpt", "alpaca", "prompt_completion", "text")
ROLES = ("system", "developer", "user", "assistant", "tool")
# ShareGPT speakers -> chat roles (the names used by FastChat, LLaMA-Factory and Axolotl).
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "chatgpt": "assistant",
    "function_call": "assistant",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
}


class BadRecord(Exception):
    """A record that cannot be trained on. ``reason`` is the counter's key in ``stats["skipped"]``; ``fix``: a
    remedy other than fixing the record or skipping it (e.g. a longer train.seq_len), named first."""

    def __init__(self, reason: str, detail: str, fix: str | None = None):
        super().__init__(detail)
        self.reason, self.detail, self.fix = reason, detail, fix


# Reasons that are a setting's fault (the chat template's, data.format's), not the record's: the run stops at the
# first such record whatever data.on_bad_record says (skipping would drop every record of its shape), and the detail
# names the fix.
SETTING_FAULTS = ("template_rewrites_history", "template_timeout", "format_mismatch")


@dataclass
class Chat:
    """Messages to render with the chat template; ``trainable[i]``: message i's tokens carry loss."""

    messages: list[dict]
    tools: list | None = None
    trainable: list[bool] = field(default_factory=list)


@dataclass
class Completion:
    prompt: str
    completion: str


@dataclass
class Text:
    text: str


def detect_format(record: dict, cfg: DataConfig) -> str | None:
    if "messages" in record:
        return "chat"
    if "conversations" in record:
        return "sharegpt"
    if "instruction" in record and "output" in record and cfg.prompt_key not in record:
        return "alpaca"
    if cfg.prompt_key in record and (cfg.response_key in record or "completion" in record):
        return "prompt_completion"
    if cfg.text_key in record:
        return "text"
    return None


def normalize(record, fmt: str, cfg: DataConfig) -> Chat | Completion | Text:
    """The sample of ``record`` read as ``fmt``; BadRecord if a field is missing or of the wrong type."""
    if not isinstance(record, dict):
        raise BadRecord("wrong_type", f"a record must be a JSON object, got {type(record).__name__}")
    try:
        return _normalize(record, fmt, cfg)
    except BadRecord as bad:
        other = detect_format(record, cfg) if bad.reason == "missing_field" else None
        if other is None or other == fmt:
            raise
        if cfg.format == "auto":  # read off the file's first record: this one is the odd one, skippable
            raise BadRecord(
                "missing_field",
                f"{bad.detail}: the file's first record made it data.format={fmt}, and this record is "
                f"data.format={other}'s; one format per file (split it, or fix the record)",
            ) from None
        raise BadRecord(
            "format_mismatch",
            f"{bad.detail}: data.format={fmt} was given, and this record is data.format={other}'s; set "
            f"data.format={other}, or drop data.format (auto reads each file's format off its first record)",
        ) from None


def _normalize(record: dict, fmt: str, cfg: DataConfig) -> Chat | Completion | Text:
    if fmt in ("chat", "sharegpt"):
        key = "messages" if fmt == "chat" else "conversations"
        turns = [_turn(m, i, key) for i, m in enumerate(_list_field(record, key))]
        messages = _with_system(turns, record)
        fields = ["value" if "from" in m and "role" not in m else "content" for m in _list_field(record, key)]
        names = [None] * (len(messages) - len(turns)) + [f"{key}[{i}].{f}" for i, f in enumerate(fields)]
        return _chat(messages, _tools(record), cfg.train_on, names=names)
    if fmt == "alpaca":
        return _alpaca(record, cfg)
    if fmt == "prompt_completion":
        return _prompt_completion(record, cfg)
    text = _str_field(record, cfg.text_key)
    if not text.strip():  # a corpus's empty lines: bos then eos would teach that a document may end at once
        raise BadRecord(
            "empty_text", f"{cfg.text_key} is {json.dumps(text)}: only the end of the text would carry loss"
        )
    return Text(text)


def _missing(record: dict, key: str) -> BadRecord:
    if key in record:  # JSON null (or an empty table cell)
        return BadRecord("missing_field", f"{key!r} is null")
    return BadRecord("missing_field", f"no {key!r} field (keys: {sorted(record)})")


def _list_field(record: dict, key: str) -> list:
    if record.get(key) is None:
        raise _missing(record, key)
    value = record[key]
    if not isinstance(value, list) or not value:
        raise BadRecord("wrong_type", f"{key} must be a non-empty list, got {_show(value)}")
    return value


def _str_field(record: dict, key: str) -> str:
    if record.get(key) is None:
        raise _missing(record, key)
    if not isinstance(record[key], str):
        raise BadRecord("wrong_type", f"{key} must be a string, got {_show(record[key])}")
    return record[key]


def _show(value) -> str:
    text = json.dumps(value, default=str)
    return f"{type(value).__name__} {text[:40]}{'...' if len(text) > 40 else ''}"


def _turn(turn, i: int, key: str) -> dict:
    """A turn of ``key`` (messages or conversations) by its own keys: ShareGPT's from/value or role/content (Unsloth's
    standardize_sharegpt keeps the conversations list with role/content turns; LLaMA-Factory and Axolotl map
    from/value turns under messages)."""
    sharegpt = key == "conversations"
    if isinstance(turn, dict) and (turn.get("role") is None) != (turn.get("from") is None):  # one of the two
        sharegpt = turn.get("from") is not None
    return _sharegpt_message(turn, i, key) if sharegpt else _chat_message(turn, i, key)


def _chat_message(message, i: int, key: str = "messages") -> dict:
    if not isinstance(message, dict):
        raise BadRecord("wrong_type", f"{key}[{i}] must be an object, got {_show(message)}")
    message = {k: v for k, v in message.items() if v is not None}  # Arrow fills absent struct fields with None
    role = message.get("role")
    if not isinstance(role, str):
        raise BadRecord("wrong_type", f"{key}[{i}].role must be a string, got {_show(role)}")
    if role not in ROLES:
        raise BadRecord("unknown_role", f"{key}[{i}].role {role!r} is not one of {', '.join(ROLES)}")
    content = message.get("content")
    if isinstance(content, list):  # OpenAI's content parts: the text ones, in order
        content = message["content"] = _text_parts(content, f"{key}[{i}]")
    if not isinstance(content, str) and not (content is None and role == "assistant" and message.get("tool_calls")):
        raise BadRecord("wrong_type", f"{key}[{i}].content must be a string, got {_show(content)}")
    if isinstance(message.get("tool_calls"), list):
        message["tool_calls"] = [_object_arguments(call) for call in message["tool_calls"]]
    return message


def _object_arguments(call):
    """A chat tool call with its arguments as an object where they are its JSON text (OpenAI's form): templates
    write them with tojson (a string would be written as one, its quotes escaped) or walk their items."""
    if not isinstance(call, dict):
        return call
    if isinstance(call.get("function"), dict):
        return {**call, "function": _object_arguments(call["function"])}
    return {**call, "arguments": _arguments(call)} if isinstance(call.get("arguments"), str) else call


def _text_parts(parts: list, where: str) -> str:
    """``[{"type": "text", "text": ...}, ...]`` (OpenAI's chat format) as one string, the parts joined as they are;
    a part of another type (an image) has no place in a text model's record."""
    texts = []
    for j, part in enumerate(parts):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else None
            raise BadRecord(
                "wrong_type",
                f"{where}.content[{j}] is {_show(part) if kind is None else repr(kind) + ' content'}; "
                'content parts must be text ({"type": "text", "text": ...}): moe_tune trains text models',
            )
        texts.append(part["text"])
    return "".join(texts)


def _sharegpt_message(turn, i: int, key: str = "conversations") -> dict:
    if not isinstance(turn, dict):
        raise BadRecord("wrong_type", f"{key}[{i}] must be an object, got {_show(turn)}")
    speaker, value = turn.get("from"), turn.get("value")
    if not isinstance(speaker, str):
        raise BadRecord("wrong_type", f"{key}[{i}].from must be a string, got {_show(speaker)}")
    if speaker not in SHAREGPT_ROLES:
        raise BadRecord("unknown_role", f"{key}[{i}].from {speaker!r} is not one of {', '.join(SHAREGPT_ROLES)}")
    if not isinstance(value, str):
        raise BadRecord("wrong_type", f"{key}[{i}].value must be a string, got {_show(value)}")
    if speaker == "function_call":
        return {"role": "assistant", "content": "", "tool_calls": _function_calls(value, f"{key}[{i}]")}
    return {"role": SHAREGPT_ROLES[speaker], "content": value}


def _function_calls(value: str, where: str) -> list[dict]:
    """A ShareGPT function_call turn's value (LLaMA-Factory's: the JSON of one call, or a list of them, each with a
    name and arguments) as chat tool_calls, rendered as the template renders a call."""
    try:
        calls = json.loads(value)
    except (ValueError, RecursionError):
        calls = None
    calls = [calls] if isinstance(calls, dict) else calls
    if not isinstance(calls, list) or not calls or not all(isinstance(c, dict) and "name" in c for c in calls):
        raise BadRecord(
            "wrong_type",
            f'{where}.value of a function_call turn must be the JSON of a call ({{"name": ..., "arguments": ...}}) or '
            f"a list of them, got {_show(value)}",
        )
    return [{"type": "function", "function": {"name": c["name"], "arguments": _arguments(c)}} for c in calls]


def _arguments(call: dict):
    """A call's arguments as an object where they are its JSON text (chat templates write them with tojson)."""
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):
        with contextlib.suppress(ValueError, RecursionError):
            parsed = json.loads(arguments)
            return parsed if isinstance(parsed, dict) else arguments
    return arguments


def _with_system(messages: list[dict], record: dict) -> list[dict]:
    """A record's top-level ``system`` field becomes the first message (unless it already has one). A blank one
    (a table's system column of a record that has none) adds nothing: inference renders no empty system turn."""
    system = record.get("system")
    if system is None or (messages and messages[0]["role"] == "system"):
        return messages
    if not isinstance(system, str):
        raise BadRecord("wrong_type", f"system must be a string, got {_show(system)}")
    return [{"role": "system", "content": system}] + messages if system.strip() else messages


def _tools(record: dict) -> list | None:
    tools = record.get("tools")
    if isinstance(tools, str):  # often stored as a JSON string (Parquet/Arrow need one type per column)
        try:
            tools = json.loads(tools) if tools.strip() else None
        except json.JSONDecodeError as e:
            raise BadRecord("wrong_type", f"tools is a string but not JSON ({e})") from None
        except RecursionError:  # json's C parser recurses once per nesting level
            raise BadRecord("wrong_type", "tools is a string nested too deep to read as JSON") from None
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise BadRecord("wrong_type", f"tools must be a list of objects, got {_show(tools)}")
    return tools or None


def _chat(messages: list[dict], tools, train_on: str, first: int = 0, names: list | None = None) -> Chat:
    """``first``: messages before it are prompt (conversational prompt/completion records); ``names``: each
    message's text field in the record (``conversations[1].value``; None: a message the record does not hold as
    one), for the empty-answer check."""
    trainable = [i >= first and m["role"] == "assistant" for i, m in enumerate(messages)]
    if train_on == "last_assistant" and any(trainable):
        last = max(i for i, t in enumerate(trainable) if t)
        trainable = [i == last for i in range(len(messages))]
    for m, t, name in zip(messages, trainable, names or []):
        if t and name is not None and _says_nothing(m):
            _check_not_empty(name, m.get("content") or "")
    return Chat(messages, tools, trainable)


def _says_nothing(message: dict) -> bool:
    """A message with blank content and no other field the template may render (tool calls, reasoning)."""
    others = [v for k, v in message.items() if k not in ("role", "content", "name") and v not in (None, "", [], {})]
    return not others and not (message.get("content") or "").strip()


def _alpaca(record: dict, cfg: DataConfig) -> Chat:
    """Alpaca's record as a chat: the instruction, then its input (if any) after a blank line, as the user's turn
    (LLaMA-Factory's reading), the output as the assistant's; rendered with the chat template like any chat."""
    instruction, output, extra = _str_field(record, "instruction"), _str_field(record, "output"), record.get("input")
    if extra is not None and not isinstance(extra, str):
        raise BadRecord("wrong_type", f"input must be a string, got {_show(extra)}")
    _check_not_empty("output", output)
    user = f"{instruction}\n\n{extra}" if extra else instruction
    messages = [{"role": "user", "content": user}, {"role": "assistant", "content": output}]
    return _chat(_with_system(messages, record), None, cfg.train_on)


def _prompt_completion(record: dict, cfg: DataConfig) -> Chat | Completion:
    if cfg.prompt_key == "instruction" and isinstance(record.get("input"), str) and record["input"]:
        raise BadRecord(  # Alpaca's fields mapped by hand would train without the record's input
            "format_mismatch",
            "this record's 'input' field would be left out of the prompt by data.prompt_key=instruction; drop "
            "data.prompt_key and data.response_key: Alpaca records are read as data.format=alpaca (the instruction "
            "and its input as the user's turn)",
        )
    key = cfg.response_key if cfg.response_key in record else "completion"
    prompt, completion = record.get(cfg.prompt_key), record.get(key)
    if prompt is None or completion is None:
        raise _missing(record, cfg.prompt_key if prompt is None else key)
    if isinstance(prompt, list) and isinstance(completion, list):  # TRL's conversational prompt/completion
        parts = [(cfg.prompt_key, i, m) for i, m in enumerate(prompt)] + [(key, i, m) for i, m in enumerate(completion)]
        messages = [_chat_message(m, i, name) for name, i, m in parts]
        names = [f"{name}[{i}].content" for name, i, _ in parts]
        return _chat(messages, _tools(record), cfg.train_on, first=len(prompt), names=names)
    for name, value in ((cfg.prompt_key, prompt), (key, completion)):
        if not isinstance(value, str):
            raise BadRecord("wrong_type", f"{name} must be a string, got {_show(value)}")
    _check_not_empty(key, completion)
    return Completion(prompt, completion)


def _check_not_empty(key: str, completion: str) -> None:
    """An empty answer (often an empty table cell) would train the end-of-sequence token alone."""
    if not completion.strip():
        raise BadRecord(
            "empty_completion", f"{key} is {json.dumps(completion)}: only the end of the turn would carry loss"
        )

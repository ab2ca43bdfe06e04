"""Templates that rewrite earlier turns (Qwen3, GPT-OSS and GLM-4-MoE drop earlier reasoning; DeepSeek-V3's
generation prompt opens a <think> no rendered turn has): with the family's real template on a tiny tokenizer, a
multi-turn record is encoded through moe_tune's training template, its labels exactly the assistant turns' text,
the final turn (and a single-turn record) rendered as the original renders it. data.chat_template wins; an
end-of-turn token outside a generation block's mask is warned about."""

from __future__ import annotations

import contextlib
import json
import logging
import signal

import pytest

from moe_tune.config import DataConfig
from moe_tune.data.encode import IGNORE, Encoder
from moe_tune.data.records import BadRecord, normalize
from moe_tune.models.presets import build_tokenizer
from tests.data.chat_family import SPECIALS, TEMPLATES, family_tokenizer, original_template


def reasoned(content: str, reasoning: str, model_type: str) -> dict:
    """An assistant message with reasoning, in the field its family's template reads."""
    if model_type in ("qwen3_moe", "deepseek_v3"):
        return {"role": "assistant", "content": f"<think>{reasoning}</think>{content}"}
    key = "thinking" if model_type == "gpt_oss" else "reasoning_content"
    return {"role": "assistant", "content": content, key: reasoning}


def conversation(model_type: str) -> list[dict]:
    return [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "1+2="},
        reasoned("3", "one plus two", model_type),
        {"role": "user", "content": "2+2="},
        reasoned("4!", "two plus two", model_type),
    ]


# The text of each assistant turn the model writes after the generation prompt (what carries loss), by hand from
# the family's template. Earlier turns keep their reasoning, except DeepSeek-V3's, whose template renders every
# turn's answer only, the final one included. GLM's closes no turn: the next turn's <|user|> ends it (its generation
# config stops on it), so it carries loss, and a final turn gets one (STOP).
TURNS = {
    "qwen3_moe": [
        "<think>\none plus two\n</think>\n\n3<|im_end|>\n",
        "<think>\ntwo plus two\n</think>\n\n4!<|im_end|>\n",
    ],
    "gpt_oss": [
        "<|channel|>analysis<|message|>one plus two<|end|><|start|>assistant<|channel|>final<|message|>3<|end|>",
        "<|channel|>analysis<|message|>two plus two<|end|><|start|>assistant<|channel|>final<|message|>4!<|return|>",
    ],
    "glm4_moe": ["\n<think>one plus two</think>\n3<|user|>", "\n<think>two plus two</think>\n4!<|user|>"],
    "deepseek_v3": ["3<｜end▁of▁sentence｜>", "4!<｜end▁of▁sentence｜>"],
}
STOP = {"glm4_moe": "<|user|>"}  # after a record's final assistant turn: the template writes nothing there


def encode(tokenizer, messages: list[dict], **options):
    cfg = DataConfig(name="jsonl", num_samples=0, **options)
    encoder = Encoder(tokenizer, cfg, 4096)
    return encoder, encoder(normalize({"messages": messages}, "chat", cfg))


def labelled_turns(tokenizer, labels: list[int]) -> list[str]:
    """The decoded text of each run of labelled tokens."""
    runs, run = [], []
    for label in labels + [IGNORE]:
        if label != IGNORE:
            run.append(label)
        elif run:
            runs.append(tokenizer.decode(run, skip_special_tokens=False))
            run = []
    return runs


def render(tokenizer, messages: list[dict], template: str) -> str:
    return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False)


@pytest.mark.parametrize("model_type", sorted(SPECIALS))
def test_multi_turn_labels_are_exactly_the_assistant_turns(model_type, caplog):
    tokenizer = family_tokenizer(model_type)
    messages = conversation(model_type)
    with caplog.at_level(logging.INFO, logger="moe_tune"):
        encoder, (ids, labels) = encode(tokenizer, messages)
    name = encoder.training.name
    assert f"data: chat template: {name} training template (keeps every turn's reasoning)" in caplog.text
    assert labelled_turns(tokenizer, labels) == TURNS[model_type]
    text = render(tokenizer, messages, encoder.training.text)
    assert ids == tokenizer(text + STOP.get(model_type, ""), add_special_tokens=False).input_ids
    # the final turn as the original renders it: everything after the last user message
    original = render(tokenizer, messages, original_template(model_type))
    assert text.split("2+2=")[-1] == original.split("2+2=")[-1]
    assert "WARNING" not in caplog.text  # every end-of-turn token inside the mask


@pytest.mark.parametrize("model_type", sorted(SPECIALS))
def test_single_turn_renders_as_the_original(model_type):
    tokenizer = family_tokenizer(model_type)
    messages = conversation(model_type)[:3]
    encoder, (ids, labels) = encode(tokenizer, messages)
    original = render(tokenizer, messages, original_template(model_type))
    assert render(tokenizer, messages, encoder.training.text) == original
    assert ids == tokenizer(original + STOP.get(model_type, ""), add_special_tokens=False).input_ids
    final = TURNS[model_type][0].replace("<|end|>", "<|return|>") if model_type == "gpt_oss" else TURNS[model_type][0]
    assert labelled_turns(tokenizer, labels) == [final.replace("<|return|><|start|>", "<|end|><|start|>")]


def test_an_explicit_chat_template_wins():
    """data.chat_template names the original: no training template, and Qwen3's refuses multi-turn masks."""
    tokenizer = family_tokenizer("qwen3_moe")
    with pytest.raises(BadRecord, match="renders message 2 differently"):
        encode(tokenizer, conversation("qwen3_moe"), chat_template=str(TEMPLATES / "qwen3_moe.jinja"))


def test_last_assistant_keeps_the_original_history():
    """Loss on the final turn only: the conversation as the original renders it (earlier reasoning dropped)."""
    tokenizer = family_tokenizer("qwen3_moe")
    messages = conversation("qwen3_moe")
    _, (ids, labels) = encode(tokenizer, messages, train_on="last_assistant")
    assert (
        ids
        == tokenizer(render(tokenizer, messages, original_template("qwen3_moe")), add_special_tokens=False).input_ids
    )
    assert labelled_turns(tokenizer, labels) == TURNS["qwen3_moe"][1:]


@pytest.mark.parametrize("model_type", sorted(SPECIALS))
def test_a_conversational_prompt_keeps_the_original_history(model_type):
    """TRL's prompt/completion form with an assistant turn in the prompt: that turn is context, not trained, so the
    record is the conversation as the original renders it, as with data.train_on=last_assistant (the training template
    kept the prompt's reasoning, a context inference never shows)."""
    tokenizer = family_tokenizer(model_type)
    messages = conversation(model_type)
    cfg = DataConfig(name="jsonl", num_samples=0)
    record = {"prompt": messages[:4], "completion": messages[4:]}
    got = Encoder(tokenizer, cfg, 4096)(normalize(record, "prompt_completion", cfg))
    assert got == encode(tokenizer, messages, train_on="last_assistant")[1]


def test_a_turn_glm_closes_with_the_next_role_token_trains_that_token():
    """GLM-4-MoE ends an assistant turn with the next turn's role token, <|observation|> after a tool call, <|user|>
    after an answer (its stop tokens): they carry loss, and a final answer gets a <|user|>; the model never learnt to
    stop. So with the original template (data.train_on=last_assistant) too."""
    tokenizer = family_tokenizer("glm4_moe")
    call = {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "add", "arguments": {"a": 1}}}]}
    messages = [{"role": "user", "content": "1+2="}, call, {"role": "tool", "content": "3"}, reasoned("3", "ok", "x")]
    ids, labels = encode(tokenizer, messages)[1]
    assert labelled_turns(tokenizer, labels) == [
        "\n<think></think>\n<tool_call>add\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n</tool_call>"
        "<|observation|>",
        "\n<think>ok</think>\n3<|user|>",
    ]
    assert ids[-1] == labels[-1] == tokenizer.convert_tokens_to_ids("<|user|>")
    ids, labels = encode(tokenizer, conversation("glm4_moe"), train_on="last_assistant")[1]
    assert labelled_turns(tokenizer, labels) == ["\n<think>two plus two</think>\n4!<|user|>"]


@pytest.mark.parametrize("train_on", ["assistant", "last_assistant"])
def test_deepseek_renders_a_sharegpt_function_call_with_its_arguments_as_text(train_on):
    """DeepSeek-V3's template appends a call's arguments to a string, and a ShareGPT function_call's arguments are
    read as an object (what tojson templates and GLM-4-MoE's need): every such record was refused ('can only
    concatenate str (not "dict") to str'). Its arguments are written as their JSON text there, and the call trains."""
    tokenizer = family_tokenizer("deepseek_v3")
    call = json.dumps({"name": "add", "arguments": {"a": 1}})
    turns = [("human", "1+2="), ("function_call", call), ("observation", "3"), ("gpt", "3")]
    record = {"conversations": [{"from": who, "value": value} for who, value in turns]}
    cfg = DataConfig(name="jsonl", num_samples=0, train_on=train_on)
    ids, labels = Encoder(tokenizer, cfg, 4096)(normalize(record, "sharegpt", cfg))
    text = '<｜tool▁sep｜>add\n```json\n{"a": 1}\n```'
    assert text in tokenizer.decode(ids)
    trained = labelled_turns(tokenizer, labels)
    assert trained[-1] == "3<｜end▁of▁sentence｜>"
    assert (text in trained[0]) == (train_on == "assistant")


def test_end_of_turn_outside_the_mask_is_warned_about(caplog):
    tokenizer = build_tokenizer()
    tokenizer.chat_template = tokenizer.chat_template.replace(
        "{{- '<|im_end|>\\n' -}}{%- endgeneration -%}", "{%- endgeneration -%}{{- '<|im_end|>\\n' -}}"
    )
    assert "{%- endgeneration -%}{{- '<|im_end|>" in tokenizer.chat_template
    messages = conversation("qwen3_moe")
    with caplog.at_level(logging.WARNING, logger="moe_tune"):
        encode(tokenizer, messages)
        encode(tokenizer, messages)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2  # once per encoder
    assert warnings[0].startswith("data: the chat template's end-of-turn token <|im_end|> falls outside the assistant")


LLAMA3 = (  # Llama 3's markers, which the tiny ChatML tokenizer has no tokens for: it reads them as characters
    "{%- for m in messages %}{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] + "
    "'<|eot_id|>' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>"
    "\\n\\n' }}{%- endif %}"
)


def test_a_template_that_ends_no_turn_with_a_special_token_is_warned_about(tmp_path, caplog):
    """A template written for another tokenizer (Llama 3's <|eot_id|>, plain characters to this one) gives the
    model no token to learn to stop on: one warning naming what it renders. Its own template (<|im_end|>) and one
    ending a turn with a space then the eos token (Llama 2's) are not warned about."""
    tokenizer = build_tokenizer()
    messages = conversation("qwen3_moe")
    llama2 = LLAMA3.replace("'<|eot_id|>'", "' ' + eos_token")
    warnings = {}
    for name, text in [("llama3", LLAMA3), ("llama2", llama2), ("own", None)]:
        options = {}
        if text is not None:
            (tmp_path / f"{name}.jinja").write_text(text)
            options["chat_template"] = str(tmp_path / f"{name}.jinja")
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="moe_tune"):
            encoder, _ = encode(tokenizer, messages, **options)
            encoder(normalize({"messages": messages}, "chat", DataConfig(name="jsonl", num_samples=0, **options)))
        warnings[name] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings["own"] == [] and warnings["llama2"] == []
    (line,) = warnings["llama3"]  # once per encoder
    assert line.startswith("data: the chat template ends an assistant turn with '<|eot_id|><|start_header_id|>user")
    assert "none of the tokenizer's special tokens (<bos>, <eos>, <pad>, <unk>, <|im_end|>, <|im_start|>)" in line


ENDLESS = (  # 10^10 iterations: hours; the run hung on it
    "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
)


class Hung(BaseException):
    """The render was not stopped: raised by the test's own wall-clock alarm so that the suite fails, not hangs."""


@contextlib.contextmanager
def fail_after(seconds: float):
    def expired(signum, frame):
        raise Hung(f"the render was not stopped within {seconds} s of wall time")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("on_bad_record", ["error", "skip"])
def test_a_render_that_does_not_end_stops_the_run_at_the_limit(tmp_path, monkeypatch, on_bad_record):
    """A chat template with nested loops hung the run: each render is stopped at RENDER_LIMIT_S of CPU time, with
    the record and the limit in one line; the template's fault, so skip does not drop record after record (each
    taking the limit). An ordinary render leaves the timer off (a timer left running would also leave the next
    render unbounded), and SIGVTALRM outside a render does nothing."""
    from moe_tune.config import DataError
    from moe_tune.data import build_datasets, templates

    chat = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    encoder = Encoder(build_tokenizer(), DataConfig(), 64)
    assert encoder.render(chat["messages"], None).endswith("a<|im_end|>\n")
    assert signal.getitimer(signal.ITIMER_VIRTUAL) == (0.0, 0.0)
    signal.raise_signal(signal.SIGVTALRM)  # outside a render: ignored

    monkeypatch.setattr(templates, "RENDER_LIMIT_S", 0.3)
    (tmp_path / "endless.jinja").write_text(ENDLESS)
    (tmp_path / "data.jsonl").write_text(json.dumps(chat) + "\n")
    cfg = DataConfig(
        name="jsonl",
        path=str(tmp_path / "data.jsonl"),
        num_samples=0,
        cache_dir=str(tmp_path / "cache"),
        chat_template=str(tmp_path / "endless.jinja"),
        on_bad_record=on_bad_record,
    )
    with pytest.raises(DataError) as e, fail_after(60):
        build_datasets(cfg, build_tokenizer(), 32, seed=0)
    assert str(e.value) == (
        f"{tmp_path / 'data.jsonl'}:1: the chat template did not finish rendering it within 0.3 s of CPU time (the "
        "limit on one render: a loop in the template that does not end, or not in time); fix the template, or give "
        "another with data.chat_template=<jinja file>"
    )
    assert signal.getitimer(signal.ITIMER_VIRTUAL) == (0.0, 0.0)

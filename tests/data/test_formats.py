"""Each record format to token ids and loss labels, checked exactly against ids built by hand for the built-in
tokenizer (one id per character, ChatML's <|im_start|>/<|im_end|>): chat (system, multi-turn, tools), ShareGPT,
Alpaca, prompt/completion (response and completion keys, TRL's conversational form), text; every data.train_on; a
template without generation blocks gives the same masks by diffing renders; one that breaks the prefix rule is
refused; auto-detection per file."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest

from moe_tune.config import DataConfig, DataError
from moe_tune.data import build_datasets
from moe_tune.models.presets import build_tokenizer

S, E = "<|im_start|>", "<|im_end|>"
IGNORE = -100
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "1+2="},
    {"role": "assistant", "content": "3"},
    {"role": "user", "content": "2+2="},
    {"role": "assistant", "content": "4!"},
]
# ChatML as the built-in template renders it, but with no {% generation %} block: masks come from the diff.
PLAIN_CHATML = (
    "{%- for m in messages -%}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def hand_ids(text: str) -> list[int]:
    """The built-in tokenizer's ids, by hand: <pad> <bos> <eos> <unk> are 0-3, printable ASCII c is 4 + ord(c) - 32,
    newline 99, <|im_start|> 100, <|im_end|> 101."""
    out, i = [], 0
    while i < len(text):
        special = next((s for s in (S, E) if text.startswith(s, i)), None)
        if special:
            out.append(100 if special == S else 101)
            i += len(special)
        else:
            out.append(99 if text[i] == "\n" else 4 + ord(text[i]) - 32)
            i += 1
    return out


def expect(*parts: tuple[str, bool]) -> tuple[list[int], list[int]]:
    """(ids, labels) of text parts, each trainable or not; the first token never has a label."""
    ids, labels = [], []
    for text, trainable in parts:
        t = hand_ids(text)
        ids += t
        labels += t if trainable else [IGNORE] * len(t)
    return ids, [IGNORE] + labels[1:]


def chat_expectation(train_on: str) -> tuple[list[int], list[int]]:
    a1, a2 = train_on in ("assistant", "all"), True
    return expect(
        (f"{S}system\nBe brief.{E}\n{S}user\n1+2={E}\n{S}assistant\n", train_on == "all"),
        (f"3{E}\n", a1),
        (f"{S}user\n2+2={E}\n{S}assistant\n", train_on == "all"),
        (f"4!{E}\n", a2),
    )


def samples(tmp_path, records: list, name: str = "data.jsonl", **options) -> list[tuple[list[int], list[int]]]:
    """(ids, labels) of every sample of ``records`` written as JSON Lines, one sample per row, in file order."""
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = DataConfig(name="jsonl", path=str(path), num_samples=0, packing=False, cache_dir=str(tmp_path / "cache"))
    train, _ = build_datasets(replace(cfg, **options), build_tokenizer(), 128, seed=0)
    out = []
    for ids, labels in zip(train.ids.tolist(), train.labels.tolist()):
        n = next((i for i, t in enumerate(ids) if t == 0), len(ids))  # <pad> (id 0) only pads
        out.append((ids[:n], labels[:n]))
    return out


@pytest.mark.parametrize("train_on", ["assistant", "all", "last_assistant"])
def test_chat_system_multi_turn(tmp_path, train_on):
    assert samples(tmp_path, [{"messages": CHAT}], train_on=train_on) == [chat_expectation(train_on)]


@pytest.mark.parametrize("train_on", ["assistant", "all", "last_assistant"])
def test_template_without_generation_blocks_gives_the_same_masks(tmp_path, train_on):
    template = tmp_path / "plain.jinja"
    template.write_text(PLAIN_CHATML)
    got = samples(tmp_path, [{"messages": CHAT}], train_on=train_on, chat_template=str(template))
    assert got == [chat_expectation(train_on)]


def test_system_field_and_tools(tmp_path):
    tools = [{"name": "add"}]
    record = {"system": "Be brief.", "messages": CHAT[1:3], "tools": tools}
    ids, labels = samples(tmp_path, [record])[0]
    tools_turn = f"{S}system\nBe brief.\n\n# Tools\n{json.dumps(tools[0])}\n{E}\n"
    assert (ids, labels) == expect((f"{tools_turn}{S}user\n1+2={E}\n{S}assistant\n", False), (f"3{E}\n", True))


def test_an_empty_system_field_adds_no_system_turn(tmp_path):
    """A table's system column holds "" for records without one (a column cannot be absent from a row): such a record
    renders as one without the field, as inference renders it, not with an empty system turn."""
    for n, record in enumerate([{"messages": CHAT[1:]}, {"instruction": "1+2=", "output": "3"}]):
        got = samples(tmp_path, [{"system": " " * n, **record}], name=f"with{n}.jsonl")
        assert got == samples(tmp_path, [record], name=f"without{n}.jsonl")
        assert got[0][0][:7] != hand_ids(f"{S}system")


def test_sharegpt_is_the_same_conversation(tmp_path):
    speakers = {"system": "system", "user": "human", "assistant": "gpt"}
    record = {"conversations": [{"from": speakers[m["role"]], "value": m["content"]} for m in CHAT]}
    assert samples(tmp_path, [record]) == [chat_expectation("assistant")]


def test_turn_keys_are_read_whichever_list_holds_them(tmp_path):
    """Unsloth's standardize_sharegpt keeps the conversations list with role/content turns, and LLaMA-Factory or
    Axolotl datasets map from/value turns under messages: each turn is read by its own keys."""
    speakers = {"system": "system", "user": "human", "assistant": "gpt"}
    sharegpt_turns = [{"from": speakers[m["role"]], "value": m["content"]} for m in CHAT]
    records = [{"conversations": CHAT}, {"messages": sharegpt_turns}]
    assert samples(tmp_path, records[:1]) == samples(tmp_path, records[1:]) == [chat_expectation("assistant")]


def test_a_sharegpt_function_call_is_a_tool_call(tmp_path):
    """LLaMA-Factory's function_call turn holds the call as JSON text: it renders as the template renders a tool call
    (here <tool_call>...), as the chat record with tool_calls does, not as the JSON text of an answer."""
    call = {"name": "add", "arguments": {"a": 1, "b": 2}}
    tools = [{"name": "add"}]
    chat = [
        CHAT[1],
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]},
        {"role": "tool", "content": "3"},
        {"role": "assistant", "content": "3"},
    ]
    turns = [
        {"from": "human", "value": "1+2="},
        {"from": "function_call", "value": json.dumps(call)},
        {"from": "observation", "value": "3"},
        {"from": "gpt", "value": "3"},
    ]
    want = samples(tmp_path, [{"messages": chat, "tools": tools}], name="chat.jsonl")
    got = samples(tmp_path, [{"conversations": turns, "tools": json.dumps(tools)}], name="sharegpt.jsonl")
    assert got == want and "<tool_call>" in "".join(chr(i + 28) for i in got[0][0] if 4 <= i < 99)
    turns[1]["value"] = "add(1, 2)"
    with pytest.raises(DataError, match=r"sharegpt\.jsonl:1: conversations\[1\]\.value of a function_call turn"):
        samples(tmp_path, [{"conversations": turns}], name="sharegpt.jsonl")


def test_a_tool_call_with_its_arguments_as_json_text_renders_as_with_the_object(tmp_path):
    """OpenAI's chat format holds a call's arguments as JSON text; templates write them with tojson (a string came
    out as a quoted, escaped string: '"{\\"a\\": 1}"') or walk their items (GLM-4-MoE's refused the record). They
    are read as the object, as a ShareGPT function_call's are."""
    arguments = {"a": 1, "b": "é"}

    def record(args) -> dict:
        call = {"type": "function", "function": {"name": "add", "arguments": args}}
        return {"messages": [CHAT[1], {"role": "assistant", "content": "", "tool_calls": [call]}]}

    want = samples(tmp_path, [record(arguments)])
    assert samples(tmp_path, [record(json.dumps(arguments))]) == want
    assert samples(tmp_path, [record("not JSON")]) != want  # text that is no object is rendered as it is


def test_openai_text_parts_are_the_same_conversation(tmp_path):
    """content as OpenAI's list of text parts: the parts joined, the conversation as with plain strings."""
    parts = [{**m, "content": [{"type": "text", "text": m["content"][:1]}, {"type": "text", "text": m["content"][1:]}]}
             for m in CHAT]  # fmt: skip
    assert samples(tmp_path, [{"messages": parts}]) == [chat_expectation("assistant")]


@pytest.mark.parametrize("key", ["response", "completion"])
@pytest.mark.parametrize("train_on", ["assistant", "all"])
def test_prompt_completion(tmp_path, key, train_on):
    got = samples(tmp_path, [{"prompt": "7*6=", key: "42"}], train_on=train_on)
    ids = [1] + hand_ids("7*6=") + hand_ids("42") + [2]  # <bos> prompt completion <eos>
    labels = [IGNORE] + (ids[1:5] if train_on == "all" else [IGNORE] * 4) + ids[5:]
    assert got == [(ids, labels)]


def test_prompt_completion_conversational(tmp_path):
    record = {"prompt": CHAT[:4], "completion": CHAT[4:]}  # TRL: loss on the completion's messages only
    assert samples(tmp_path, [record]) == [chat_expectation("last_assistant")]


def test_alpaca_is_a_user_and_an_assistant_turn(tmp_path):
    """Alpaca's instruction, then its input after a blank line, is the user's turn; an empty input adds nothing."""
    records = [
        {"system": "Be brief.", "instruction": "Add.", "input": "2+2", "output": "4"},
        {"instruction": "Say hi.", "input": "", "output": "hi"},
    ]
    assert samples(tmp_path, records) == [
        expect((f"{S}system\nBe brief.{E}\n{S}user\nAdd.\n\n2+2{E}\n{S}assistant\n", False), (f"4{E}\n", True)),
        expect((f"{S}user\nSay hi.{E}\n{S}assistant\n", False), (f"hi{E}\n", True)),
    ]


def test_alpaca_mapped_by_hand_never_drops_an_input(tmp_path):
    """data.prompt_key=instruction would read the instruction alone: a record with an input stops the run (skipping
    it would drop every such record), one without trains as a string prompt/completion."""
    keys = {"prompt_key": "instruction", "response_key": "output"}
    ids = [1] + hand_ids("Say hi.") + hand_ids("hi") + [2]
    assert samples(tmp_path, [{"instruction": "Say hi.", "input": "", "output": "hi"}], **keys) == [
        (ids, [IGNORE] * 8 + ids[8:])
    ]
    for policy in ("error", "skip"):
        with pytest.raises(DataError, match=r"data\.jsonl:1: this record's 'input' field would be left out"):
            samples(tmp_path, [{"instruction": "Add.", "input": "2+2", "output": "4"}], on_bad_record=policy, **keys)


@pytest.mark.parametrize(
    "record",
    [{"prompt": "7*6=", "completion": ""}, {"prompt": "7*6=", "response": "  "}, {"instruction": "Add.", "output": ""}],
)
def test_an_empty_answer_is_a_bad_record(tmp_path, record):
    """It would train the end of the turn alone: named under error, counted under skip (the next record trains)."""
    key = next(k for k in ("completion", "response", "output") if k in record)
    with pytest.raises(DataError, match=rf"data\.jsonl:1: {key} is \"\s*\": only the end of the turn would carry"):
        samples(tmp_path, [record])
    fine = {**record, key: "42"}
    assert len(samples(tmp_path, [record, fine], on_bad_record="skip")) == 1


@pytest.mark.parametrize(
    ("record", "name"),
    [
        ({"messages": [*CHAT[:2], {"role": "assistant", "content": ""}]}, "messages[2].content"),
        ({"system": "Be brief.", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": " "}]},
         "conversations[1].value"),
        # the turn's own field: a role/content turn under conversations (Unsloth's standardize_sharegpt)
        ({"conversations": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]},
         "conversations[1].content"),
        ({"prompt": CHAT[:2], "completion": [{"role": "assistant", "content": "\n"}]}, "completion[0].content"),
    ],
)  # fmt: skip
def test_an_empty_assistant_turn_is_a_bad_record(tmp_path, record, name):
    """A trained assistant turn with no words, no tool call and no reasoning would train the end of the turn alone,
    as an empty completion would; a turn that is not trained (last_assistant's earlier ones) is context. The line
    names the turn's own field (a ShareGPT turn's value: 'conversations[1].content' named a field it lacks)."""
    with pytest.raises(DataError, match=rf"data\.jsonl:1: {re.escape(name)} is \"[^\"]*\": only the end of"):
        samples(tmp_path, [record])
    with pytest.raises(DataError, match=r"no usable records \(1 read, skipped empty_completion: 1\)"):
        samples(tmp_path, [record], on_bad_record="skip")
    calls = [{"type": "function", "function": {"name": "add", "arguments": {"a": 1}}}]
    fine = [CHAT[1], {"role": "assistant", "content": "", "tool_calls": calls}, {"role": "tool", "content": "3"}]
    fine += [{"role": "assistant", "content": "", "reasoning_content": "1+2 is 3."}, *CHAT[3:]]
    earlier = [*CHAT[1:2], {"role": "assistant", "content": ""}, *CHAT[3:]]
    assert (
        len(samples(tmp_path, [{"messages": fine}]))
        == len(samples(tmp_path, [{"messages": earlier}], train_on="last_assistant"))
        == 1
    )


def test_text(tmp_path):
    ids = [1] + hand_ids("hello\nworld") + [2]
    assert samples(tmp_path, [{"text": "hello\nworld"}]) == [(ids, [IGNORE] + ids[1:])]


@pytest.mark.parametrize("text", ["", " \n"])
def test_an_empty_text_is_a_bad_record(tmp_path, text):
    """A corpus's empty lines ({"text": ""}, wikitext's " \n") trained bos then eos: the model learnt that a document
    may end at once, where an empty completion is refused (and so was an empty text under a tokenizer with no bos,
    as a record with no token carrying loss). One line naming the record; skip counts it."""
    records = [{"text": "hello"}, {"text": text}]
    with pytest.raises(DataError, match=r"data\.jsonl:2: text is \"[^\"]*\": only the end of the text would carry"):
        samples(tmp_path, records)
    assert samples(tmp_path, records, on_bad_record="skip") == samples(tmp_path, records[:1])


def test_special_tokens_already_in_the_text_are_not_doubled(tmp_path):
    """Text exported with its special tokens (<bos>, <eos> as text): the same sample as without them, one bos and one
    eos (a second eos carried loss: the model learnt to emit it twice)."""
    records = [{"text": "<bos>hello<eos>"}, {"prompt": "<bos>7*6=", "completion": "42<eos>"}]
    text, completion = samples(tmp_path, records[:1]), samples(tmp_path, records[1:], name="pc.jsonl")
    assert text == samples(tmp_path, [{"text": "hello"}], name="plain.jsonl")
    assert completion == samples(tmp_path, [{"prompt": "7*6=", "completion": "42"}], name="plain_pc.jsonl")
    assert text[0][0] == [1] + hand_ids("hello") + [2] and completion[0][0] == [1] + hand_ids("7*6=42") + [2]


def test_auto_detection_is_per_file(tmp_path):
    d = tmp_path / "mixed"
    d.mkdir()
    (d / "a.jsonl").write_text(json.dumps({"messages": CHAT}) + "\n")
    (d / "b.jsonl").write_text(json.dumps({"text": "hi"}) + "\n")
    (d / "c.jsonl").write_text(json.dumps({"prompt": "p", "completion": "c"}) + "\n")
    cfg = DataConfig(name="jsonl", path=str(d), num_samples=0, packing=False, cache_dir=str(tmp_path / "cache"))
    train, _ = build_datasets(cfg, build_tokenizer(), 128, seed=0)
    texts = build_tokenizer().batch_decode(train.ids.tolist(), skip_special_tokens=False)
    assert texts[0].startswith(f"{S}system\nBe brief.")
    assert texts[1].startswith("<bos>hi<eos><pad>")
    assert texts[2].startswith("<bos>pc<eos><pad>")
    with pytest.raises(DataError, match=r"a\.jsonl:1: no 'text' field"):  # an explicit format overrides
        build_datasets(replace(cfg, format="text"), build_tokenizer(), 128, seed=0)


@pytest.mark.parametrize("preamble", ["", f"{S}system\nBe kind.{E}\n"])
def test_an_opening_assistant_turn_carries_loss_on_its_own_words_only(tmp_path, preamble):
    """A conversation that opens with the assistant (a greeting) through a template without generation blocks, one
    that adds a default system prompt too: as any later turn, its words and end of turn carry loss, the assistant
    header and the template's system prompt none (the diff against an empty render trained both)."""
    template = tmp_path / "default_system.jinja"
    template.write_text(
        "{%- if messages[0]['role'] != 'system' -%}{{- '" + preamble + "' -}}{%- endif -%}" + PLAIN_CHATML
    )
    record = {"messages": [{"role": "assistant", "content": "Hi!"}, *CHAT[1:3]]}
    assert samples(tmp_path, [record], chat_template=str(template)) == [
        expect(
            (f"{preamble}{S}assistant\n", False),
            (f"Hi!{E}\n", True),
            (f"{S}user\n1+2={E}\n{S}assistant\n", False),
            (f"3{E}\n", True),
        )
    ]


def test_an_opening_assistant_turn_rendered_unlike_a_later_one_is_refused(tmp_path):
    template = tmp_path / "marks_the_opening.jinja"
    template.write_text(PLAIN_CHATML.replace("m['content']", "m['content'] + (' (first)' if loop.first else '')"))
    record = {"messages": [{"role": "assistant", "content": "Hi!"}, *CHAT[1:3]]}
    with pytest.raises(DataError) as e:
        samples(tmp_path, [record], chat_template=str(template), on_bad_record="skip")
    assert str(e.value) == (
        f"{tmp_path / 'data.jsonl'}:1: the chat template renders an assistant turn that opens the conversation "
        "differently from one that follows a user turn, so its loss mask cannot be found by diffing renders; use a "
        "template with {% generation %} blocks (data.chat_template=<file>), or open the conversation with a user turn"
    )


def test_template_breaking_the_prefix_rule_is_refused(tmp_path):
    """Earlier assistant turns rendered differently (as Qwen3 drops their reasoning): no mask can be diffed."""
    template = tmp_path / "drops_history.jinja"
    template.write_text(
        "{%- for m in messages -%}{{- '<|im_start|>' + m['role'] + '\\n' -}}"
        "{%- if m['role'] == 'assistant' and not loop.last -%}{{- '...' -}}{%- else -%}{{- m['content'] -}}{%- endif -%}"
        "{{- '<|im_end|>\\n' -}}{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
    )
    single_turn = {"messages": CHAT[:3]}  # nothing follows its assistant turn: its mask diffs
    for policy in ("error", "skip"):  # the template's fault, not the record's: skipping would drop every such record
        with pytest.raises(DataError) as e:
            samples(tmp_path, [single_turn, {"messages": CHAT}], chat_template=str(template), on_bad_record=policy)
        assert str(e.value).startswith(f"{tmp_path / 'data.jsonl'}:2: the chat template renders message 2 different")
        assert str(e.value).endswith("or data.train_on=last_assistant|all")  # its own fix, not the record's
    ids, labels = samples(tmp_path, [{"messages": CHAT}], chat_template=str(template), train_on="last_assistant")[0]
    assert [t for t, label in zip(ids, labels) if label != IGNORE] == hand_ids(f"4!{E}\n")


def test_tokenizer_without_a_template_names_the_fix(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"messages": CHAT}) + "\n")
    tokenizer = build_tokenizer()
    tokenizer.chat_template = None
    cfg = DataConfig(name="jsonl", path=str(path), num_samples=0, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(DataError, match=r"has none; set data\.chat_template=<jinja file>"):
        build_datasets(cfg, tokenizer, 128, seed=0)


def test_builtin_tokenizer_saves_its_chat_template(tmp_path):
    from transformers import AutoTokenizer

    build_tokenizer(str(tmp_path))
    loaded = AutoTokenizer.from_pretrained(str(tmp_path))
    text = loaded.apply_chat_template(CHAT[1:2], tokenize=False, add_generation_prompt=True)
    assert text == f"{S}user\n1+2={E}\n{S}assistant\n"
    assert loaded(text, add_special_tokens=False).input_ids == hand_ids(text)


def test_builtin_set_is_chat_records(tmp_path):
    from moe_tune.data.builtin import arithmetic_samples

    records = arithmetic_samples(64, seed=0)
    assert all([m["role"] for m in r["messages"]][-2:] == ["user", "assistant"] for r in records)
    assert any(r["messages"][0]["role"] == "system" for r in records)
    cfg = DataConfig(num_samples=64, packing=False, cache_dir=str(tmp_path / "cache"))
    train, _ = build_datasets(cfg, build_tokenizer(), 64, seed=0)
    first = records[0]["messages"]
    ids, labels = expect(
        ("".join(f"{S}{m['role']}\n{m['content']}{E}\n" for m in first[:-1]) + f"{S}assistant\n", False),
        (f"{first[-1]['content']}{E}\n", True),
    )
    assert train.ids[0, : len(ids)].tolist() == ids and train.labels[0, : len(ids)].tolist() == labels


def test_tokens_merged_across_the_boundary_go_by_character_spans():
    """A tokenizer that merges the assistant header with the answer ("A:ok" is one token): the renders are text
    prefixes but not token prefixes, so a token is trainable when its characters overlap the message's."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from moe_tune.data.encode import Encoder
    from moe_tune.data.records import normalize

    vocab = {"<unk>": 0, "U:": 1, "hi": 2, "A:": 3, "A:ok": 4, ".": 5}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    tokenizer.chat_template = (
        "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{{- 'U: ' + m['content'] + ' ' -}}"
        "{%- else -%}{{- 'A:' + m['content'] + ' . ' -}}{%- endif -%}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- 'A:' -}}{%- endif -%}"
    )
    cfg = DataConfig()
    sample = normalize(
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]}, "chat", cfg
    )
    assert Encoder(tokenizer, cfg, 16)(sample) == ([1, 2, 4, 5], [IGNORE, IGNORE, 4, 5])

"""Bad records: with data.on_bad_record=error (the default) one line naming file:line, the problem and the fix;
with skip, counted per reason in ``stats``. A training step whose rows carry no label gives loss 0, not NaN."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from moe_tune.config import DataConfig, DataError
from moe_tune.data import PackedDataset, build_datasets
from moe_tune.models.presets import build_tokenizer

GOOD = json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}).encode()
USER = {"role": "user", "content": "q"}
CASES = {
    # reason: (line 2 of the file, the message after "data.jsonl:2: ")
    "invalid_json": (
        b'{"messages": [}',
        "not valid JSON (Expecting value at column 15); fix the line or set data.on_bad_record=skip",
    ),
    "invalid_utf8": (
        b'{"text": "caf\xe9"}',
        "not valid UTF-8 (byte 0xe9 at 13); fix the line or set data.on_bad_record=skip",
    ),
    "wrong_type": (
        json.dumps({"messages": [USER, {"role": "assistant", "content": 42}]}).encode(),
        "messages[1].content must be a string, got int 42; fix the record or set data.on_bad_record=skip",
    ),
    "unknown_role": (
        json.dumps({"messages": [{"role": "narrator", "content": "x"}]}).encode(),
        "messages[0].role 'narrator' is not one of system, developer, user, assistant, tool; fix the record or set "
        "data.on_bad_record=skip",
    ),
    "no_trainable_token": (
        json.dumps({"messages": [USER]}).encode(),
        "no token carries loss (data.train_on=assistant); fix the record or set data.on_bad_record=skip",
    ),
    "missing_field": (
        json.dumps({"messages": None}).encode(),
        "'messages' is null; fix the record or set data.on_bad_record=skip",
    ),
}


def build(tmp_path, lines: list[bytes], **options):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    cfg = DataConfig(name="jsonl", path=str(path), num_samples=0, cache_dir=str(tmp_path / "cache"))
    return build_datasets(replace(cfg, **options), build_tokenizer(), 32, seed=0)[0]


@pytest.mark.parametrize("reason", list(CASES))
def test_error_names_file_line_and_fix(tmp_path, reason):
    line, message = CASES[reason]
    with pytest.raises(DataError) as e:
        build(tmp_path, [GOOD, line, GOOD])
    assert str(e.value) == f"{tmp_path / 'data.jsonl'}:2: {message}"


def test_json_errors_name_one_line_and_a_column(tmp_path):
    """The line is the record's file:line only: json's own "line 2 column 1 (char 31)" (a JSON Lines record cut at
    its line's end: json counted the newline) read as a second line number; a JSON array's line is in the file."""
    with pytest.raises(DataError) as e:
        build(tmp_path, [GOOD, b'{"prompt": "a", "completion": ', GOOD])
    assert str(e.value) == (
        f"{tmp_path / 'data.jsonl'}:2: not valid JSON (Expecting value at column 31); fix the line or set "
        "data.on_bad_record=skip"
    )
    array = tmp_path / "array.json"
    array.write_text('[{"prompt": "a", "completion": "b"},\n {"prompt": "a" "completion": "x"}]\n')
    cfg = DataConfig(name="jsonl", path=str(array), num_samples=0, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(DataError) as e:
        build_datasets(cfg, build_tokenizer(), 32, seed=0)
    assert str(e.value) == (
        f"{array}:2: not valid JSON (Expecting ',' delimiter at column 17; the whole JSON array is dropped); fix the "
        "line or set data.on_bad_record=skip"
    )


@pytest.mark.parametrize("reason", list(CASES))
def test_skip_counts_per_reason(tmp_path, reason):
    train = build(tmp_path, [GOOD, CASES[reason][0], GOOD], on_bad_record="skip")
    assert train.stats["records_read"] == 3 and train.stats["records_used"] == 2
    assert train.stats["records_skipped"] == {reason: 1}
    assert train.stats["first_skipped"] == {reason: f"{tmp_path / 'data.jsonl'}:2"}


def test_more_wrong_types_and_sharegpt_roles(tmp_path):
    lines = [
        json.dumps({"messages": "hello"}).encode(),  # messages not a list
        json.dumps({"conversations": [{"from": "alien", "value": "x"}]}).encode(),
        json.dumps({"conversations": [{"from": "human", "value": ["x"]}]}).encode(),
        json.dumps({"prompt": "p", "response": 3}).encode(),
        json.dumps({"messages": [USER], "tools": "{not json"}).encode(),
        b"[1, 2]",  # not an object: no format
        json.dumps({"question": "?"}).encode(),  # no known format in a file read as auto
    ]
    path = tmp_path / "many"
    path.mkdir()
    (path / "good.jsonl").write_bytes(GOOD)
    for i, line in enumerate(lines):  # one file each: the format is detected per file
        (path / f"{i}.jsonl").write_bytes(line + b"\n")
    cfg = DataConfig(name="jsonl", path=str(path), num_samples=0, cache_dir=str(tmp_path / "c"), on_bad_record="skip")
    train, _ = build_datasets(cfg, build_tokenizer(), 32, seed=0)
    assert train.stats["records_skipped"] == {"wrong_type": 4, "unknown_role": 1, "unknown_format": 2}
    assert train.stats["records_used"] == 1


def test_truncation_past_every_label_is_no_trainable_token(tmp_path):
    """The line names the record's length and, besides skipping, a train.seq_len that holds it (the new-user
    trial's line offered data.on_bad_record=skip alone)."""
    short, long = (json.dumps({"prompt": p, "response": "y"}).encode() for p in ("x", "x" * 40))
    with pytest.raises(DataError) as e:
        build(tmp_path, [short, long])
    assert str(e.value) == (
        f"{tmp_path / 'data.jsonl'}:2: no token carries loss (data.train_on=assistant) within train.seq_len=32 "
        "(43 tokens); raise train.seq_len to at least 43 (e.g. train.seq_len=64), fix the record or set "
        "data.on_bad_record=skip"
    )
    train = build(tmp_path, [short, long], on_bad_record="skip")
    assert train.stats["records_skipped"] == {"no_trainable_token": 1}


def test_num_proc_workers_keep_the_fix_in_the_line(tmp_path):
    """Records tokenized in data.num_proc workers: the line is the one a single process gives, the train.seq_len
    that holds the record included."""
    short, long = (json.dumps({"prompt": p, "response": "y"}).encode() for p in ("x", "x" * 40))
    with pytest.raises(DataError) as one:
        build(tmp_path, [short, long])
    with pytest.raises(DataError) as two:
        build(tmp_path, [short, long], num_proc=2, cache_dir=str(tmp_path / "other"))
    assert "raise train.seq_len to at least 43" in str(one.value)
    assert str(two.value) == str(one.value)


def test_a_template_that_refuses_a_record_names_data_chat_template(tmp_path):
    """Templates refuse records they cannot render (Mixtral's: roles must alternate, no system turn): the record is
    often right and the template the thing to change."""
    template = tmp_path / "no_system.jinja"
    template.write_text(
        "{%- for m in messages %}{%- if m.role == 'system' %}{{ raise_exception('System role not supported') }}"
        "{%- endif %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
    )
    system = json.dumps({"messages": [{"role": "system", "content": "s"}, USER, {"role": "assistant", "content": "a"}]})
    with pytest.raises(DataError) as e:
        build(tmp_path, [GOOD, system.encode()], chat_template=str(template))
    assert str(e.value) == (
        f"{tmp_path / 'data.jsonl'}:2: the chat template refused it: System role not supported; give "
        "data.chat_template=<jinja file> that renders such records, fix the record or set data.on_bad_record=skip"
    )


def test_builtin_records_that_do_not_fit_are_skipped(tmp_path):
    cfg = DataConfig(num_samples=64, cache_dir=str(tmp_path))
    train, _ = build_datasets(cfg, build_tokenizer(), 32, seed=0)  # additions fit; the other questions do not
    assert 0 < train.stats["records_skipped"]["no_trainable_token"] < 64
    assert train.stats["records_used"] + train.stats["records_skipped"]["no_trainable_token"] == 64


def test_nothing_usable_is_one_line(tmp_path):
    with pytest.raises(DataError, match=r"data\.jsonl: no usable records \(1 read, skipped invalid_json: 1\)"):
        build(tmp_path, [b"{"], on_bad_record="skip")


def test_a_step_without_label_tokens_is_not_nan(tmp_path):
    from moe_tune.cli.train import compose, to_config
    from moe_tune.distributed.process_group import destroy_distributed
    from moe_tune.train import Trainer

    overrides = ["train.seq_len=32", "train.micro_batch_size=2", "data.num_samples=32", "train.precision=fp32"]
    cfg = to_config(
        compose([f"output_dir={tmp_path}", "checkpoint.export_hf=false", f"data.cache_dir={tmp_path}", *overrides])
    )
    try:
        trainer = Trainer(cfg)
        ids = torch.randint(4, 90, (4, 32))
        trainer.data = PackedDataset(ids, torch.full_like(ids, -100), torch.arange(32).expand(4, 32), seed=0)
        out = trainer.train_step(0)
        assert float(out["loss"]) == 0.0 and torch.isfinite(out["grad_norm"])
    finally:
        destroy_distributed()


def test_no_trainable_token_anywhere_names_train_seq_len(tmp_path):
    """Every record cut before its first label (train.seq_len too small): the fix named is the row length."""
    record = json.dumps({"prompt": "1234567890" * 4, "response": "x"}).encode()
    with pytest.raises(DataError, match=r"within train\.seq_len=32: raise train\.seq_len or check data\.train_on"):
        build(tmp_path, [record, record], on_bad_record="skip")


def test_a_lone_surrogate_escape_is_a_bad_line(tmp_path):
    """JSON's \\ud800 alone (half of a UTF-16 pair, left by a cut emoji) parses to no Unicode text: named like bad
    UTF-8, not a tokenizer's TypeError; a whole pair (an emoji written with ensure_ascii) is a character."""
    lone = b'{"messages": [{"role": "user", "content": "cut \\ud83d here"}, {"role": "assistant", "content": "a"}]}'
    with pytest.raises(DataError) as e:
        build(tmp_path, [GOOD, lone])
    assert str(e.value) == (
        f"{tmp_path / 'data.jsonl'}:2: not valid UTF-8 (\\ud83d: half of a UTF-16 surrogate pair, no character); "
        "fix the line or set data.on_bad_record=skip"
    )
    assert build(tmp_path, [GOOD, lone], on_bad_record="skip").stats["records_skipped"] == {"invalid_utf8": 1}
    pair = json.dumps({"messages": [USER, {"role": "assistant", "content": "\U0001f600"}]}).encode()
    assert b"\\ud83d\\ude00" in pair and build(tmp_path, [GOOD, pair]).stats["records_used"] == 2


def test_json_nested_past_the_parsers_depth_is_a_bad_line(tmp_path):
    """A line nested 100,000 deep made json's C parser raise RecursionError, which no data.on_bad_record caught: it
    is invalid JSON like any other, named by file:line, and skipped under skip (a JSON array file: dropped whole)."""
    deep = b"[" * 100_000 + b"]" * 100_000
    with pytest.raises(DataError) as e:
        build(tmp_path, [GOOD, deep, GOOD])
    assert str(e.value).startswith(f"{tmp_path / 'data.jsonl'}:2: not readable JSON (nested more than about ")
    assert str(e.value).endswith("levels deep); fix the line or set data.on_bad_record=skip")
    train = build(tmp_path, [GOOD, deep, GOOD], on_bad_record="skip")
    assert train.stats["records_skipped"] == {"invalid_json": 1} and train.stats["records_used"] == 2
    array = tmp_path / "array.json"
    array.write_bytes(b"[" + deep + b"]")
    cfg = DataConfig(name="jsonl", path=str(array), num_samples=0, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(DataError, match=r"array\.json: not readable JSON .*; the whole JSON array is dropped\)"):
        build_datasets(cfg, build_tokenizer(), 32, seed=0)
    tools = json.dumps({**json.loads(GOOD), "tools": deep.decode()}).encode()  # tools held as a JSON string
    with pytest.raises(DataError) as e:
        build(tmp_path, [GOOD, tools])
    assert str(e.value) == (
        f"{tmp_path / 'data.jsonl'}:2: tools is a string nested too deep to read as JSON; fix the record or set "
        "data.on_bad_record=skip"
    )


def test_an_image_content_part_is_named(tmp_path):
    """OpenAI's content parts: text ones are joined (test_formats.py); another type is one line naming it."""
    image = {"role": "user", "content": [{"type": "text", "text": "what is this?"}, {"type": "image_url"}]}
    with pytest.raises(DataError) as e:
        build(tmp_path, [GOOD, json.dumps({"messages": [image, {"role": "assistant", "content": "a"}]}).encode()])
    assert str(e.value) == (
        f"{tmp_path / 'data.jsonl'}:2: messages[0].content[1] is 'image_url' content; content parts must be text "
        '({"type": "text", "text": ...}): moe_tune trains text models; fix the record or set data.on_bad_record=skip'
    )

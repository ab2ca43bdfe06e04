"""``build_datasets`` refuses sources with nothing to train on: an empty file, a record of no known format (the
file and line named, with the fields each format needs). (Missing paths and other bad records: test_sources.py,
test_bad_records.py.)"""

from __future__ import annotations

import json

import pytest

from moe_tune.config import DataConfig, DataError
from moe_tune.data import build_datasets
from moe_tune.models.presets import build_tokenizer


def _build(tmp_path, records: list[dict], **data):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = DataConfig(path=str(path), cache_dir=str(tmp_path / "cache"), **data)
    return build_datasets(cfg, build_tokenizer(), 16, 0)


def test_an_empty_file_is_a_data_error_naming_it(tmp_path):
    with pytest.raises(DataError) as e:
        _build(tmp_path, [])
    assert (
        str(e.value)
        == f"{tmp_path / 'data.jsonl'}: no usable records (0 read, skipped none); give a source with records"
    )


def test_a_record_of_no_known_format_is_a_data_error_naming_its_line_and_keys(tmp_path):
    with pytest.raises(DataError) as e:
        _build(tmp_path, [{"question": "q", "answer": "a"}, {"text": "fine"}])
    message = str(e.value)
    assert message.startswith(f"{tmp_path / 'data.jsonl'}:1: ")
    assert "keys: ['answer', 'question']" in message and "prompt + response" in message and "text" in message
    assert "\n" not in message


CHAT = {"messages": [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "2"}]}


@pytest.mark.parametrize("on_bad_record", ["error", "skip"])
def test_a_format_given_that_the_records_are_not_names_theirs(tmp_path, on_bad_record):
    """data.format=sharegpt over chat records: the setting is at fault, not the records, so skipping them all is no
    fix; the line names the records' format. Under auto, a chat file's odd record is the record's fault."""
    with pytest.raises(DataError) as e:
        _build(tmp_path, [CHAT, CHAT], format="sharegpt", on_bad_record=on_bad_record)
    assert str(e.value) == (
        f"{tmp_path / 'data.jsonl'}:1: no 'conversations' field (keys: ['messages']): data.format=sharegpt was "
        "given, and this record is data.format=chat's; set data.format=chat, or drop data.format (auto reads each "
        "file's format off its first record)"
    )
    from moe_tune.data.records import BadRecord, normalize

    with pytest.raises(BadRecord) as bad:  # auto took chat from the file's first record
        normalize({"conversations": [{"from": "human", "value": "x"}]}, "chat", DataConfig())
    assert bad.value.reason == "missing_field"
    assert bad.value.detail == (
        "no 'messages' field (keys: ['conversations']): the file's first record made it data.format=chat, and this "
        "record is data.format=sharegpt's; one format per file (split it, or fix the record)"
    )


def test_a_null_field_is_named_null():
    from moe_tune.data.records import BadRecord, normalize

    with pytest.raises(BadRecord) as bad:
        normalize({"prompt": "p", "completion": None}, "prompt_completion", DataConfig())
    assert (bad.value.reason, bad.value.detail) == ("missing_field", "'completion' is null")


def test_records_longer_than_seq_len_are_cut_counted_and_warned_about(tmp_path, caplog):
    """A long record is cut at train.seq_len (its later tokens carry no loss): the stats count it and a warning
    says so with the fix, since a chat's later assistant turns are lost."""
    short = {"text": "1+1=2"}
    long = {"text": " ".join(["many words"] * 40)}
    with caplog.at_level("WARNING", logger="moe_tune"):
        train, _ = _build(tmp_path, [short, long, short])
    assert train.stats["records_truncated"] == 1 and train.stats["records_used"] == 3
    assert "1 of 3 records are longer than train.seq_len" in caplog.text and "raise train.seq_len" in caplog.text

"""Validation data: data.val_fraction holds out a seeded, deterministic part of the records, disjoint from the
training rows; data.val_path reads another source; ``ValDataset.batches`` covers every row exactly once over the
ranks, with the same number of batches on every rank (padding rows carry no label)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from moe_tune.config import DataConfig, DataError
from moe_tune.data import ValDataset, build_datasets
from moe_tune.distributed.dims import BatchLayout
from moe_tune.models.presets import build_tokenizer

RECORDS = [{"text": f"record {i:03d}"} for i in range(50)]


@pytest.fixture
def cfg(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return DataConfig(name="jsonl", path=str(path), num_samples=0, packing=False, cache_dir=str(tmp_path / "cache"))


def texts(data) -> list[str]:
    return build_tokenizer().batch_decode(data.ids.tolist(), skip_special_tokens=True)


def test_val_fraction_is_a_disjoint_seeded_split(cfg, caplog):
    with caplog.at_level("INFO", logger="moe_tune"):
        train, val = build_datasets(replace(cfg, val_fraction=0.2), build_tokenizer(), 32, seed=0)
    # The log counts the file's records as read once, then split (not "40 read" of a 50-record file).
    assert "data (train; data.val_fraction=0.2 held out 10 of 50 records): 40 records read" in caplog.text
    assert len(val) == 10 and len(train) == 40
    assert sorted(texts(train) + texts(val)) == [r["text"] for r in RECORDS]
    assert val.stats["records_used"] == 10 and train.stats["records_read"] == 40
    again = build_datasets(replace(cfg, val_fraction=0.2, cache_dir=cfg.cache_dir + "2"), build_tokenizer(), 32, 0)
    assert texts(again[1]) == texts(val)  # deterministic, rebuilt without the cache
    other_seed = build_datasets(replace(cfg, val_fraction=0.2), build_tokenizer(), 32, seed=1)[1]
    assert texts(other_seed) != texts(val)


def test_val_path_reads_another_source(cfg, tmp_path):
    held = tmp_path / "held.jsonl"
    held.write_text(json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}))
    train, val = build_datasets(replace(cfg, val_path=str(held)), build_tokenizer(), 32, seed=0)
    assert len(train) == len(RECORDS) and len(val) == 1 and val.stats["records_read"] == 1
    assert build_datasets(cfg, build_tokenizer(), 32, seed=0)[1] is None


def test_val_fraction_needs_two_records(cfg, tmp_path):
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps(RECORDS[0]))
    with pytest.raises(DataError, match=r"data\.val_fraction=0\.5 needs at least 2 usable records, got 1"):
        build_datasets(replace(cfg, path=str(one), val_fraction=0.5), build_tokenizer(), 32, seed=0)


@pytest.mark.parametrize("num_rows,micro_batch_size,dp_size", [(7, 2, 3), (6, 2, 3), (1, 4, 2), (5, 1, 1)])
def test_batches_cover_every_row_once(num_rows, micro_batch_size, dp_size):
    seq_len = 4
    ids = torch.arange(1, num_rows * seq_len + 1).view(num_rows, seq_len)
    val = ValDataset(ids, ids.clone(), torch.arange(seq_len).expand(num_rows, seq_len), pad_id=0)
    layout = BatchLayout(micro_batch_size, 1, dp_size)
    per_rank = [list(val.batches(layout, r, "cpu")) for r in range(dp_size)]
    expected_batches = -(-num_rows // (micro_batch_size * dp_size))
    assert [len(b) for b in per_rank] == [expected_batches] * dp_size == [val.num_batches(layout)] * dp_size
    seen = []
    for batches in per_rank:
        for ids_b, labels_b, pos in batches:
            assert ids_b.shape == (micro_batch_size, seq_len) and pos is None  # unpacked rows: no position ids
            for row_ids, row_labels in zip(ids_b, labels_b):
                if row_ids[0] == 0:  # padding
                    assert (row_labels == -100).all()
                else:
                    seen.append(int(row_ids[0]))
    assert sorted(seen) == [1 + i * seq_len for i in range(num_rows)]
    assert val.num_label_tokens == num_rows * (seq_len - 1)


def test_a_missing_val_path_is_named_as_data_val_path(cfg, tmp_path):
    """A wrong data.val_path was reported as ``data.path=<it> does not exist`` (new-user trial)."""
    missing = tmp_path / "nonexist.jsonl"
    with pytest.raises(DataError, match=rf"^data\.val_path={missing} does not exist"):
        build_datasets(replace(cfg, val_path=str(missing)), build_tokenizer(), 32, seed=0)

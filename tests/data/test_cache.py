"""The tokenization cache: a second build reads the entry without tokenizing; a changed file, chat template or
tokenizer makes a new entry; data.num_proc workers give the same rows; with a process group only rank 0
tokenizes and the other rank reads what it wrote."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest
import torch

from moe_tune.config import DataConfig
from moe_tune.data import build_datasets
from moe_tune.data.encode import Encoder
from moe_tune.models.presets import build_tokenizer
from tests.harness import run_ranks

CHATS = [
    {"messages": [{"role": "user", "content": f"{i}*3="}, {"role": "assistant", "content": str(3 * i)}]}
    for i in range(24)
]


@pytest.fixture
def cfg(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in CHATS))
    return DataConfig(name="jsonl", path=str(path), num_samples=0, cache_dir=str(tmp_path / "cache"))


def entries(cfg) -> list[str]:
    return sorted(n for n in os.listdir(cfg.cache_dir) if n.endswith(".pt"))


def build(cfg, tokenizer=None):
    train, _ = build_datasets(cfg, tokenizer or build_tokenizer(), 64, seed=0)
    return torch.stack([train.ids, train.labels, train.positions])


@pytest.mark.parametrize("num_proc", [1, 2])
def test_what_the_template_checks_said_is_said_again_from_the_cache(cfg, caplog, capfd, num_proc):
    """The CLI tokenizes while checking the records, its log quiet, and the run reads that entry: a warning about
    the chat template (its end-of-turn token outside the assistant mask) was said by neither. It is kept with the
    entry and said again by a build that reads it. With data.num_proc workers each worker's encoder notes it; the
    main process says it once (the workers wrote it to stderr, twice, and the entry kept none)."""
    import logging

    cfg = replace(cfg, num_proc=num_proc)

    tokenizer = build_tokenizer()
    tokenizer.chat_template = tokenizer.chat_template.replace(
        "{{- '<|im_end|>\\n' -}}{%- endgeneration -%}", "{%- endgeneration -%}{{- '<|im_end|>\\n' -}}"
    )
    assert "{%- endgeneration -%}{{- '<|im_end|>" in tokenizer.chat_template
    said = []
    for _ in range(2):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="moe_tune"):
            build(cfg, tokenizer)
        said.append([r.getMessage() for r in caplog.records if r.levelno == logging.WARNING])
    assert len(entries(cfg)) == 1
    for warnings in said:
        assert len(warnings) == 1 and "end-of-turn token <|im_end|> falls outside the assistant mask" in warnings[0]
    assert "assistant mask" not in capfd.readouterr().err  # no worker said it itself


def test_a_note_from_a_workers_last_row_travels_back(cfg, caplog, tmp_path):
    """Each of two data.num_proc workers encodes one record: the note its only (last) row made comes back with that
    row, is said once and kept with the entry."""
    import logging

    path = tmp_path / "two.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in CHATS[:2]))
    cfg = replace(cfg, path=str(path), num_proc=2)
    tokenizer = build_tokenizer()
    tokenizer.chat_template = tokenizer.chat_template.replace(
        "{{- '<|im_end|>\\n' -}}{%- endgeneration -%}", "{%- endgeneration -%}{{- '<|im_end|>\\n' -}}"
    )
    for _ in range(2):  # tokenized in the workers, then read from the cache
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="moe_tune"):
            build(cfg, tokenizer)
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "falls outside the assistant mask" in warnings[0]


@pytest.fixture
def count_encodes(monkeypatch):
    calls = []
    encode = Encoder.__call__
    monkeypatch.setattr(Encoder, "__call__", lambda self, sample: calls.append(1) or encode(self, sample))
    return calls


def test_second_build_reads_the_cache(cfg, count_encodes):
    first = build(cfg)
    assert len(count_encodes) == len(CHATS)
    (entry,) = entries(cfg)
    mtime = os.stat(os.path.join(cfg.cache_dir, entry)).st_mtime_ns
    count_encodes.clear()
    assert torch.equal(build(cfg), first)
    assert count_encodes == [] and entries(cfg) == [entry]
    assert os.stat(os.path.join(cfg.cache_dir, entry)).st_mtime_ns == mtime


def test_changes_make_a_new_entry(cfg, tmp_path, count_encodes):
    build(cfg)
    with open(cfg.path, "a") as f:  # the file changes
        f.write(json.dumps(CHATS[0]) + "\n")
    build(cfg)
    template = tmp_path / "t.jinja"  # another chat template
    template.write_text(
        "{%- for m in messages -%}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}"
        "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
    )
    build(replace(cfg, chat_template=str(template)))
    tokenizer = build_tokenizer()  # another tokenizer: one more token
    tokenizer.add_tokens(["<|extra|>"])
    build(cfg, tokenizer)
    assert len(entries(cfg)) == 4
    assert len(count_encodes) == len(CHATS) + 3 * (len(CHATS) + 1)  # the later builds read the longer file


def test_num_proc_workers_give_the_same_rows(cfg, tmp_path, monkeypatch):
    """Also: the workers are not forked from this (threaded) process but from a forkserver; forked, they could
    inherit a held lock and hang (the suite did, twice)."""
    import datasets
    import multiprocess

    one = build(cfg)
    methods, map_ = [], datasets.Dataset.map
    monkeypatch.setattr(
        datasets.Dataset, "map", lambda *a, **k: methods.append(multiprocess.get_start_method()) or map_(*a, **k)
    )
    assert torch.equal(build(replace(cfg, num_proc=2, cache_dir=str(tmp_path / "other"))), one)
    assert methods == ["forkserver"]


def _rank(rank: int, cfg, out_dir: str) -> None:
    calls = []
    encode = Encoder.__call__
    Encoder.__call__ = lambda self, sample: calls.append(1) or encode(self, sample)
    rows = build(cfg)
    torch.save({"calls": len(calls), "rows": rows}, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.dist
def test_rank0_tokenizes_and_the_other_rank_reads(cfg, tmp_path):
    run_ranks(_rank, 2, cfg, str(tmp_path))
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert (r0["calls"], r1["calls"]) == (len(CHATS), 0)
    assert torch.equal(r0["rows"], r1["rows"]) and len(entries(cfg)) == 1


def test_no_lock_file_is_left(cfg):
    """Every build (the CLI's record check and the run each build) left a <key>.pt.lock beside its entry."""
    build(cfg)
    build(cfg)
    assert sorted(os.listdir(cfg.cache_dir)) == entries(cfg)


def test_a_second_builder_of_an_entry_waits_and_reads_the_first_ones(tmp_path):
    """The lock that serialises independent processes still does (threads here: each opens the lock file itself,
    so their flocks exclude each other as two processes' would), and is gone once both are done."""
    import threading

    from moe_tune.data.cache import cached

    holding, release, order = threading.Event(), threading.Event(), []

    def first() -> dict:
        holding.set()
        release.wait(30)
        order.append("first built")
        return {"x": torch.ones(2)}

    def second() -> dict:
        order.append("second built")
        return {"x": torch.zeros(2)}

    out = {}
    a = threading.Thread(target=lambda: out.setdefault("a", cached(str(tmp_path), "k", first)))
    a.start()
    assert holding.wait(30)
    b = threading.Thread(target=lambda: out.setdefault("b", cached(str(tmp_path), "k", second)))
    b.start()
    b.join(0.5)
    assert b.is_alive() and os.path.exists(tmp_path / "k.pt.lock")  # waiting on the first builder's lock
    release.set()
    a.join(30)
    b.join(30)
    assert order == ["first built"] and torch.equal(out["b"]["x"], torch.ones(2))
    assert os.listdir(tmp_path) == ["k.pt"]

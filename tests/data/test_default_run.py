"""The default `moe-tune` run trains on the built-in chat records through the tokenizer's ChatML template, and a
second run reads their tokens from the cache (the run in process: harness.run_main)."""

from __future__ import annotations

import json
import os

from tests.harness import run_main


def test_default_run_trains_on_chat_records(tmp_path):
    cache = tmp_path / "cache"
    run = ["train.steps=3", f"data.cache_dir={cache}", "checkpoint.export_hf=false"]
    out = run_main([*run, f"output_dir={tmp_path / 'a'}"])
    assert out.returncode == 0, out.stderr[-3000:]
    log = out.stdout + out.stderr
    assert "data (train): 4096 records read, 4096 used" in log, log[-3000:]
    rows = [json.loads(line) for line in open(tmp_path / "a" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["loss"] > 0 for r in rows)
    stats = json.load(open(tmp_path / "a" / "summary.json"))["data_stats"]
    assert stats["train"]["records_used"] == 4096 and stats["train"]["records_skipped"] == {} and stats["val"] is None
    entries = lambda: sorted(n for n in os.listdir(cache) if n.endswith(".pt"))  # noqa: E731
    (entry,) = entries()

    from moe_tune.config import DataConfig
    from moe_tune.data import build_datasets
    from moe_tune.models.presets import build_tokenizer

    tokenizer = build_tokenizer()
    train, _ = build_datasets(DataConfig(cache_dir=str(cache)), tokenizer, 256, seed=0)  # the run's entry, read
    assert entries() == [entry]
    text = tokenizer.decode(train.ids[0])
    assert text.startswith("<|im_start|>") and "<|im_end|>\n<|im_start|>assistant\n" in text

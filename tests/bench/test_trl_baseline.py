"""The TRL SFTTrainer row (``--baselines trl``), run for real on the CPU: a tiny model, a small generated chat set."""

from __future__ import annotations

import json
import math
import random

import pytest

from moe_tune.bench.plans import build_plans
from moe_tune.bench.runner import Row, read_run
from moe_tune.cli.train import compose, to_config

SEQ_LEN = 128


def write_chats(path, num_records: int = 24, seed: int = 0) -> None:
    """Chat records of one or two turns, 15-110 characters each (one token per character with the built-in
    tokenizer, plus ChatML's few per message): rows of 128 that bfd cannot all fill."""
    rng = random.Random(seed)
    words = lambda n: "".join(rng.choice("abcdefgh ") for _ in range(n)).strip() or "a"  # noqa: E731
    with open(path, "w") as f:
        for _ in range(num_records):
            messages = []
            for _ in range(rng.choice((1, 2))):
                messages += [{"role": "user", "content": words(rng.randint(5, 20))}]
                messages += [{"role": "assistant", "content": words(rng.randint(10, 50))}]
            f.write(json.dumps({"messages": messages}) + "\n")


def workload(tmp_path, steps: int):
    data = tmp_path / "chat.jsonl"
    if not data.exists():
        write_chats(data)
    overrides = ["model=tiny_qwen3_moe", "+model.overrides.num_hidden_layers=2", f"train.seq_len={SEQ_LEN}"]
    overrides += ["train.micro_batch_size=1", "train.precision=bf16", "train.warmup_steps_excluded=0"]
    overrides += [f"train.steps={steps}", f"data.path={data}", f"output_dir={tmp_path / 'run'}"]
    return to_config(compose(overrides))


def test_the_trl_row_counts_the_real_tokens_of_the_rows_trl_packed(tmp_path):
    """One epoch at micro-batch 1 feeds every packed row once: the steps' real tokens are the packed rows' lengths
    (none padding), the row positions the row length; losses finite, one per step; the benchmark reads the row."""
    import datasets
    import trl

    from moe_tune.bench.trl_baseline import encoded_records, run
    from moe_tune.models.presets import build_tokenizer

    samples, _ = encoded_records(workload(tmp_path, 1), build_tokenizer())
    ids = {"input_ids": [s[0] for s in samples], "labels": [s[1] for s in samples]}
    packed = [len(r) for r in trl.pack_dataset(datasets.Dataset.from_dict(ids), SEQ_LEN, "bfd")["input_ids"]]
    assert min(packed) < SEQ_LEN and len(packed) > 4  # rows with room left: counting positions would show

    trainer = run(workload(tmp_path, len(packed)), attn="sdpa")

    assert [len(r) for r in trainer.train_dataset["input_ids"]] == packed  # the rows TRL trained on
    metrics = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == list(range(1, len(packed) + 1))
    assert sorted(m["real_tokens"] for m in metrics) == sorted(packed)
    assert sum(m["real_tokens"] for m in metrics) == sum(len(s[0]) for s in samples)
    assert all(m["row_positions"] == SEQ_LEN for m in metrics)
    assert [m["row_fill"] for m in metrics] == [m["real_tokens"] / SEQ_LEN for m in metrics]
    assert all(math.isfinite(m["loss"]) and m["loss"] > 0 for m in metrics)
    # moe_tune logs the cross-entropy alone: TRL's loss less its balancing term (train.aux_loss_coef 0.001).
    assert all(m["loss"] == pytest.approx(m["trl_loss"] - 0.001 * m["aux_loss"]) for m in metrics)
    assert all(m["aux_loss"] > 0 for m in metrics)

    row = Row("trl", "baseline")
    assert read_run(row, str(tmp_path / "run"))
    assert row.losses == [m["loss"] for m in metrics] and row.final_loss == metrics[-1]["loss"]
    assert row.config["kernels"].startswith(f"trl {trl.__version__} SFTTrainer") and row.config["fsdp"] == "none"
    assert row.tokens_per_s_per_gpu > 0 and row.row_fill < 1.0


def test_without_trl_the_bench_names_the_extra_to_install(monkeypatch):
    import argparse
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "trl" else find_spec(name, *a))
    args = argparse.Namespace(baselines="trl", variants="none", peer="none", trl_attn="auto")
    plans, skipped = build_plans(args, [])
    assert plans == [] and skipped == [
        {"variant": "trl", "kind": "baseline", "reason": "trl is not installed: pip install 'moe_tune[trl]'"}
    ]


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["train.precision=bf16_fp32_master"], "train.precision=bf16_fp32_master: the TRL row"),
        (["data.path=null"], "the TRL row trains on records"),
    ],
)
def test_a_workload_the_trl_row_cannot_run_stops_the_bench_before_any_row(tmp_path, capsys, overrides, words):
    from moe_tune.cli.bench import main

    data = tmp_path / "chat.jsonl"
    write_chats(data, 2)
    argv = ["model=tiny_qwen3_moe", "train.precision=bf16", f"data.path={data}", *overrides]
    assert main([*argv, "--baselines", "trl", "--variants", "none", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moe-tune-bench: error: trl: ") and words in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()

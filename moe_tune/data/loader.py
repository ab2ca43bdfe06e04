"""Tokenize, mask and pack samples; hand each data-parallel rank its own rows, deterministically."""

from __future__ import annotations

import json
import os

import torch

from moe_tune.config import ConfigError, DataConfig, DataError
from moe_tune.data.packing import PackedDataset, ValDataset, pack_rows, random_dataset


def read_samples(cfg: DataConfig, seed: int) -> list[dict]:
    if cfg.path is None:
        if cfg.name != "arithmetic":
            raise ConfigError(f"data={cfg.name!r} is not built in (arithmetic); or set data.path=<jsonl|parquet|dir>")
        from moe_tune.data.builtin import arithmetic_samples

        return arithmetic_samples(cfg.num_samples, seed)
    paths = _data_files(cfg.path)
    rows: list[dict] = []
    for p in paths:
        if p.endswith(".parquet"):
            try:
                import pyarrow.parquet as pq
            except ImportError as e:
                raise DataError(f"data.path={p} is parquet; install pyarrow (pip install pyarrow)") from e
            rows.extend(pq.read_table(p).to_pylist())
        else:
            with open(p) as f:
                rows.extend(json.loads(line) for line in f if line.strip())
    if not rows:
        raise DataError(f"data.path={cfg.path} holds no samples")
    return rows


def _data_files(path: str) -> list[str]:
    if os.path.isdir(path):
        files = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith((".jsonl", ".json", ".parquet")))
    elif os.path.isfile(path):
        files = [path]
    else:
        raise DataError(f"data.path={path} does not exist; give a .jsonl or .parquet file or a directory of them")
    if not files:
        raise DataError(f"data.path={path} has no .jsonl or .parquet files")
    return files


def tokenize(sample: dict, tokenizer, cfg: DataConfig) -> tuple[list[int], list[int]]:
    """Returns (ids, labels): bos + prompt + response + eos, prompt positions labelled -100 if masked."""
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    if cfg.prompt_key in sample and cfg.response_key in sample:
        prompt = bos + tokenizer(sample[cfg.prompt_key], add_special_tokens=False).input_ids
        response = tokenizer(sample[cfg.response_key], add_special_tokens=False).input_ids + eos
        prompt_labels = list(prompt) if cfg.train_on == "all" else [-100] * len(prompt)
        return prompt + response, prompt_labels + response
    if cfg.text_key in sample:
        ids = bos + tokenizer(sample[cfg.text_key], add_special_tokens=False).input_ids + eos
        return ids, list(ids)
    raise DataError(
        f"a data sample has neither {cfg.prompt_key!r}/{cfg.response_key!r} nor {cfg.text_key!r} "
        f"(keys: {sorted(sample)}); set data.prompt_key/response_key/text_key"
    )


def build_datasets(
    cfg: DataConfig, tokenizer, seq_len: int, seed: int, vocab_size: int | None = None
) -> tuple[PackedDataset, ValDataset | None]:
    """The training set and the validation set (None without data.val_path / data.val_fraction).

    train: ``micro_batch(step, micro, micro_batch_size, accum, dp_rank, dp_size, device)`` -> (ids, labels,
    position ids or None), the same rows for a step on every run (resume is exact).
    val: ``ValDataset``: ``batches(micro_batch_size, dp_rank, dp_size, device)`` covers every val row exactly once
    over the ranks, the same number of batches on every rank (padding rows have labels -100);
    ``num_batches(micro_batch_size, dp_size)``, ``num_label_tokens``.
    Both carry ``stats`` (records read/used, skipped per reason, tokens, rows) for summary.json."""
    if cfg.name == "random" and cfg.path is None:
        return random_dataset(max(cfg.num_samples, 1), seq_len, vocab_size or len(tokenizer), seed), None
    records = read_samples(cfg, seed)
    val_records: list[dict] = []
    if cfg.val_path is not None:
        from dataclasses import replace

        val_records = read_samples(replace(cfg, path=cfg.val_path), seed)
    elif cfg.val_fraction > 0:
        g = torch.Generator().manual_seed(seed)
        order = torch.randperm(len(records), generator=g).tolist()
        num_val = max(1, round(len(records) * cfg.val_fraction))
        val_idx = set(order[:num_val])
        val_records = [r for i, r in enumerate(records) if i in val_idx]
        records = [r for i, r in enumerate(records) if i not in val_idx]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    train = PackedDataset(*pack_rows((tokenize(s, tokenizer, cfg) for s in records), seq_len, pad, cfg.packing), seed)
    if not val_records:
        return train, None
    val = ValDataset(*pack_rows((tokenize(s, tokenizer, cfg) for s in val_records), seq_len, pad, cfg.packing), pad)
    return train, val


def build_dataset(cfg: DataConfig, tokenizer, seq_len: int, seed: int, vocab_size: int | None = None) -> PackedDataset:
    """The training set of ``build_datasets``."""
    return build_datasets(cfg, tokenizer, seq_len, seed, vocab_size)[0]

"""Tokenize, mask and pack samples; hand each data-parallel rank its own rows, deterministically."""

from __future__ import annotations

import json
import os

import torch

from moe_tune.config import ConfigError, DataConfig, DataError


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


class PackedDataset:
    """Fixed rows of ``seq_len`` tokens. Samples are packed back to back (position ids restart at each
    sample) or, with ``packing=False``, one per row padded with -100 labels. Row order is shuffled by
    epoch with a fixed seed, so every rank agrees on the order and resuming at a step is exact."""

    def __init__(self, ids: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor, seed: int):
        self.ids, self.labels, self.positions, self.seed = ids, labels, positions, seed
        self._perm: tuple[int, torch.Tensor] | None = None

    def __len__(self) -> int:
        return self.ids.shape[0]

    def rows(self, step: int, micro: int, micro_batch_size: int, accum: int, dp_rank: int, dp_size: int):
        """The rows of micro-batch ``micro`` of optimizer step ``step`` for data-parallel rank ``dp_rank``."""
        per_step = micro_batch_size * accum * dp_size
        start = step * per_step + (micro * dp_size + dp_rank) * micro_batch_size
        idx = [self._row(start + i) for i in range(micro_batch_size)]
        return self.ids[idx], self.labels[idx], self.positions[idx]

    def micro_batch(self, step: int, micro: int, micro_batch_size: int, accum: int, dp_rank: int, dp_size: int, device):
        """``rows`` on ``device``, with position ids only for packed rows: rows that hold one sequence each
        pass None, so transformers does not look for packed sequences on the device (a host sync per
        forward). Decided here, on the CPU tensors."""
        ids, labels, pos = self.rows(step, micro, micro_batch_size, accum, dp_rank, dp_size)
        if torch.equal(pos, torch.arange(pos.shape[1]).expand_as(pos)):
            pos = None
        to = lambda x: None if x is None else x.to(device, non_blocking=True)  # noqa: E731
        return to(ids), to(labels), to(pos)

    def _row(self, i: int) -> int:
        epoch, j = divmod(i, len(self))
        if self._perm is None or self._perm[0] != epoch:
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._perm = (epoch, torch.randperm(len(self), generator=g))
        return int(self._perm[1][j])


def random_dataset(num_rows: int, seq_len: int, vocab_size: int, seed: int) -> PackedDataset:
    """Uniform random tokens over the whole vocabulary, every position labelled: the benchmark workload
    (routing is then decided by the model's weights, not by a small tokenizer's few ids)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (num_rows, seq_len), generator=g)
    return PackedDataset(ids, ids.clone(), torch.arange(seq_len).expand(num_rows, seq_len).clone(), seed)


def build_dataset(cfg: DataConfig, tokenizer, seq_len: int, seed: int, vocab_size: int | None = None) -> PackedDataset:
    if cfg.name == "random" and cfg.path is None:
        return random_dataset(max(cfg.num_samples, 1), seq_len, vocab_size or len(tokenizer), seed)
    samples = [tokenize(s, tokenizer, cfg) for s in read_samples(cfg, seed)]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    rows_ids, rows_labels, rows_pos = [], [], []
    cur_ids: list[int] = []
    cur_labels: list[int] = []
    cur_pos: list[int] = []

    def flush():
        n = seq_len - len(cur_ids)
        rows_ids.append(cur_ids + [pad] * n)
        rows_labels.append(cur_labels + [-100] * n)
        rows_pos.append(cur_pos + list(range(n)))

    for ids, labels in samples:
        ids, labels = ids[:seq_len], labels[:seq_len]
        if cur_ids and (not cfg.packing or len(cur_ids) + len(ids) > seq_len):
            flush()
            cur_ids, cur_labels, cur_pos = [], [], []
        cur_ids += ids
        cur_labels += labels
        cur_pos += list(range(len(ids)))
    if cur_ids:
        flush()
    as_t = lambda rows: torch.tensor(rows, dtype=torch.long)  # noqa: E731
    return PackedDataset(as_t(rows_ids), as_t(rows_labels), as_t(rows_pos), seed)

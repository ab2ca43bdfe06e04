"""Rows of ``seq_len`` tokens from tokenized samples, and the two ways the trainer reads them: ``PackedDataset``
(training: micro-batches by step, shuffled per epoch) and ``ValDataset`` (evaluation: every row once)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

IGNORE = -100  # label of a position that carries no loss (transformers' convention)


class RowPacker:
    """Packs (ids, labels) samples into rows of ``seq_len``: back to back with position ids restarting at each
    sample (``packing=True``), or one sample per row. Rows are padded with ``pad_id`` and IGNORE labels. A sample
    longer than ``seq_len`` is cut to ``seq_len`` (the caller counts it)."""

    def __init__(self, seq_len: int, pad_id: int, packing: bool):
        self.seq_len, self.pad_id, self.packing = seq_len, pad_id, packing
        self.ids: list[int] = []
        self.labels: list[int] = []
        self.pos: list[int] = []

    def add(self, ids: list[int], labels: list[int]) -> list[tuple[list[int], list[int], list[int]]]:
        """Adds one sample; returns the rows it completed (zero or one)."""
        ids, labels = ids[: self.seq_len], labels[: self.seq_len]
        out = []
        if self.ids and (not self.packing or len(self.ids) + len(ids) > self.seq_len):
            out.append(self.flush())
        self.ids += ids
        self.labels += labels
        self.pos += range(len(ids))
        return out

    def flush(self) -> tuple[list[int], list[int], list[int]]:
        n = self.seq_len - len(self.ids)
        row = (self.ids + [self.pad_id] * n, self.labels + [IGNORE] * n, self.pos + list(range(n)))
        self.ids, self.labels, self.pos = [], [], []
        return row

    def pending(self) -> bool:
        return bool(self.ids)


def pack_rows(samples: Iterable[tuple[list[int], list[int]]], seq_len: int, pad_id: int, packing: bool):
    """(ids, labels, positions) LongTensors of shape [rows, seq_len] holding every sample."""
    packer = RowPacker(seq_len, pad_id, packing)
    rows = [row for ids, labels in samples for row in packer.add(ids, labels)]
    if packer.pending():
        rows.append(packer.flush())
    if not rows:
        empty = torch.zeros((0, seq_len), dtype=torch.long)
        return empty, empty.clone(), empty.clone()
    ids, labels, pos = (torch.tensor(list(col), dtype=torch.long) for col in zip(*rows))
    return ids, labels, pos


def to_device(ids: torch.Tensor, labels: torch.Tensor, pos: torch.Tensor, device):
    """The batch on ``device``, with position ids only for packed rows: rows that hold one sequence each pass
    None, so transformers does not look for packed sequences on the device (a host sync per forward). Decided
    here, on the CPU tensors."""
    if torch.equal(pos, torch.arange(pos.shape[1]).expand_as(pos)):
        pos = None
    to = lambda x: None if x is None else x.to(device, non_blocking=True)  # noqa: E731
    return to(ids), to(labels), to(pos)


class MicroBatches:
    """The row layout every training set shares: micro-batch ``micro`` of optimizer step ``step`` on data-parallel
    rank ``dp_rank`` holds the global rows ``row_indices(...)``, so the rows of a step depend on the step alone (an
    exact resume) and the ranks' rows together are the step's. Subclasses give ``rows(...)`` -> CPU tensors."""

    # The data.chat_template text the chat records were rendered with (None: the tokenizer's own, or no chat
    # records): the exported model carries it, so inference formats prompts as training did.
    chat_template: str | None = None

    @staticmethod
    def row_indices(step: int, micro: int, micro_batch_size: int, accum: int, dp_rank: int, dp_size: int) -> range:
        per_step = micro_batch_size * accum * dp_size
        start = step * per_step + (micro * dp_size + dp_rank) * micro_batch_size
        return range(start, start + micro_batch_size)

    def micro_batch(self, step: int, micro: int, micro_batch_size: int, accum: int, dp_rank: int, dp_size: int, device):
        """``rows`` on ``device`` as (ids, labels, position ids or None); see ``to_device``."""
        return to_device(*self.rows(step, micro, micro_batch_size, accum, dp_rank, dp_size), device)


class PackedDataset(MicroBatches):
    """Fixed rows of ``seq_len`` tokens in memory. Row order is shuffled by epoch with a fixed seed, so every
    rank agrees on the order and resuming at a step is exact (the rows of a step depend on the step only).

    ``stats``: what building it read and kept (records read/used, skipped per reason, tokens, rows)."""

    def __init__(self, ids: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor, seed: int, stats=None):
        self.ids, self.labels, self.positions, self.seed = ids, labels, positions, seed
        self.stats: dict = dict(stats or {"rows": int(ids.shape[0])})
        self._perm: tuple[int, torch.Tensor] | None = None

    def __len__(self) -> int:
        return self.ids.shape[0]

    def rows(self, step: int, micro: int, micro_batch_size: int, accum: int, dp_rank: int, dp_size: int):
        """The rows of micro-batch ``micro`` of optimizer step ``step`` for data-parallel rank ``dp_rank``."""
        idx = [self._row(i) for i in self.row_indices(step, micro, micro_batch_size, accum, dp_rank, dp_size)]
        return self.ids[idx], self.labels[idx], self.positions[idx]

    def _row(self, i: int) -> int:
        epoch, j = divmod(i, len(self))
        if self._perm is None or self._perm[0] != epoch:
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._perm = (epoch, torch.randperm(len(self), generator=g))
        return int(self._perm[1][j])


class ValDataset:
    """Held-out rows for evaluation, in a fixed order (no shuffle).

    ``batches(micro_batch_size, dp_rank, dp_size, device)`` yields (ids, labels, position ids or None) batches of
    ``micro_batch_size`` rows; over all ranks every row comes exactly once. Every rank yields the same number of
    batches, ``num_batches(micro_batch_size, dp_size)``: the rows past the end are padding whose labels are all
    -100 (they add nothing to a loss sum or a token count, so reduce sums of token losses and of label tokens
    over ranks, then divide). Batch b of rank r holds rows ``(b * dp_size + r) * micro_batch_size + i``.

    ``stats`` as ``PackedDataset.stats``; ``num_label_tokens``: label tokens over all rows (the count a per-token
    mean divides by, with the causal shift: labels[:, 1:] != -100)."""

    def __init__(self, ids: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor, pad_id: int, stats=None):
        self.ids, self.labels, self.positions, self.pad_id = ids, labels, positions, pad_id
        self.stats: dict = dict(stats or {"rows": int(ids.shape[0])})
        self.num_label_tokens = int((labels[:, 1:] != IGNORE).sum())

    def __len__(self) -> int:
        return self.ids.shape[0]

    def num_batches(self, micro_batch_size: int, dp_size: int) -> int:
        per_batch = micro_batch_size * dp_size
        return -(-len(self) // per_batch)

    def batches(self, micro_batch_size: int, dp_rank: int, dp_size: int, device) -> Iterator[tuple]:
        seq_len = self.ids.shape[1]
        for b in range(self.num_batches(micro_batch_size, dp_size)):
            start = (b * dp_size + dp_rank) * micro_batch_size
            idx = list(range(start, min(start + micro_batch_size, len(self))))
            ids, labels, pos = self.ids[idx], self.labels[idx], self.positions[idx]
            missing = micro_batch_size - len(idx)
            if missing:  # padding rows: nothing to predict
                ids = torch.cat([ids, torch.full((missing, seq_len), self.pad_id, dtype=torch.long)])
                labels = torch.cat([labels, torch.full((missing, seq_len), IGNORE, dtype=torch.long)])
                pos = torch.cat([pos, torch.arange(seq_len).expand(missing, seq_len)])
            yield to_device(ids, labels, pos, device)


def random_dataset(num_rows: int, seq_len: int, vocab_size: int, seed: int) -> PackedDataset:
    """Uniform random tokens over the whole vocabulary, every position labelled: the benchmark workload
    (routing is then decided by the model's weights, not by a small tokenizer's few ids)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (num_rows, seq_len), generator=g)
    pos = torch.arange(seq_len).expand(num_rows, seq_len).clone()
    return PackedDataset(ids, ids.clone(), pos, seed, {"rows": num_rows, "tokens": num_rows * seq_len})

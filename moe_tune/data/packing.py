"""Rows of ``seq_len`` tokens from tokenized samples, and the two ways the trainer reads them: ``PackedDataset``
(training: micro-batches by step, shuffled per epoch) and ``ValDataset`` (evaluation: every row once)."""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from zlib import crc32

import torch

from moe_tune.distributed.dims import BatchLayout

IGNORE = -100  # label of a position that carries no loss (transformers' convention)

Row = tuple[list[int], list[int], list[int], int]  # ids, labels, position ids (seq_len each), real tokens


class RowPacker:
    """Packs (ids, labels) samples into rows of ``seq_len``, position ids restarting at each sample, padded with
    ``pad_id`` and IGNORE labels; a sample longer than ``seq_len`` is cut to ``seq_len`` (the caller counts it).
    No sample crosses rows.

    ``add`` takes samples in order and returns the rows it closed; ``close`` returns the rest. Strategies:
    ``next_fit`` keeps one open row, closed when a sample does not fit; ``best_fit`` keeps up to ``open_rows``
    and puts each sample into the open row it fills most (the one with the least room that still holds it),
    opening a row when none does; with ``open_rows`` open, the fullest is closed first. ``packing=False``: one
    sample per row. Deterministic: the rows depend only on the samples and their order."""

    def __init__(self, seq_len: int, pad_id: int, packing: bool, strategy: str = "best_fit", open_rows: int = 1):
        self.seq_len, self.pad_id = seq_len, pad_id
        self.open_rows = 1 if not packing or strategy == "next_fit" else open_rows
        self.packing = packing
        self._rows: list[list[tuple[list[int], list[int]]]] = []  # open rows: their samples
        self._room: list[int] = []  # free positions of each open row

    def add(self, ids: list[int], labels: list[int]) -> list[Row]:
        ids, labels = ids[: self.seq_len], labels[: self.seq_len]
        n, out = len(ids), []
        if not self.packing:
            return [self.pad([(ids, labels)])]
        fits = [i for i, room in enumerate(self._room) if room >= n]
        if fits:
            i = min(fits, key=self._room.__getitem__)  # the least room: the first of equals
        else:
            if len(self._rows) == self.open_rows:
                out.append(self._close(min(range(len(self._room)), key=self._room.__getitem__)))
            self._rows.append([])
            self._room.append(self.seq_len)
            i = len(self._rows) - 1
        self._rows[i].append((ids, labels))
        self._room[i] -= n
        if self._room[i] == 0:
            out.append(self._close(i))
        return out

    def close(self) -> list[Row]:
        """The rows still open, fullest first."""
        order = sorted(range(len(self._room)), key=self._room.__getitem__)
        rows = [self.pad(self._rows[i]) for i in order]
        self._rows, self._room = [], []
        return rows

    def _close(self, i: int) -> Row:
        self._room.pop(i)
        return self.pad(self._rows.pop(i))

    def pad(self, samples: list[tuple[list[int], list[int]]]) -> Row:
        """One row of ``samples`` (each at most ``seq_len``, together too), back to back, then padding."""
        ids, labels, pos = [], [], []
        for s_ids, s_labels in samples:
            ids += s_ids
            labels += s_labels
            pos += range(len(s_ids))
        n = self.seq_len - len(ids)
        return ids + [self.pad_id] * n, labels + [IGNORE] * n, pos + list(range(n)), len(ids)


def best_fit_decreasing(lengths: list[int], seq_len: int) -> list[list[int]]:
    """Sample indices per row: longest first, each into the row it fills most (the least room that still holds
    it), a new row when none holds it. Every row is open until the end, so this is
    the offline bound the streaming packer approaches with more open rows. O(n log n + n * distinct rooms)."""
    rows: list[list[int]] = []
    rooms: list[int] = []  # sorted distinct free-room values with a row
    by_room: dict[int, list[int]] = {}  # free room -> the rows with that much
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):  # stable: equal lengths keep their order
        n = min(lengths[i], seq_len)
        k = bisect.bisect_left(rooms, n)
        if k == len(rooms):
            rows.append([i])
            r, room = len(rows) - 1, seq_len - n
        else:
            room = rooms[k]
            bucket = by_room[room]
            r = bucket.pop()
            if not bucket:
                del by_room[room], rooms[k]
            rows[r].append(i)
            room -= n
        if room > 0:
            if room not in by_room:
                bisect.insort(rooms, room)
                by_room[room] = []
            by_room[room].append(r)
    return rows


def pack_rows(
    samples: list[tuple[list[int], list[int]]], seq_len: int, pad_id: int, packing: bool, strategy="best_fit"
):
    """(ids, labels, position ids, lengths) LongTensors holding every sample: [rows, seq_len] each, and the real
    (not padding) tokens of each row. ``best_fit``: best-fit decreasing over all samples; ``next_fit``: in order,
    a row closed when the next sample does not fit; ``packing=False``: one sample per row."""
    packer = RowPacker(seq_len, pad_id, packing, strategy)
    if packing and strategy == "best_fit":
        cut = [(ids[:seq_len], labels[:seq_len]) for ids, labels in samples]
        rows = [packer.pad([cut[i] for i in row]) for row in best_fit_decreasing([len(s[0]) for s in cut], seq_len)]
    else:
        rows = [row for ids, labels in samples for row in packer.add(ids, labels)] + packer.close()
    if not rows:
        empty = torch.zeros((0, seq_len), dtype=torch.long)
        return empty, empty.clone(), empty.clone(), torch.zeros(0, dtype=torch.long)
    ids, labels, pos, lengths = (torch.tensor(list(col), dtype=torch.long) for col in zip(*rows))
    return ids, labels, pos, lengths


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
    rank ``dp_rank`` holds the global rows ``row_indices(...)`` of the run's ``BatchLayout``, so the rows of a step
    depend on the step alone (an exact resume) and the ranks' rows together are the step's. Subclasses give
    ``rows(step, micro, layout, dp_rank)`` -> CPU tensors."""

    # The data.chat_template text the chat records were rendered with (None: the tokenizer's own, or no chat
    # records): the exported model carries it, so inference formats prompts as training did.
    chat_template: str | None = None

    @staticmethod
    def row_indices(step: int, micro: int, layout: BatchLayout, dp_rank: int) -> range:
        start = step * layout.rows_per_step + (micro * layout.dp_size + dp_rank) * layout.micro_batch_size
        return range(start, start + layout.micro_batch_size)

    def step_tokens(self, step: int, layout: BatchLayout) -> tuple[int, int]:
        """(real tokens, label tokens) in the rows of ``step`` on every rank together (the rows are known on each
        rank: no communication). Real: not padding; label: carrying loss after the causal shift, as the loss
        counts them."""
        per_step = layout.rows_per_step
        counts = [self.row_tokens(i) for i in range(step * per_step, (step + 1) * per_step)]
        return sum(c[0] for c in counts), sum(c[1] for c in counts)

    def micro_batch(self, step: int, micro: int, layout: BatchLayout, dp_rank: int, device):
        """``rows`` on ``device`` as (ids, labels, position ids or None); see ``to_device``."""
        return to_device(*self.rows(step, micro, layout, dp_rank), device)

    def identity(self) -> dict | None:
        """What the rows were made of, for a checkpoint to compare at a resume; None: not known before the rows
        are read (a stream)."""
        return None


class PackedDataset(MicroBatches):
    """Fixed rows of ``seq_len`` tokens in memory. Row order is shuffled by epoch with a fixed seed, so every
    rank agrees on the order and resuming at a step is exact (the rows of a step depend on the step only).

    ``stats``: what building it read and kept (records read/used, skipped per reason, tokens, rows, row fill).
    ``lengths``: the real tokens of each row (None: every position is real)."""

    def __init__(self, ids, labels, positions, seed: int, stats=None, lengths: torch.Tensor | None = None):
        self.ids, self.labels, self.positions, self.seed = ids, labels, positions, seed
        self.stats: dict = dict(stats or {"rows": int(ids.shape[0])})
        self._perm: tuple[int, torch.Tensor] | None = None
        self._identity: dict | None = None
        real = torch.full((len(ids),), ids.shape[1]) if lengths is None else lengths
        self._tokens = torch.stack([real, (labels[:, 1:] != IGNORE).sum(dim=1)], dim=1).tolist()

    def __len__(self) -> int:
        return self.ids.shape[0]

    def rows(self, step: int, micro: int, layout: BatchLayout, dp_rank: int):
        """The rows of micro-batch ``micro`` of optimizer step ``step`` for data-parallel rank ``dp_rank``."""
        idx = [self._row(i) for i in self.row_indices(step, micro, layout, dp_rank)]
        return self.ids[idx], self.labels[idx], self.positions[idx]

    def row_tokens(self, i: int) -> tuple[int, int]:
        """(real tokens, label tokens) of global row ``i``."""
        return self._tokens[self._row(i)]

    def identity(self) -> dict:
        """The records and rows this set holds, their real tokens and a CRC-32 of each row's (real, label) token
        counts: files of data.path changed in place (records added, removed or edited) give other values, and other
        rows. Computed once (a checkpoint asks at every save)."""
        if self._identity is None:
            counts = torch.tensor(self._tokens, dtype=torch.int64).reshape(-1).numpy().tobytes()
            real = sum(t[0] for t in self._tokens)
            self._identity = {"records": self.stats.get("records_used"), "rows": len(self), "tokens": real}
            self._identity["crc32"] = crc32(counts)
        return self._identity

    def _row(self, i: int) -> int:
        epoch, j = divmod(i, len(self))
        if self._perm is None or self._perm[0] != epoch:
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._perm = (epoch, torch.randperm(len(self), generator=g))
        return int(self._perm[1][j])


class ValDataset:
    """Held-out rows for evaluation, in a fixed order (no shuffle).

    ``batches(layout, dp_rank, device)`` yields (ids, labels, position ids or None) batches of the layout's
    ``micro_batch_size`` rows; over its ``dp_size`` ranks every row comes exactly once. Every rank yields the same
    number of batches, ``num_batches(layout)``: the rows past the end are padding whose labels are all -100 (they
    add nothing to a loss sum or a token count, so reduce sums of token losses and of label tokens over ranks,
    then divide). Batch b of rank r holds rows ``(b * dp_size + r) * micro_batch_size + i``.

    ``stats`` as ``PackedDataset.stats``; ``num_label_tokens``: label tokens over all rows (the count a per-token
    mean divides by, with the causal shift: labels[:, 1:] != -100)."""

    def __init__(self, ids: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor, pad_id: int, stats=None):
        self.ids, self.labels, self.positions, self.pad_id = ids, labels, positions, pad_id
        self.stats: dict = dict(stats or {"rows": int(ids.shape[0])})
        self.num_label_tokens = int((labels[:, 1:] != IGNORE).sum())

    def __len__(self) -> int:
        return self.ids.shape[0]

    def num_batches(self, layout: BatchLayout) -> int:
        return -(-len(self) // layout.rows_per_micro_batch)

    def batches(self, layout: BatchLayout, dp_rank: int, device) -> Iterator[tuple]:
        seq_len, micro_batch_size = self.ids.shape[1], layout.micro_batch_size
        for b in range(self.num_batches(layout)):
            start = (b * layout.dp_size + dp_rank) * micro_batch_size
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

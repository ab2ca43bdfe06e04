"""data.streaming=true: records read lazily (JSON Lines here, other files through ``datasets``' IterableDataset),
shuffled through a seeded buffer, tokenized and packed on the fly.

The rows form one global sequence, the same on every rank and for every world size: epoch e reads the sources in
an order shuffled with (seed, e), passes the records through a shuffle buffer of SHUFFLE_BUFFER records seeded
with (seed, e), encodes and packs them; the next epoch goes on from there. Row g of the sequence is in
micro-batch ``micro`` of step ``step`` on rank ``dp_rank`` exactly as in ``PackedDataset``, so every rank reads the
whole stream and keeps its own rows (packing needs every sample's length).

Resume: nothing is saved in the checkpoint. The trainer asks for the rows of step N; a fresh dataset (or one asked
for an earlier row) re-reads the stream from its start and skips the rows before them: the rows after a resume
are exactly those an uninterrupted run would have read, at the cost of re-reading and re-tokenizing what came
before (proportional to the steps done).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator

import torch

from moe_tune.config import DataConfig, DataError
from moe_tune.data.encode import IGNORE, Encoder
from moe_tune.data.packing import MicroBatches, RowPacker
from moe_tune.data.pipeline import RecordSource, Tally, encode_one, parsed
from moe_tune.data.records import BadRecord
from moe_tune.distributed.dims import BatchLayout

SHUFFLE_BUFFER = 10_000  # records


class StreamingDataset(MicroBatches):
    """``micro_batch`` as ``PackedDataset``'s. ``stats`` as ``PackedDataset.stats``, counting what has been read so
    far (every epoch), plus ``epoch`` (the epoch being read)."""

    def __init__(self, sources: list[RecordSource], cfg: DataConfig, encoder: Encoder, pad_id: int, seed: int):
        self.sources, self.cfg, self.encoder, self.pad_id, self.seed = sources, cfg, encoder, pad_id, seed
        self._restart()

    def _restart(self) -> None:
        self.tally = Tally(self.cfg.on_bad_record if self.cfg.path else "skip", self.encoder.seq_len)  # loader._policy
        self.stats = self.tally.stats
        self.stats["epoch"] = 0
        self._rows = self._row_stream()
        self._next = 0  # index of the row self._rows yields next
        self._window: dict[int, tuple] = {}  # the rows read from the first one asked for since the last prune
        self._first = 0  # the first row of the rows or step asked for last: rows before it are not kept

    def rows(self, step: int, micro: int, layout: BatchLayout, dp_rank: int):
        indices = self.row_indices(step, micro, layout, dp_rank)
        self._done_before(indices[0])
        rows = [self._row(i) for i in indices]
        return tuple(torch.tensor([r[k] for r in rows], dtype=torch.long) for k in range(3))

    def step_tokens(self, step: int, layout: BatchLayout) -> tuple[int, int]:
        self._done_before(step * layout.rows_per_step)
        return super().step_tokens(step, layout)

    def _done_before(self, first: int) -> None:
        """Rows are asked for in order: those before ``first`` are done. They leave the window, and rows before it
        read on the way (a resume re-reading the stream up to its step) are not kept."""
        self._first = first
        for i in [i for i in self._window if i < first]:
            del self._window[i]

    def row_tokens(self, i: int) -> tuple[int, int]:
        """As ``PackedDataset.row_tokens``; ``step_tokens`` asked before the step's ``rows`` (as the trainer does)
        reads on to the step's last row once and keeps the rows for this rank's ``rows`` calls."""
        _, labels, _, real = self._row(i)
        return real, sum(x != IGNORE for x in labels[1:])

    def _row(self, index: int) -> tuple:
        """Global row ``index``: read on to it (keeping the rows on the way from the step's first row: the other
        ranks' rows of a step come between this rank's), or from the start again for one before the window."""
        if index < self._next and index not in self._window:
            self._restart()
        keep_from = min(self._first, index)
        while self._next <= index:
            row = next(self._rows)
            if self._next >= keep_from:
                self._window[self._next] = row
            self._next += 1
        return self._window[index]

    def _row_stream(self) -> Iterator[tuple]:
        cfg, seq_len = self.cfg, self.encoder.seq_len
        packer = RowPacker(seq_len, self.pad_id, cfg.packing, cfg.packing_strategy, cfg.packing_buffer)
        real = 0  # tokens in the rows yielded
        for epoch in itertools.count():
            self.stats["epoch"] = epoch
            used = self.stats["records_used"]
            for ids, labels in self._samples(epoch):
                for row in packer.add(ids, labels):
                    self.stats["rows"] += 1
                    real += row[3]
                    self.stats["row_fill"] = real / (self.stats["rows"] * seq_len)
                    yield row
            if self.stats["records_used"] == used:
                raise DataError(
                    f"data.path={self.cfg.path}: no usable records in a whole pass ({self.stats['records_read']} "
                    f"read, skipped {self.stats['records_skipped']}); see data.on_bad_record"
                )

    def _samples(self, epoch: int) -> Iterator[tuple[list[int], list[int]]]:
        rng = random.Random(f"{self.seed}:{epoch}")  # str seeds hash the same in every process
        sources = list(self.sources)
        rng.shuffle(sources)
        for where, record, fmt in shuffled(parsed(sources, self.cfg, self.tally), rng, SHUFFLE_BUFFER):
            result = encode_one(record, fmt, self.cfg, self.encoder)
            if isinstance(result, BadRecord):
                self.tally.skip(where, result)
                continue
            self.tally.use(*result)
            yield result


def shuffled(items: Iterator, rng: random.Random, buffer_size: int) -> Iterator:
    """``items`` in a random order drawn from a buffer of ``buffer_size`` (deterministic for ``rng``'s state)."""
    buffer: list = []
    for item in items:
        if len(buffer) < buffer_size:
            buffer.append(item)
            continue
        j = rng.randrange(buffer_size)
        yield buffer[j]
        buffer[j] = item
    rng.shuffle(buffer)
    yield from buffer

"""Rows of the in-memory training set (``build_datasets`` with the built-in tokenizer, text records): packing
against rows written out by hand, position ids and labels at sample boundaries, padding without packing; and which
rows each rank reads at a step, against one process reading the whole global batch, on a rerun too. (Each record
format's ids and labels: test_formats.py.)"""

from __future__ import annotations

import json

import pytest
import torch

from moe_tune.config import DataConfig
from moe_tune.data import build_datasets
from moe_tune.distributed.dims import BatchLayout
from moe_tune.models.presets import build_tokenizer

IGNORE = -100


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _write(path, records: list) -> str:
    with open(path, "w") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


def _train(tmp_path, records: list, tok, seq_len: int = 16, seed: int = 0, **options):
    tmp_path.mkdir(exist_ok=True)
    cfg = DataConfig(path=_write(tmp_path / "data.jsonl", records), cache_dir=str(tmp_path / "cache"), **options)
    train, val = build_datasets(cfg, tok, seq_len, seed)
    assert val is None
    return train


def _chars(tok, text: str) -> list[int]:
    """The built-in tokenizer's ids, written out: one vocabulary entry per character."""
    vocab = tok.get_vocab()
    return [vocab[c] for c in text]


def _row(ids: list[int], labels: list[int], positions: list[int], seq_len: int, pad: int):
    """A row padded to seq_len: pad ids, IGNORE labels, and padding positions counting from 0."""
    n = seq_len - len(ids)
    return ids + [pad] * n, labels + [IGNORE] * n, positions + list(range(n))


def _assert_rows(train, rows: list[tuple]) -> None:
    ids, labels, positions = (torch.tensor([r[i] for r in rows]) for i in range(3))
    assert torch.equal(train.ids, ids), (train.ids, ids)
    assert torch.equal(train.labels, labels), (train.labels, labels)
    assert torch.equal(train.positions, positions), (train.positions, positions)


# -- packing -----------------------------------------------------------------------------------------------


def _text_sample(tok, text: str) -> tuple[list[int], list[int]]:
    ids = [tok.bos_token_id, *_chars(tok, text), tok.eos_token_id]
    return ids, [IGNORE, *ids[1:]]


def test_next_fit_fills_rows_back_to_back_and_no_label_crosses_samples(tmp_path, tok):
    """data.packing_strategy=next_fit, samples of 5, 7 and 4 tokens in rows of 12: the first two fill row 0, the
    third starts row 1 (it would not fit); position ids restart at 0 at each sample; the first token of every sample has label IGNORE, so the
    last token of the sample before it predicts nothing (labels are shifted by one inside the model)."""
    pad = tok.pad_token_id
    (a, la), (b, lb), (c, lc) = (_text_sample(tok, t) for t in ("abc", "defgh", "ij"))
    records = [{"text": "abc"}, {"text": "defgh"}, {"text": "ij"}]
    train = _train(tmp_path, records, tok, seq_len=12, packing_strategy="next_fit")
    _assert_rows(
        train,
        [
            _row(a + b, la + lb, [*range(5), *range(7)], 12, pad),
            _row(c, lc, [*range(4)], 12, pad),
        ],
    )
    starts = train.positions == 0
    assert (train.labels[starts] == IGNORE).all()


def test_best_fit_places_the_longest_first_each_into_the_fullest_row_that_holds_it(tmp_path, tok):
    """The default, best-fit decreasing, on samples of 6, 7, 5 and 6 tokens in rows of 12: 7 opens row 0, 6 opens
    row 1, the second 6 fills row 1, 5 fills row 0: two full rows, where next-fit (in order) makes three (6 | 7+5 |
    6). Each sample whole, positions restarting at 0, labels unchanged."""
    pad = tok.pad_token_id
    texts = ("abcd", "efghi", "jkl", "mnop")
    (a, la), (b, lb), (c, lc), (d, ld) = (_text_sample(tok, t) for t in texts)
    train = _train(tmp_path, [{"text": t} for t in texts], tok, seq_len=12)
    _assert_rows(
        train,
        [
            _row(b + c, lb + lc, [*range(7), *range(5)], 12, pad),
            _row(a + d, la + ld, [*range(6), *range(6)], 12, pad),
        ],
    )
    assert train.stats["row_fill"] == 1.0
    next_fit = _train(tmp_path / "nf", [{"text": t} for t in texts], tok, seq_len=12, packing_strategy="next_fit")
    assert len(next_fit) == 3 and next_fit.stats["row_fill"] == 24 / 36


def test_without_packing_one_sample_per_row_padded_with_ignore(tmp_path, tok):
    pad = tok.pad_token_id
    samples = [_text_sample(tok, t) for t in ("abc", "defgh", "ij")]
    train = _train(tmp_path, [{"text": "abc"}, {"text": "defgh"}, {"text": "ij"}], tok, seq_len=12, packing=False)
    _assert_rows(train, [_row(ids, labels, list(range(len(ids))), 12, pad) for ids, labels in samples])


# -- rows per rank and step --------------------------------------------------------------------------------

NUM_ROWS, MBS, ACCUM, WORLD = 16, 2, 2, 2  # 8 rows per step: an epoch is 2 steps


@pytest.fixture
def numbered(tmp_path, tok):
    """A training set of 16 rows, row i holding the one sample "record <i>" (no packing)."""
    return lambda seed=0: _train(
        tmp_path, [{"text": f"record {i:02d}"} for i in range(NUM_ROWS)], tok, packing=False, seed=seed
    )


def _rows_of(train, step: int, micro: int, rank: int, world: int, accum: int) -> list[tuple]:
    ids, labels, _ = train.micro_batch(step, micro, BatchLayout(MBS, accum, world), rank, torch.device("cpu"))
    assert ids.shape == labels.shape == (MBS, 16)
    return [tuple(r) for r in ids.tolist()]


def test_each_rank_reads_its_share_of_the_single_process_rows(numbered):
    """Micro-batch m of rank r is micro-batch m * world + r of one process taking the whole global batch
    (accum x world micro-batches): the ranks' rows are disjoint and together the single process's, and over an
    epoch every row comes exactly once."""
    train = numbered()
    for step in range(4):  # two epochs
        ranks = {r: [row for m in range(ACCUM) for row in _rows_of(train, step, m, r, WORLD, ACCUM)] for r in (0, 1)}
        one = [_rows_of(train, step, m, 0, 1, ACCUM * WORLD) for m in range(ACCUM * WORLD)]
        for r in (0, 1):
            for m in range(ACCUM):
                assert _rows_of(train, step, m, r, WORLD, ACCUM) == one[m * WORLD + r]
        assert not set(ranks[0]) & set(ranks[1])
        assert sorted(ranks[0] + ranks[1]) == sorted(row for micro in one for row in micro)
    for epoch in (0, 1):
        seen = [
            row for step in (2 * epoch, 2 * epoch + 1) for m in range(4) for row in _rows_of(train, step, m, 0, 1, 4)
        ]
        assert sorted(seen) == sorted(tuple(r) for r in train.ids.tolist())
    epoch0 = [_rows_of(train, s, m, 0, 1, 4) for s in (0, 1) for m in range(4)]
    epoch1 = [_rows_of(train, s, m, 0, 1, 4) for s in (2, 3) for m in range(4)]
    assert epoch0 != epoch1  # shuffled again for each epoch


def test_the_rows_of_a_step_are_the_same_on_a_rerun(numbered):
    """A resumed run reads step 3 first; it gets the rows the run that went through steps 0-2 got."""
    went_through = numbered()
    expected = [[_rows_of(went_through, s, m, r, WORLD, ACCUM) for m in range(ACCUM) for r in (0, 1)] for s in range(4)]
    resumed = numbered()
    assert [_rows_of(resumed, 3, m, r, WORLD, ACCUM) for m in range(ACCUM) for r in (0, 1)] == expected[3]
    assert [
        [_rows_of(resumed, s, m, r, WORLD, ACCUM) for m in range(ACCUM) for r in (0, 1)] for s in range(4)
    ] == expected
    other_seed = numbered(seed=1)
    assert [_rows_of(other_seed, 0, m, 0, 1, 4) for m in range(4)] != [
        _rows_of(resumed, 0, m, 0, 1, 4) for m in range(4)
    ]

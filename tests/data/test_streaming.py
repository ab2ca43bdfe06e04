"""data.streaming=true: the same rows for the same seed, one global row sequence split over ranks as in memory,
every record once per epoch, epochs that go on, and a resume at step N that gives exactly the rows of an
uninterrupted run."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from moe_tune.config import DataConfig, DataError
from moe_tune.data import build_datasets
from moe_tune.distributed.dims import BatchLayout
from moe_tune.models.presets import build_tokenizer

SEQ_LEN, MBS = 48, 2
RECORDS = [{"prompt": f"{i}+{i}=", "response": str(2 * i)} for i in range(40)]


@pytest.fixture
def data_file(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return path


def stream(tmp_path, path, seed: int = 0, **options):
    cfg = DataConfig(name="jsonl", path=str(path), num_samples=0, streaming=True, cache_dir=str(tmp_path), **options)
    return build_datasets(cfg, build_tokenizer(), SEQ_LEN, seed)


def batch(data, step: int, rank: int = 0, world: int = 1, accum: int = 1, micro: int = 0) -> torch.Tensor:
    ids, labels, pos = data.rows(step, micro, BatchLayout(MBS, accum, world), rank)
    return torch.stack([ids, labels, pos])


def test_same_seed_same_rows_other_seed_other_rows(tmp_path, data_file):
    a, b, c = (stream(tmp_path, data_file, seed)[0] for seed in (0, 0, 1))
    first = [batch(a, s) for s in range(4)]
    assert all(torch.equal(x, batch(b, s)) for s, x in enumerate(first))
    assert not all(torch.equal(x, batch(c, s)) for s, x in enumerate(first))


def test_the_log_says_at_the_start_that_the_set_streams(tmp_path, data_file, caplog):
    """Nothing is counted before the steps read it: the first line says so (an in-memory set's is its counts)."""
    with caplog.at_level("INFO", logger="moe_tune"):
        stream(tmp_path, data_file)
    assert f"data (train, streamed): 1 file(s) of {data_file} read as the steps need them" in caplog.text


def test_ranks_split_one_global_sequence(tmp_path, data_file):
    single = stream(tmp_path, data_file)[0]
    ranks = [stream(tmp_path, data_file)[0] for _ in range(2)]
    for step in range(3):
        whole = single.rows(step, 0, BatchLayout(2 * MBS, 1, 1), 0)[0]  # one rank, twice the rows per step
        parts = [ranks[r].rows(step, 0, BatchLayout(MBS, 1, 2), r)[0] for r in range(2)]
        assert torch.equal(torch.cat(parts), whole)


def test_one_epoch_holds_every_record_once_then_goes_on(tmp_path, data_file):
    data = stream(tmp_path, data_file, packing=False)[0]  # one record per row
    tokenizer = build_tokenizer()
    texts = [
        tokenizer.decode(data.rows(s, 0, BatchLayout(1, 1, 1), 0)[0][0], skip_special_tokens=True) for s in range(40)
    ]
    assert Counter(texts) == Counter(r["prompt"] + r["response"] for r in RECORDS)
    assert texts != [r["prompt"] + r["response"] for r in RECORDS]  # shuffled
    data.rows(45, 0, BatchLayout(1, 1, 1), 0)
    assert data.stats["epoch"] == 1 and data.stats["records_used"] >= 45


def test_resume_at_a_step_is_exact(tmp_path, data_file):
    run = stream(tmp_path, data_file)[0]
    uninterrupted = [batch(run, s, accum=2, micro=m) for s in range(6) for m in range(2)]
    resumed = stream(tmp_path, data_file)[0]  # a new process after a checkpoint at step 4
    assert all(
        torch.equal(batch(resumed, s, accum=2, micro=m), uninterrupted[2 * s + m]) for s in (4, 5) for m in (0, 1)
    )
    assert torch.equal(batch(resumed, 1, accum=2), uninterrupted[2])  # an earlier step: read again


def test_parquet_streams_through_datasets(tmp_path, data_file):
    datasets = pytest.importorskip("datasets")
    datasets.disable_progress_bars()
    datasets.Dataset.from_list(RECORDS).to_parquet(str(tmp_path / "data.parquet"))
    from_parquet, from_jsonl = stream(tmp_path, tmp_path / "data.parquet")[0], stream(tmp_path, data_file)[0]
    assert all(torch.equal(batch(from_parquet, s), batch(from_jsonl, s)) for s in range(3))


def test_validation_with_streaming(tmp_path, data_file):
    """Held-out records from data.val_path (data.val_fraction with streaming is refused by the config's checks)."""
    _, val = stream(tmp_path, data_file, val_path=str(data_file))
    assert val.stats["records_used"] == len(RECORDS)


def test_bad_record_stops_the_stream_where_it_is_read(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(RECORDS[0]) + "\n{oops\n")
    data = stream(tmp_path, path)[0]
    with pytest.raises(DataError, match=r"data\.jsonl:2: not valid JSON"):
        batch(data, 0)


def test_a_bad_record_read_mid_run_is_one_line_and_exit_2(tmp_path):
    """The CLI: a streamed bad line reached after training started ends the run as bad input does (exit 2, the
    one line last, no traceback), not as a crash."""
    from tests.harness import FAST_RUN, run_main

    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS * 5) + "{oops\n")
    args = [f"output_dir={tmp_path / 'run'}", "data=jsonl", f"data.path={path}", "data.streaming=true"]
    r = run_main([*args, "train.steps=50", *FAST_RUN])
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert lines[-1].startswith("moe-tune: error: ") and f"{path}:{len(RECORDS) * 5 + 1}: not valid JSON" in lines[-1]


def test_a_resume_holds_the_rows_of_its_step_only(tmp_path, data_file):
    """A resume at step N re-reads the stream up to N's rows as the trainer asks for them (the step's token counts
    first): the rows before them are read and dropped, not held (a long run's stream would not fit in memory), and
    the rows are an uninterrupted run's."""
    layout = BatchLayout(MBS, 2, 2)
    run = stream(tmp_path, data_file)[0]
    uninterrupted = {s: [batch(run, s, rank=1, world=2, accum=2, micro=m) for m in range(2)] for s in range(40)}
    resumed = stream(tmp_path, data_file)[0]
    for step in (37, 38, 39):
        resumed.step_tokens(step, layout)  # Trainer.train_step's first read of a step
        assert sorted(resumed._window) == list(range(step * 8, step * 8 + 8)), (step, sorted(resumed._window)[:3])
        for m in range(2):
            assert torch.equal(batch(resumed, step, rank=1, world=2, accum=2, micro=m), uninterrupted[step][m])

"""metrics.jsonl after a crash: the steps a resumed run replays (logged after the last checkpoint) appear once."""

from __future__ import annotations

import json
import shutil

import pytest

from moe_tune.checkpoint import RunFinished
from moe_tune.metrics import MetricsWriter
from tests.harness import read_metrics


def test_resume_after_a_crash_logs_each_step_once_in_order(tmp_path, make_trainer):
    make_trainer("train.steps=6", "checkpoint.every=2").fit()
    reference = read_metrics(tmp_path)
    # As if the run was killed after logging steps 5-6 but before its step_6 checkpoint was complete (so before
    # its summary, which comes after the last save).
    shutil.rmtree(tmp_path / "checkpoints" / "step_6")
    (tmp_path / "summary.json").unlink()
    resumed = make_trainer("train.steps=6", "checkpoint.every=2")
    assert resumed.step == 4
    resumed.fit()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in rows] == [r["loss"] for r in reference]  # the replayed steps, bitwise


def test_a_resumed_or_rerun_run_summarises_every_step(tmp_path, make_trainer):
    """summary.json after a resume covers the whole run (first loss of step 1, medians over every row), and
    running a finished run again (RunFinished: nothing to train) leaves its summary as it was."""
    make_trainer("train.steps=4", "checkpoint.every=2").fit()
    first = json.load(open(tmp_path / "summary.json"))
    shutil.rmtree(tmp_path / "checkpoints" / "step_4")  # killed during its last save, before the summary
    (tmp_path / "summary.json").unlink()
    make_trainer("train.steps=4", "checkpoint.every=2").fit()  # resumes at step 2
    rows = read_metrics(tmp_path)
    resumed = json.load(open(tmp_path / "summary.json"))
    assert resumed["first_loss"] == rows[0]["loss"] == first["first_loss"]
    assert resumed["final_loss"] == rows[-1]["loss"] and resumed["steps_timed"] == first["steps_timed"]
    with pytest.raises(RunFinished):
        make_trainer("train.steps=4", "checkpoint.every=2")
    assert json.load(open(tmp_path / "summary.json")) == resumed


def test_drop_after_keeps_earlier_rows_and_drops_a_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3, 4)) + '{"step": 5, "lo')
    writer = MetricsWriter(str(tmp_path), enabled=True, warmup_steps=0)
    writer.drop_after(2)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]
    writer.log({"step": 3, "loss": 0.5})
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3]
    assert not (tmp_path / "metrics.jsonl.tmp").exists()


def test_drop_after_on_rank_other_than_0_writes_nothing(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 7}) + "\n")
    MetricsWriter(str(tmp_path), enabled=False, warmup_steps=0).drop_after(0)
    assert path.read_text() == json.dumps({"step": 7}) + "\n"


def _row(step: int) -> dict:
    """A training row as the loop logs it (``step_row``), with a step's expert loads beside it."""
    from moe_tune.metrics import step_row

    loads = {f"expert_load/layer_{i}": [0.1 * j for j in range(8)] for i in range(4)}
    return step_row(step, 2.0 + 1 / step, 1.5, 3e-4, (1000 + step, 300, 1024), 0.5, 1, 1e9, (1.0, 1.5), **loads)


def test_a_long_run_keeps_what_its_summary_reads_not_its_rows(tmp_path):
    """A week of steps must not grow the host's memory by a row's dict per step (about a kilobyte each, a
    gigabyte a million steps): at most 200 bytes a step. The summary still reads every step."""
    import tracemalloc

    writer = MetricsWriter(str(tmp_path), enabled=False, warmup_steps=3)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for step in range(1, 20_001):
            writer.log(_row(step))
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown / 20_000 < 200, f"{grown / 20_000:.0f} bytes a step"
    summary = writer.summary()
    assert summary["steps_timed"] == 19_997 and summary["first_loss"] == 3.0
    assert summary["final_loss"] == 2.0 + 1 / 20_000 and summary["peak_reserved_gib"] == 1.5
    assert summary["tokens_per_s"] == 2 * (1000 + 10_002)  # the median of steps 4-20000


def test_drop_after_reads_a_long_metrics_file_a_line_at_a_time(tmp_path):
    """Resuming a long run reads its metrics.jsonl without holding it (a million rows: a gigabyte of lines and
    dicts): the peak stays under 200 bytes a row, and the kept rows are summarised."""
    import tracemalloc

    path = tmp_path / "metrics.jsonl"
    with open(path, "w") as f:
        f.writelines(json.dumps(_row(step)) + "\n" for step in range(1, 20_001))
    writer = MetricsWriter(str(tmp_path), enabled=True, warmup_steps=0)
    tracemalloc.start()
    try:
        writer.drop_after(10_000)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak / 20_000 < 200, f"{peak / 20_000:.0f} bytes a row"
    assert len(path.read_text().splitlines()) == 10_000 and writer.summary()["final_loss"] == 2.0 + 1 / 10_000

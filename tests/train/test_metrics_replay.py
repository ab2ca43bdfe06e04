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

"""checkpoint.keep_last: a long run keeps its newest complete checkpoints only (disk), and resumes from them."""

from __future__ import annotations

import os

from moe_tune.checkpoint import manifest


def _steps(run_dir) -> list[str]:
    return sorted(os.listdir(run_dir / "checkpoints"))


def test_only_the_newest_complete_checkpoints_stay_and_a_resume_uses_them(tmp_path, make_trainer):
    """Every step saved, 2 kept: after 5 steps step_4 and step_5 remain (complete, resumable); an incomplete
    directory (a save cut short) is not counted and not touched; keep_last=0 keeps every one."""
    (tmp_path / "checkpoints" / "step_0").mkdir(parents=True)  # incomplete: no COMPLETE file
    make_trainer("train.steps=5", "checkpoint.every=1", "checkpoint.keep_last=2").fit()
    assert _steps(tmp_path) == ["step_0", "step_4", "step_5"]
    assert [os.path.basename(p) for p in manifest.complete_checkpoints(str(tmp_path))] == ["step_5", "step_4"]
    resumed = make_trainer("train.steps=6", "checkpoint.every=1", "checkpoint.keep_last=2")
    assert resumed.step == 5
    every = tmp_path / "every"
    make_trainer("train.steps=3", "checkpoint.every=1", out=every).fit()
    assert _steps(every) == ["step_1", "step_2", "step_3"]


def test_a_run_started_before_the_newest_checkpoint_sets_the_later_ones_aside(tmp_path, make_trainer):
    """Rolled back with checkpoint.resume=<step_2> (or restarted with none): step_3 and step_4 are of the replaced
    history. Left in place, a crash before the run saved past them made checkpoint.resume=auto resume from step_4,
    and keep_last=1 deleted the run's own new step_3 (keeping the old step_4); the old summary.json made a rerun
    call the run finished. They move, whole, into checkpoints/replaced-<time>-<id>/, where no resume or keep_last
    looks."""
    make_trainer("train.steps=4", "checkpoint.every=1").fit()
    step_2 = tmp_path / "checkpoints" / "step_2"
    rolled_back = make_trainer("train.steps=4", "checkpoint.every=1", f"checkpoint.resume={step_2}")
    assert rolled_back.step == 2 and [s for s in _steps(tmp_path) if s.startswith("step_")] == ["step_1", "step_2"]
    assert manifest.pick(str(tmp_path), "auto") == str(step_2)
    (aside,) = [tmp_path / "checkpoints" / s for s in _steps(tmp_path) if s.startswith("replaced-")]
    assert sorted(os.listdir(aside)) == ["step_3", "step_4", "summary.json"]  # the old run's "finished at 4" too
    assert manifest.saved_step(str(aside / "step_4")) == 4  # intact: moving it back resumes from it
    make_trainer("train.steps=4", "checkpoint.resume=none")
    assert not [s for s in _steps(tmp_path) if s.startswith("step_")]


def test_keep_last_counts_no_damaged_checkpoint_past_the_save(tmp_path, make_trainer):
    """step_3 and step_4 damaged (bit rot): the resume falls back to step_2 and saves step_3 anew. keep_last=1
    counted the damaged step_4 as the newest: it deleted the new step_3 (and step_2), and the next resume found
    nothing intact (exit 2)."""
    make_trainer("train.steps=4", "checkpoint.every=1").fit()
    for step in (3, 4):
        os.truncate(tmp_path / "checkpoints" / f"step_{step}" / "__0_0.distcp", 10)
    t = make_trainer("train.steps=5", "checkpoint.every=1", "checkpoint.keep_last=1")
    assert t.step == 2
    t.train_step(t.step)
    t.step += 1
    t.save()
    assert _steps(tmp_path) == ["step_3", "step_4"]
    assert manifest.pick(str(tmp_path), "auto") == str(tmp_path / "checkpoints" / "step_3")

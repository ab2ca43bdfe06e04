"""checkpoint.latest: the complete checkpoint with the highest step, numerically, in <run_dir>/checkpoints."""

from __future__ import annotations

import os

from moe_tune.checkpoint import COMPLETE, latest


def _step_dir(run_dir, name: str, complete: bool) -> None:
    path = run_dir / "checkpoints" / name
    os.makedirs(path)
    if complete:
        (path / COMPLETE).write_text(name.removeprefix("step_"))


def test_latest_is_the_highest_complete_step(tmp_path):
    # step_10 < step_2 as strings and step_10 is not the newest directory on disk: only a numeric max finds it.
    for name, complete in [("step_2", True), ("step_10", True), ("step_4", True), ("step_12", False)]:
        _step_dir(tmp_path, name, complete)
    _step_dir(tmp_path, "step_x", True)  # not a step number
    _step_dir(tmp_path, "step_99.bak", True)  # not exactly step_<N>
    (tmp_path / "checkpoints" / "step_50").write_text("a stray file, not a directory")
    (tmp_path / "checkpoints" / "notes.txt").write_text("stray")
    assert latest(str(tmp_path)) == os.path.join(str(tmp_path), "checkpoints", "step_10")


def test_latest_of_one_complete_checkpoint(tmp_path):
    _step_dir(tmp_path, "step_3", True)
    _step_dir(tmp_path, "step_7", False)  # an interrupted save is never resumed from
    assert latest(str(tmp_path)) == os.path.join(str(tmp_path), "checkpoints", "step_3")


def test_latest_without_checkpoints_is_none(tmp_path):
    assert latest(str(tmp_path)) is None  # no checkpoints/ directory
    os.makedirs(tmp_path / "checkpoints")
    assert latest(str(tmp_path)) is None  # empty
    _step_dir(tmp_path, "step_5", False)
    assert latest(str(tmp_path)) is None  # only an incomplete save

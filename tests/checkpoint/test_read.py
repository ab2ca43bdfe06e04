"""``read.instead``: what moe-tune-export and checkpoint.resume name in place of a run directory, its checkpoints/
folder or its hf/ export."""

from __future__ import annotations

import json

from moe_tune.checkpoint.manifest import COMPLETE
from moe_tune.checkpoint.read import instead


def _run(tmp_path, saved: list[int], ended: int):
    """A run directory as a run leaves it: checkpoints at ``saved`` steps, summary.json ending at ``ended``, hf/."""
    run = tmp_path / "run"
    for step in saved:
        (run / "checkpoints" / f"step_{step}").mkdir(parents=True)
        (run / "checkpoints" / f"step_{step}" / COMPLETE).write_text(json.dumps({"step": step}))
    (run / "summary.json").write_text(json.dumps({"final_step": ended, "finished": True}))
    (run / "hf").mkdir()
    (run / "hf" / "adapter_config.json").write_text("{}")
    return run


def test_a_newest_checkpoint_before_the_runs_end_is_named_with_the_step_it_holds(tmp_path):
    """Stopped by a signal at step 31 (its checkpoint), resumed to its end at 60 with checkpoint.every=0: hf/ holds
    step 60, and step_31 is the only checkpoint. The line still names step_31, and says it is not the run's end and
    what holds the end, so that --merge of it does not pass for the run's result."""
    run = _run(tmp_path, [31], 60)
    for given in (run, run / "hf", run / "checkpoints"):
        line = instead(str(given))
        assert str(run / "checkpoints" / "step_31") in line, line
        assert "step 31 and the run ended at step 60" in line and f"step 60 is only in {run / 'hf'}" in line, line


def test_a_checkpoint_at_the_runs_end_is_named_alone(tmp_path):
    run = _run(tmp_path, [30, 60], 60)
    assert instead(str(run)).endswith(f"e.g. {run / 'checkpoints' / 'step_60'}")
    assert instead(str(run / "hf")).endswith(f"e.g. {run / 'checkpoints' / 'step_60'}")

"""A resume with another schedule (train.steps, train.lr, optim.warmup_steps): every resumed step, the first one
included, applies and logs the learning rate a fresh run with the new settings applies at that step."""

from __future__ import annotations

import json

import pytest

from tests.harness import copy_checkpoint

COMMON = ["optim.warmup_steps=2", "train.log_every=1", "checkpoint.every=3"]


def _fit_recording_lrs(trainer) -> list[float]:
    """Run ``trainer`` to its end; the lr each optimizer step applied, read from the optimizer as it runs."""
    applied = []
    trainer.optimizer.register_step_pre_hook(lambda opt, args, kwargs: applied.append(opt.param_groups[0]["lr"]))
    trainer.fit()
    return applied


def _logged(out) -> dict[int, float]:
    return {r["step"]: r["lr"] for r in map(json.loads, open(out / "metrics.jsonl"))}


@pytest.mark.parametrize(
    "change",
    [["train.steps=9"], ["train.lr=1e-3"], ["train.steps=9", "optim.warmup_steps=6"], ["optim.schedule=constant"]],
    ids=["steps", "lr", "warmup", "constant"],
)
def test_a_resume_with_another_schedule_applies_it_from_the_resumed_step(tmp_path, make_trainer, change):
    """6 steps saved at step 3; resumed from step_3 with ``change``: steps 4.. equal a fresh run with ``change``,
    exactly (the rate is base x lambda(step) in both)."""
    first, resumed, fresh = tmp_path / "first", tmp_path / "resumed", tmp_path / "fresh"
    make_trainer("train.steps=6", *COMMON, out=first).fit()
    copy_checkpoint(first, resumed, 3)
    again = [o for o in ["train.steps=6"] if not any(c.startswith("train.steps=") for c in change)] + change
    trainer = make_trainer(*COMMON, *again, out=resumed)
    assert trainer.step == 3
    got = _fit_recording_lrs(trainer)
    want = _fit_recording_lrs(make_trainer(*COMMON, *again, out=fresh))
    assert len(want) == (9 if "train.steps=9" in change else 6)
    assert got == want[3:], (got, want)
    logged, fresh_logged = _logged(resumed), _logged(fresh)
    assert {s: logged[s] for s in logged if s > 3} == {s: lr for s, lr in fresh_logged.items() if s > 3}

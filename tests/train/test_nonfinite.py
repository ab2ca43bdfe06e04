"""A step whose gradient norm is not finite is skipped on the device; too many in a row stop the run."""

from __future__ import annotations

import json
import math

import pytest
import torch


def _poison(trainer):
    """From now on the first MoE layer's output is NaN (an overflow), and with it the loss and every gradient."""
    moe = trainer.model.moe_layers()[0]
    return moe.register_forward_hook(lambda module, args, out: out * float("nan"))


@pytest.mark.parametrize("overrides", [[], ["train.precision=bf16", "optim.stochastic_rounding=true"]])
def test_a_nonfinite_step_leaves_weights_and_optimizer_state_bitwise(make_trainer, overrides):
    trainer = make_trainer(*overrides)
    trainer.train_step(0)

    def snapshot():
        state = [t.clone() for s in trainer.optimizer.state.values() for t in s.values()]
        return [p.detach().clone() for p in trainer.model.parameters()], state

    params, state = snapshot()
    hook = _poison(trainer)
    out = trainer.train_step(1)
    assert not torch.isfinite(out["grad_norm"])
    after_params, after_state = snapshot()
    assert all(torch.equal(a, b) for a, b in zip(params, after_params))
    assert len(state) == len(after_state) and all(torch.equal(a, b) for a, b in zip(state, after_state) if a.ndim)
    hook.remove()
    out = trainer.train_step(2)
    assert torch.isfinite(out["grad_norm"])
    assert all(p.isfinite().all() for p in trainer.model.parameters())
    assert not all(torch.equal(a, p) for a, p in zip(params, trainer.model.parameters()))


def _inject(trainer, norms: dict[int, float]):
    """The gradient norm of the steps in ``norms`` (0-based) replaced by the given value (a real +inf or NaN
    comes from an overflow; -inf from a norm computed wrong): the trainer's rule, not the norm, is under test."""
    original, calls = trainer._clip_grad_norm, []

    def clip():
        step = len(calls)
        calls.append(step)
        norm = original()
        return torch.full_like(norm, norms[step]) if step in norms else norm

    trainer._clip_grad_norm = clip


@pytest.mark.parametrize("overrides", [[], ["train.precision=bf16", "optim.stochastic_rounding=true"]])
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan], ids=["+inf", "-inf", "nan"])
def test_an_infinite_or_nan_norm_skips_the_update_and_is_counted(make_trainer, overrides, bad):
    trainer = make_trainer(*overrides)
    _inject(trainer, {1: bad})
    trainer.train_step(0)
    params = [p.detach().clone() for p in trainer.model.parameters()]
    state = [t.clone() for s in trainer.optimizer.state.values() for t in s.values()]
    out = trainer.train_step(1)
    trainer.guard.record(out["grad_norm"], 2)
    assert all(torch.equal(a, p) for a, p in zip(params, trainer.model.parameters()))
    after = [t for s in trainer.optimizer.state.values() for t in s.values()]
    assert len(after) == len(state) and all(torch.equal(a, b) for a, b in zip(state, after))
    assert trainer.guard.check(2) is None and (trainer.guard.skipped, trainer.guard.in_a_row) == (1, 1)
    trainer.train_step(2)
    assert not all(torch.equal(a, p) for a, p in zip(params, trainer.model.parameters()))


def test_metrics_count_every_kind_of_nonfinite_step(tmp_path, make_trainer):
    """+inf, -inf and NaN norms each count as a skipped step in metrics.jsonl, also between two logging steps."""
    trainer = make_trainer("train.steps=5", "train.log_every=5")
    _inject(trainer, {1: math.inf, 2: -math.inf, 3: math.nan})
    trainer.fit()
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["skipped_steps"] for r in rows] == [0, 1, 2, 3, 3]
    assert trainer.guard.skipped == 3


def test_too_many_nonfinite_steps_in_a_row_stop_the_run(tmp_path, make_trainer, capfd):
    trainer = make_trainer("train.steps=10", "train.max_nonfinite_steps=2", "train.log_every=1")
    original = trainer.train_step

    def step(i):
        if i == 3:
            _poison(trainer)  # steps 4, 5, 6 (1-based) are all non-finite
        return original(i)

    trainer.train_step = step
    with pytest.raises(SystemExit) as e:
        trainer.fit()
    assert e.value.code == 1
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["skipped_steps"] for r in rows] == [0, 0, 0, 1, 2, 3]
    err = capfd.readouterr().err
    assert "steps 4-6 all had a non-finite gradient norm" in err
    assert "weights are those after step 3" in err
    # Where a finite step wrecked the weights first, every checkpoint since holds them: the line says how to go back.
    assert "from a checkpoint before the climb (checkpoint.resume=<its path>) or anew in another output_dir" in err
    # summary.json is written at the stop and covers the run up to it, the non-finite steps included.
    summary = json.load(open(tmp_path / "summary.json"))
    assert summary["config"]["train"]["max_nonfinite_steps"] == 2 and summary["config"]["output_dir"] == str(tmp_path)
    assert summary["first_loss"] == rows[0]["loss"] and math.isfinite(summary["first_loss"])
    assert math.isnan(summary["final_loss"]) and math.isnan(rows[-1]["loss"])
    assert summary["final_step"] == 6 and summary["finished"] is False  # a rerun is no finished run's

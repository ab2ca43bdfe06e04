"""The trainer's loop with train.log_every > 1: the host waits for the device only on logging, checkpoint and
last steps, where it writes a metrics row for every step since, each with its own time; non-finite runs and
signals are acted on at those steps."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch


def _rows(tmp_path) -> list[dict]:
    return [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]


def _saved(tmp_path) -> list[str]:
    return sorted(d.name for d in (tmp_path / "checkpoints").iterdir() if (d / "COMPLETE").exists())


def test_host_syncs_only_on_logging_checkpoint_and_last_steps(tmp_path, make_trainer, monkeypatch):
    from moe_tune.metrics import StepTimer
    from moe_tune.train import StopSignal

    trainer = make_trainer("train.steps=7", "train.log_every=3", "checkpoint.every=5")
    synced = {"timer": [], "guard": [], "signal": [], "rows": []}
    pause, check, agreed, log = StepTimer.pause, trainer.guard.check, StopSignal.agreed, trainer.metrics.log

    def record(key, fn):
        def wrapped(*args, **kwargs):
            synced[key].append(trainer.step)
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(StepTimer, "pause", record("timer", pause))
    monkeypatch.setattr(trainer.guard, "check", record("guard", check))
    monkeypatch.setattr(StopSignal, "agreed", record("signal", agreed))
    monkeypatch.setattr(trainer.metrics, "log", record("rows", log))
    trainer.fit()
    # Every step's row, written at the steps where the host waits anyway: steps 1-3 at 3, 4-5 at 5, 6, 7.
    assert synced == {
        "timer": [3, 5, 6, 7],
        "guard": [3, 5, 6, 7],
        "signal": [3, 5, 6, 7],
        "rows": [3, 3, 3, 5, 5, 6, 7],
    }
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6, 7]
    assert all(r["step_time_s"] > 0 and r["tokens_per_s"] > 0 for r in rows)
    assert _saved(tmp_path) == ["step_5"]


def test_every_row_times_its_own_step(tmp_path, make_trainer):
    """Step 3 of an interval of four takes 2 s longer: its row says so, the rows of steps 2 and 4 (past the first
    step's one-time costs) do not, and the rows add up to the interval. Compared with its neighbours, not with a fixed
    bound: on a loaded machine a step of the tiny model alone can take seconds."""
    trainer = make_trainer("train.steps=4", "train.log_every=4")
    original = trainer.train_step

    def step(i):
        out = original(i)
        if i == 2:
            time.sleep(2.0)
        return out

    trainer.train_step = step
    start = time.perf_counter()
    trainer.fit()
    wall = time.perf_counter() - start
    seconds = [r["step_time_s"] for r in _rows(tmp_path)]
    assert seconds[2] >= 2.0 and seconds[2] - seconds[1] > 1.0 and seconds[2] - seconds[3] > 1.0, seconds
    assert sum(seconds) < wall


def _poison_from(trainer, index: int, snapshots: list):
    """From step ``index`` (0-based) on, the first MoE layer's output is NaN; the weights before it are kept."""
    original = trainer.train_step

    def step(i):
        if i == index:
            snapshots.append([p.detach().clone() for p in trainer.model.parameters()])
            trainer.moe_layers[0].register_forward_hook(lambda module, args, out: out * float("nan"))
        return original(i)

    return step


def test_a_divergence_is_found_at_the_next_sync_step_and_never_saved(tmp_path, make_trainer, capfd):
    """Limit 1, steps 4 on non-finite, logging every 4 and checkpoints every 2: step 4's check sees one (saves),
    step 6's sees three in a row and stops before saving; the weights are still those after step 3."""
    trainer = make_trainer("train.steps=12", "train.log_every=4", "checkpoint.every=2", "train.max_nonfinite_steps=1")
    before = []
    trainer.train_step = _poison_from(trainer, 3, before)
    with pytest.raises(SystemExit) as e:
        trainer.fit()
    assert e.value.code == 1
    assert [(r["step"], r["skipped_steps"]) for r in _rows(tmp_path)] == [
        (1, 0),
        (2, 0),
        (3, 0),
        (4, 1),
        (5, 2),
        (6, 3),
    ]
    assert _saved(tmp_path) == ["step_2", "step_4"]
    assert all(torch.equal(a, b) for a, b in zip(before[0], trainer.model.parameters()))
    err = capfd.readouterr().err
    assert "stopping at step 6: steps 4-6 all had a non-finite gradient norm" in err
    assert "weights are those after step 3" in err
    assert json.load(open(tmp_path / "summary.json"))


def _fit_signalled_during(trainer, step: int) -> int:
    """``trainer.fit()`` with SIGUSR1 sent during training step ``step`` (counted from 1): the exit code."""
    original = trainer.train_step

    def signalled(i):
        if i == step - 1:
            os.kill(os.getpid(), signal.SIGUSR1)
        return original(i)

    trainer.train_step = signalled
    with pytest.raises(SystemExit) as e:
        trainer.fit()
    return e.value.code


def test_one_process_stops_after_the_step_a_signal_landed_in_with_a_checkpoint(tmp_path, make_trainer):
    """Not at the next logging step (step 8 here): one process has no rank to agree with, and on a large model the
    steps up to it could outlast the scheduler's grace period."""
    trainer = make_trainer("train.steps=20", "train.log_every=4")
    assert _fit_signalled_during(trainer, 6) == 128 + signal.SIGUSR1
    assert [r["step"] for r in _rows(tmp_path)] == list(range(1, 7))
    assert _saved(tmp_path) == ["step_6"]
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL  # the handler is restored


def test_a_stop_skips_the_validation_of_the_step_it_is_agreed_on(tmp_path, make_trainer, monkeypatch):
    """A pass over the whole validation set can outlast a scheduler's grace period: the signal's step saves without
    it (step 4 evaluates otherwise); validation resumes with the run."""
    trainer = make_trainer("train.steps=10", "train.log_every=4", "train.eval_every=2", "data.val_fraction=0.1")
    evaluate, evaluated = trainer._evaluate, []
    monkeypatch.setattr(trainer, "_evaluate", lambda *a: (evaluated.append(trainer.step), evaluate(*a))[1])
    assert _fit_signalled_during(trainer, 4) == 128 + signal.SIGUSR1  # step 4 evaluates
    assert evaluated == [2] and _saved(tmp_path) == ["step_4"]
    assert [r["step"] for r in _rows(tmp_path) if "val_loss" in r] == [2]


def test_a_signal_during_validation_ends_the_pass_and_saves_that_step(tmp_path, make_trainer, monkeypatch):
    """A signal that lands during a pass over the validation set (a large one outlasts a scheduler's grace period)
    ends the pass at its next check, not at its end: the step is saved without a validation loss, the rest of the
    set unread. The pass of the run's last step is never cut short (the run ends after it anyway)."""
    from moe_tune.train.evaluate import STOP_CHECK_EVERY

    overrides = ["train.eval_every=4", "data.val_fraction=0.5", "data.num_samples=128"]
    trainer = make_trainer("train.steps=5", "train.log_every=4", *overrides)
    batches, read = trainer.val_data.batches, []

    def signalled(*args):
        for i, batch in enumerate(batches(*args)):
            read.append(i)
            if i == 0:
                os.kill(os.getpid(), signal.SIGUSR1)  # step 4's pass: the first one
            yield batch

    assert len(list(batches(trainer.layout, 0, trainer.device))) > 2 * STOP_CHECK_EVERY
    monkeypatch.setattr(trainer.val_data, "batches", signalled)
    with pytest.raises(SystemExit) as e:
        trainer.fit()
    assert e.value.code == 128 + signal.SIGUSR1
    assert read == list(range(STOP_CHECK_EVERY))
    assert _saved(tmp_path) == ["step_4"]
    assert [r["step"] for r in _rows(tmp_path)] == [1, 2, 3, 4] and not any("val_loss" in r for r in _rows(tmp_path))


def test_metrics_report_the_lr_each_step_applied(tmp_path, make_trainer):
    """metrics.jsonl's lr of step n (counted from 1) is what optimizer step n applied: the closed form at s = n - 1."""
    from tests.optim.test_schedule import MIN_RATIO, PEAK, closed_form

    overrides = ["optim.warmup_steps=2", f"optim.min_lr_ratio={MIN_RATIO}", f"train.lr={PEAK}"]
    trainer = make_trainer("train.steps=6", "train.log_every=3", *overrides)
    applied, step = [], trainer.optimizer.step

    def recording_step(*args, **kwargs):
        applied.append(trainer.optimizer.param_groups[0]["lr"])
        return step(*args, **kwargs)

    trainer.optimizer.step = recording_step
    trainer.fit()
    want = [closed_form("cosine", s, 2, 6) for s in range(6)]
    assert applied == pytest.approx(want, rel=1e-12)
    assert [r["lr"] for r in _rows(tmp_path)] == pytest.approx(want, rel=1e-12)

"""Validation: ``evaluate`` is the token sum over the token count of every rank, in eval mode with no balancing
loss and no gradient; the trainer evaluates on the cadence's evaluation steps (host-sync steps), writes
``val_loss``/``val_ppl`` rows and the summary's validation fields, and evaluating never changes the training
(the routers' expert-bias update does not run on evaluation forwards)."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from moe_tune.metrics import MetricsWriter
from moe_tune.train import Cadence
from moe_tune.train.evaluate import evaluate, perplexity
from tests.harness import run_ranks


def _rows(path) -> list[dict]:
    return [json.loads(line) for line in open(os.path.join(path, "metrics.jsonl"))]


# -- Cadence -------------------------------------------------------------------------------------------
def test_evaluation_steps_are_logging_and_sync_steps_and_need_a_validation_set():
    c = Cadence(steps=10, log_every=4, eval_every=3)
    assert [s for s in range(1, 11) if c.evals(s)] == [3, 6, 9, 10]
    assert [s for s in range(1, 11) if c.logs(s)] == [3, 4, 6, 8, 9, 10]
    assert [s for s in range(1, 11) if c.syncs(s)] == [3, 4, 6, 8, 9, 10]
    assert [s for s in range(1, 11) if Cadence(10, 4, eval_every=0).evals(s)] == [10]  # 0: at the end only
    assert not any(Cadence(10, 4, eval_every=None).evals(s) for s in range(1, 11))  # no validation set
    assert not any(Cadence(10, 4, eval_every=3).evals(s) for s in (1, 2, 4))


def test_image_steps_sync_without_logging():
    c = Cadence(steps=10, log_every=5, image_every=3)
    assert [s for s in range(1, 11) if c.draws(s)] == [3, 6, 9]
    assert [s for s in range(1, 11) if c.syncs(s)] == [3, 5, 6, 9, 10]
    assert [s for s in range(1, 11) if c.logs(s)] == [5, 10]


# -- evaluate on one process ---------------------------------------------------------------------------
def _fixed_batches(vocab: int) -> list[tuple]:
    """Three batches with different label-token counts (one row fully masked, as a padding row is)."""
    g = torch.Generator().manual_seed(1)
    batches = []
    for masked_0, masked_1 in ((0, 0), (5, 2), (32, 3)):  # row 0 of the last batch is padding: all -100
        ids = torch.randint(0, vocab, (2, 32), generator=g)
        labels = ids.clone()
        labels[0, :masked_0] = -100
        labels[1, :masked_1] = -100
        batches.append((ids, labels, None))
    return batches


def test_evaluate_is_the_token_sum_over_the_token_count_without_balancing_losses(make_trainer):
    trainer = make_trainer("train.steps=1", "train.aux_loss_coef=0.5", "train.z_loss_coef=0.5")
    model = trainer.model
    batches = _fixed_batches(model.config.vocab_size)
    assert model.training
    got = evaluate(model, batches, torch.device("cpu"))
    assert model.training  # restored
    assert all(p.grad is None for p in model.parameters())  # no_grad: nothing accumulated

    model.eval()
    ce_sum, count, means = 0.0, 0, []
    with torch.no_grad():
        for ids, labels, _ in batches:
            logits = model(ids, return_logits=True).logits.float()
            shifted = labels[:, 1:].reshape(-1)
            s = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), shifted, ignore_index=-100, reduction="sum"
            )
            n = int((shifted != -100).sum())
            ce_sum, count = ce_sum + float(s), count + n
            means.append(float(s) / n)
    model.train()
    assert float(got) == pytest.approx(ce_sum / count, rel=1e-5)
    assert abs(float(got) - sum(means) / len(means)) > 1e-3  # the batches' counts differ: not a mean of means

    model.eval()
    assert float(evaluate(model, batches, torch.device("cpu"))) == pytest.approx(float(got), rel=1e-6)
    assert not model.training  # a model in eval mode stays in eval mode


def test_evaluate_without_any_label_token_is_nan_and_perplexity_saturates():
    class Zero(torch.nn.Module):
        def forward(self, ids, labels=None, position_ids=None, loss_normalizer=None, return_logits=None):
            return type("Out", (), {"ce_loss": torch.zeros(())})()

    ids = torch.zeros(1, 4, dtype=torch.long)
    assert math.isnan(float(evaluate(Zero(), [(ids, torch.full_like(ids, -100), None)], torch.device("cpu"))))
    assert perplexity(math.log(7.0)) == pytest.approx(7.0)
    assert perplexity(1e6) == math.inf


# -- evaluate on 2 gloo ranks --------------------------------------------------------------------------
class _TokenLoss(torch.nn.Module):
    """Each label token's loss is its input id (as a float): sums are known exactly."""

    def forward(self, ids, labels=None, position_ids=None, loss_normalizer=None, return_logits=None):
        mask = labels[:, 1:] != -100
        return type("Out", (), {"ce_loss": (ids[:, :-1].float() * mask).sum() / loss_normalizer})()


def _eval_rank(rank: int, out_dir: str) -> None:
    ids = torch.full((1, 5), 1.0 if rank == 0 else 3.0).long()
    labels = ids.clone()
    if rank == 0:
        labels[0, :4] = -100  # rank 0: 1 label token of loss 1; rank 1: 4 tokens of loss 3
    padding = (torch.zeros_like(ids), torch.full_like(ids, -100), None)  # equal batch counts per rank
    loss = evaluate(_TokenLoss(), [(ids, labels, None), padding], torch.device("cpu"))
    with open(os.path.join(out_dir, f"rank{rank}"), "w") as f:
        f.write(repr(float(loss)))


@pytest.mark.dist
def test_evaluate_reduces_sums_and_counts_over_ranks(tmp_path):
    run_ranks(_eval_rank, 2, str(tmp_path))
    expected = (1 * 1.0 + 4 * 3.0) / 5  # 2.6; the mean of the ranks' means would be 2.0
    assert [float((tmp_path / f"rank{r}").read_text()) for r in (0, 1)] == pytest.approx([expected] * 2, rel=1e-6)


# -- the trainer -----------------------------------------------------------------------------------------
def test_trainer_evaluates_on_eval_steps_only_with_host_syncs_there(tmp_path, make_trainer, monkeypatch):
    from moe_tune.metrics import StepTimer

    trainer = make_trainer("train.steps=5", "train.log_every=3", "train.eval_every=2", "data.val_fraction=0.1")
    assert trainer.val_data is not None
    paused, evaluated = [], []
    pause, run_eval = StepTimer.pause, trainer._evaluate
    monkeypatch.setattr(StepTimer, "pause", lambda self: (paused.append(trainer.step), pause(self))[1])
    monkeypatch.setattr(trainer, "_evaluate", lambda *a: (evaluated.append(trainer.step), run_eval(*a))[1])
    summary = trainer.fit()
    assert paused == [2, 3, 4, 5] and evaluated == [2, 4, 5]
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]  # every step's row; evaluation steps are sync steps
    assert ["val_loss" in r for r in rows] == [False, True, False, True, True]
    for r in rows:
        if "val_loss" in r:
            assert r["val_ppl"] == pytest.approx(math.exp(r["val_loss"]), rel=1e-12)
            assert math.isfinite(r["val_loss"]) and r["val_loss"] > 0
    # The last row's value is the final model's loss over the whole validation set.
    again = evaluate(trainer.model, trainer.val_data.batches(trainer.layout, 0, trainer.device), trainer.device)
    assert rows[-1]["val_loss"] == pytest.approx(float(again), rel=1e-6)
    vals = [(r["val_loss"], r["step"]) for r in rows if "val_loss" in r]
    assert summary["final_val_loss"] == rows[-1]["val_loss"] and summary["final_val_ppl"] == rows[-1]["val_ppl"]
    assert (summary["best_val_loss"], summary["best_val_step"]) == min(vals)
    on_disk = json.load(open(tmp_path / "summary.json"))
    assert on_disk["best_val_step"] == summary["best_val_step"]


def test_evaluating_leaves_training_and_the_expert_bias_unchanged(tmp_path, make_trainer):
    """tiny_deepseek_v3 has correction biases updated from the training steps' loads: a run that evaluates after
    every step trains exactly as one that evaluates only at the end (same losses, same biases, bitwise)."""
    common = ["model=tiny_deepseek_v3", "train.steps=3", "train.bias_update_rate=0.01", "data.val_fraction=0.1"]
    runs = {}
    for every in (1, 0):
        out = tmp_path / f"every{every}"
        trainer = make_trainer(*common, f"train.eval_every={every}", out=str(out))
        updates = []
        update = trainer._update_expert_bias
        trainer._update_expert_bias = lambda load, update=update, updates=updates: (updates.append(1), update(load))
        trainer.fit()
        assert len(updates) == 3  # once per optimizer step, never for an evaluation
        biases = [m.router.e_score_correction_bias.clone() for m in trainer.moe_layers]
        runs[every] = ([r["loss"] for r in _rows(out)], biases, _rows(out)[-1]["val_loss"])
    assert runs[1][0] == runs[0][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[1][1], runs[0][1], strict=True))
    assert any(b.abs().sum() > 0 for b in runs[1][1])  # the biases did move
    assert runs[1][2] == runs[0][2]


def test_summary_validation_fields():
    w = MetricsWriter("unused", enabled=False, warmup_steps=0)
    assert w.validation_summary() == {}
    for step, val in ((2, 3.0), (3, None), (4, 2.5), (6, 2.5), (8, 2.75)):
        row = {"step": step, "loss": 1.0}
        if val is not None:
            row.update(val_loss=val, val_ppl=math.exp(val))
        w.log(row)
    assert w.validation_summary() == {
        "final_val_loss": 2.75,
        "final_val_ppl": math.exp(2.75),
        "best_val_loss": 2.5,
        "best_val_step": 4,  # the earliest of equals
    }

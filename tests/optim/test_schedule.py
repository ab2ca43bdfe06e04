"""The learning-rate schedule (optim.schedule, optim.warmup_steps, optim.min_lr_ratio) against its closed form: the
lr each optimizer step applies, read from the optimizer as the step runs (tests/train/test_loop.py: what
metrics.jsonl reports for it)."""

from __future__ import annotations

import math

import pytest
import torch

from moe_tune.config import SCHEDULES, OptimConfig
from moe_tune.optim import build_optimizer, build_scheduler

PEAK, MIN_RATIO = 2e-3, 0.1


def closed_form(schedule: str, s: int, warmup: int, total: int) -> float:
    """The lr of step s (0-based) of ``total``: linear warm-up to the peak at step warmup - 1, then the schedule's
    decay over the remaining steps, reaching its end at the last step, total - 1."""
    if s < warmup:
        return PEAK * (s + 1) / warmup
    if schedule == "constant":
        return PEAK
    progress = (s - (warmup - 1)) / (total - warmup)
    return PEAK * (MIN_RATIO + (1 - MIN_RATIO) * 0.5 * (1 + math.cos(math.pi * progress)))


def test_every_schedule_has_a_closed_form_here():
    assert set(SCHEDULES) == {"cosine", "constant"}  # a new schedule needs its closed form in this file


def _applied_lrs(schedule: str, warmup: int, total: int) -> list[float]:
    """The lr of every optimizer step of a run of ``total`` steps, read as the trainer's step applies it."""
    p = torch.nn.Parameter(torch.zeros(4))
    cfg = OptimConfig(schedule=schedule, warmup_steps=warmup, min_lr_ratio=MIN_RATIO)
    opt = build_optimizer([("w", p)], cfg, PEAK)
    sched = build_scheduler(opt, cfg, total)
    lrs = []
    for _ in range(total):
        lrs.append(opt.param_groups[0]["lr"])
        p.grad = torch.ones_like(p)
        opt.step()
        sched.step()
    return lrs


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("warmup, total", [(4, 14), (1, 9), (0, 9)])
def test_each_step_applies_the_closed_form(schedule, warmup, total):
    lrs = _applied_lrs(schedule, warmup, total)
    want = [closed_form(schedule, s, max(warmup, 1), total) for s in range(total)]
    assert lrs == pytest.approx(want, rel=1e-12)
    assert lrs[0] == pytest.approx(PEAK / max(warmup, 1))
    assert lrs[max(warmup, 1) - 1] == pytest.approx(PEAK)  # the end of warm-up is the peak
    end = MIN_RATIO * PEAK if schedule == "cosine" else PEAK
    assert lrs[-1] == pytest.approx(end, rel=1e-12)  # the last step, not the one after it
    if schedule == "cosine":
        mid = max(warmup, 1) - 1 + (total - max(warmup, 1)) // 2  # half way through the decay (even lengths here)
        assert lrs[mid] == pytest.approx(PEAK * (1 + MIN_RATIO) / 2, rel=1e-12)
        assert lrs[-2] > lrs[-1] * (1 + 1e-3)  # the minimum is not reached one step early
        assert all(a > b for a, b in zip(lrs[max(warmup, 1) - 1 :], lrs[max(warmup, 1) :]))

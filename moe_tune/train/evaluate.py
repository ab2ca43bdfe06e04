"""Held-out loss: the mean cross-entropy over every label token of the validation set on all ranks.

Reduced as training's loss is: each rank sums its token losses and counts its label tokens, one all-reduce adds
both over every rank, and the loss is sum / count (not a mean of per-rank or per-batch means). The model runs
in eval mode under no_grad: no balancing (aux/z) losses, no input jitter or dropout; the routers' expert-bias
update is the trainer's, after a training step, and never runs here. Nothing here waits for the device: the
caller reads the result at a sync step.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

# Validation batches between two checks for a stop signal: each check is an all-reduce and a host sync.
STOP_CHECK_EVERY = 8


def evaluate(
    model: torch.nn.Module,
    batches: Iterable,
    device: torch.device,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    stopped: Callable[[], bool] | None = None,
) -> torch.Tensor | None:
    """Mean token loss over ``batches`` (``(ids, labels, position_ids)`` on ``device``, labels -100 where no
    loss) of every rank, as a 0-d fp32 device tensor; NaN if no rank has a label token. Every rank must pass the
    same number of batches (expert-parallel forwards are collectives); a padding row is fully -100.
    ``model.training`` is restored afterwards. ``stopped`` (a collective: every rank's answer is the same) is asked
    every ``STOP_CHECK_EVERY`` batches; once it says yes the pass ends, returning None: a whole validation set can
    outlast a scheduler's grace period after a signal."""
    was_training = model.training
    model.eval()
    ce_sum = torch.zeros((), dtype=torch.float32, device=device)
    tokens = torch.zeros((), dtype=torch.float32, device=device)
    one = torch.ones((), dtype=torch.float32, device=device)  # loss_normalizer 1: the forward returns the token sum
    try:
        with torch.no_grad():
            for i, (ids, labels, pos) in enumerate(batches):
                if stopped is not None and i % STOP_CHECK_EVERY == STOP_CHECK_EVERY - 1 and stopped():
                    return None
                with autocast():
                    # no logits: the loss alone, as in training (the fused loss never builds them)
                    out = model(ids, labels=labels, position_ids=pos, loss_normalizer=one, return_logits=False)
                ce_sum += out.ce_loss.float()  # fp32 island: the sum over many tokens
                tokens += (labels[:, 1:] != -100).sum()  # the model shifts labels left by one
    finally:
        model.train(was_training)
    totals = torch.stack([ce_sum, tokens])
    if dist.is_initialized():
        dist.all_reduce(totals)  # mesh: all ranks (every rank holds its share of the validation rows)
    return torch.where(totals[1] > 0, totals[0] / totals[1].clamp(min=1), torch.full_like(totals[0], math.nan))


def perplexity(loss: float) -> float:
    """exp(loss), inf past float range."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


__all__ = ["evaluate", "perplexity"]

"""The metrics rows of a sync step: the device values of the steps since the last sync, read in one host sync,
become one metrics.jsonl row per step (``moe_tune.metrics.step_row``), the last with the sync step's validation
loss, expert load and peak memory."""

from __future__ import annotations

import math

import torch

from moe_tune.metrics import peak_memory_gib, step_row
from moe_tune.moe.stats import MoEStats
from moe_tune.train.evaluate import perplexity


def metrics_rows(
    pending: list,
    timed: list,
    *,
    positions: int,
    skipped: int,
    world: int,
    flops_per_token: float,
    device: torch.device,
    val_loss: torch.Tensor | None = None,
    moe_stats: MoEStats | None = None,
) -> tuple[list[dict], dict]:
    """The rows of the ``pending`` steps ((step, lr, the training step's device values) each; ``timed``: their
    seconds and peaks; ``positions``: row positions per step over all ranks; ``skipped``: the guard's count of
    skipped steps, these included), the last with the validation loss and the expert load of ``moe_stats`` (the
    last step's; max over mean, and per decoder layer i as ``expert_load/layer_<i>``, the second value returned,
    for the experiment logger)."""
    n = len(pending)
    outs = [out for *_, out in pending]
    values = [o["loss"].float() for o in outs] + [o["grad_norm"].float().to(device) for o in outs]
    if val_loss is not None:
        values.append(val_loss.float())
    num_layers = 0
    if moe_stats is not None:
        loads = moe_stats.counts_LE().float()
        ratio_L = (loads.max(dim=1).values / loads.mean(dim=1).clamp(min=1)).to(device)
        values += [ratio_L.mean(), *ratio_L]
        num_layers = len(ratio_L)
    # host sync: one .tolist() per sync step for its rows (the device is idle: the timer synced)
    flat = torch.stack(values).tolist()
    losses, norms, rest = flat[:n], flat[n : 2 * n], flat[2 * n :]
    extra = {}
    if val_loss is not None:
        val = rest.pop(0)
        extra.update(val_loss=val, val_ppl=perplexity(val))
    if num_layers:
        extra["expert_load_max_over_mean"] = rest[0]
    layer_idx = moe_stats.layer_idx if moe_stats is not None else ()
    layers = {f"expert_load/layer_{i}": v for i, v in zip(layer_idx, rest[1 : 1 + num_layers])}
    skipped -= sum(not math.isfinite(g) for g in norms)  # as of before the first
    rows = []
    for (step, lr, out), loss, grad_norm, (seconds, peak) in zip(pending, losses, norms, timed):
        skipped += not math.isfinite(grad_norm)  # the guard's rule: a non-finite norm skipped the update
        tokens = (*out["tokens"], positions)  # real, label, positions: all ranks'
        row = step_row(step, loss, grad_norm, lr, tokens, seconds, world, flops_per_token, peak)
        rows.append({**row, "skipped_steps": skipped})
    # The sync step's row: its evaluation's memory too, its validation loss and expert loads.
    rows[-1]["peak_mem_gib"], rows[-1]["peak_reserved_gib"] = map(max, zip(timed[-1][1], peak_memory_gib(device)))
    rows[-1].update(extra)
    return rows, layers

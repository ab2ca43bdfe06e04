"""The non-finite gradient guard: counts steps skipped for a NaN/inf gradient norm on the device, reads the
counts only where the host synchronizes anyway, and says when the run has diverged."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger("moe_tune")


@dataclass(frozen=True)
class Diverged:
    """Steps ``first``..``last`` (counted from 1) all had a non-finite gradient norm."""

    first: int
    last: int

    def message(self, step: int, limit: int) -> str:
        """The stop line at ``step`` (``limit``: train.max_nonfinite_steps)."""
        if self.last == step:  # the run of non-finite steps goes on to now: nothing since first - 1 was applied
            weights = f"so the weights are those after step {self.first - 1} (as in any checkpoint saved since)"
        else:
            weights = f"steps {self.last + 1}-{step} since were finite and applied"
        return (
            f"stopping at step {step}: steps {self.first}-{self.last} all had a non-finite gradient norm "
            f"(train.max_nonfinite_steps={limit}); every one was skipped, {weights}. Lower train.lr or check the "
            "data of those steps; resume with checkpoint.resume=auto, or, if the loss had already climbed before "
            f"step {self.first} (a finite step can wreck the weights too), from a checkpoint before the climb "
            "(checkpoint.resume=<its path>) or anew in another output_dir"
        )


class NonFiniteGuard:
    """Counts non-finite steps without a host sync; ``check`` reads the counts and reports a divergence.

    ``record`` (every step, after the optimizer step) updates four int64 device scalars: the current run of
    non-finite steps in a row, the longest run so far and the step it reached, and the total skipped. The
    optimizer already skipped each such update on the device (``found_inf``), so weights and optimizer state
    never take one. ``check`` (at the trainer's logging and checkpoint steps, after their sync, and before any
    checkpoint is saved) reads them: a run longer than ``max_in_a_row`` is a divergence even if finite steps
    followed it. So the stop comes at the first logging or checkpoint step after the run passed the limit, up to
    ``train.log_every - 1`` steps later than a check after every step would stop; no checkpoint is saved once
    the limit is passed. Every rank reaches the same verdict: the gradient norm is global."""

    def __init__(self, max_in_a_row: int, device: torch.device, warn: bool = True):
        self.max_in_a_row, self.warn = max_in_a_row, warn
        # [current run, longest run, the step the longest run reached, total skipped]
        self.counts_4 = torch.zeros(4, dtype=torch.int64, device=device)
        self.in_a_row = self.skipped = 0  # host copies, as of the last check

    def record(self, grad_norm: torch.Tensor, step: int) -> None:
        """``step``: the step just taken, counted from 1. Device ops only."""
        run, longest, reached, skipped = self.counts_4.unbind()
        bad = (~torch.isfinite(grad_norm)).to(device=self.counts_4.device, dtype=torch.int64).reshape(())
        run = (run + 1) * bad
        reached = torch.where((run > 0) & (run >= longest), step, reached)  # ties: the later (ongoing) run
        self.counts_4 = torch.stack([run, torch.maximum(run, longest), reached, skipped + bad])

    def check(self, step: int) -> Diverged | None:
        """At ``step`` (the host has synchronized): warn about newly skipped steps; a ``Diverged`` once more
        than ``max_in_a_row`` steps in a row were non-finite, else None."""
        run, longest, reached, skipped = self.counts_4.tolist()  # host sync: 4 ints, after the step's own sync
        new, self.in_a_row, self.skipped = skipped - self.skipped, run, skipped
        if new and self.warn:
            log.warning(
                "steps up to %d: %d more had a non-finite gradient norm; their updates were skipped on the device, "
                "weights unchanged by them (%d in a row now, %d in this run)",
                step,
                new,
                run,
                skipped,
            )
        if longest > self.max_in_a_row:
            return Diverged(first=reached - longest + 1, last=reached)
        return None


__all__ = ["Diverged", "NonFiniteGuard"]

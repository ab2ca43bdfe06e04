"""Which steps log, evaluate, draw the expert-load image, save a checkpoint, and synchronize the host: a pure
function of the step number, so every rank reaches the same collectives (the signal agreement, the validation
all-reduce) on the same steps."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Cadence:
    """``steps``: the last step; ``log_every``: a metrics row every that many steps and at the last;
    ``checkpoint_every``: a checkpoint every that many steps (0: none); ``eval_every``: validation every that many
    steps and at the last (0: at the last only; None: there is no validation set); ``image_every``: the expert-load
    image every that many steps (0: never). Steps count from 1 (after the update).

    An evaluation step is also a logging step: its metrics row carries the validation loss beside the training
    fields."""

    steps: int
    log_every: int
    checkpoint_every: int = 0
    eval_every: int | None = None
    image_every: int = 0

    def evals(self, step: int) -> bool:
        if self.eval_every is None:
            return False
        return step == self.steps or (self.eval_every > 0 and step % self.eval_every == 0)

    def logs(self, step: int) -> bool:
        return step % self.log_every == 0 or step == self.steps or self.evals(step)

    def saves(self, step: int) -> bool:
        return bool(self.checkpoint_every) and step % self.checkpoint_every == 0

    def draws(self, step: int) -> bool:
        return bool(self.image_every) and step % self.image_every == 0

    def syncs(self, step: int) -> bool:
        """The host waits for the device only here: to log (and evaluate), to draw, to save, and to agree on a
        stop."""
        return self.logs(step) or self.saves(step) or self.draws(step)


__all__ = ["Cadence"]

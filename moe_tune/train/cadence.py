"""Which steps log, save a checkpoint, and synchronize the host: a pure function of the step number, so every
rank reaches the same collectives (the signal agreement) on the same steps."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Cadence:
    """``steps``: the last step; ``log_every``: a metrics row every that many steps and at the last;
    ``checkpoint_every``: a checkpoint every that many steps (0: none). Steps count from 1 (after the update)."""

    steps: int
    log_every: int
    checkpoint_every: int = 0

    def logs(self, step: int) -> bool:
        return step % self.log_every == 0 or step == self.steps

    def saves(self, step: int) -> bool:
        return bool(self.checkpoint_every) and step % self.checkpoint_every == 0

    def syncs(self, step: int) -> bool:
        """The host waits for the device only here: to log, to save, and to agree on a stop."""
        return self.logs(step) or self.saves(step)


__all__ = ["Cadence"]

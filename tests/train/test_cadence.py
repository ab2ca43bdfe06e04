"""Which steps log, save and synchronize: a pure function of the step, the same on every rank."""

from __future__ import annotations

from moe_tune.train import Cadence


def test_logging_checkpoint_and_last_steps_are_the_only_sync_steps():
    c = Cadence(steps=10, log_every=4, checkpoint_every=3)
    assert [s for s in range(1, 11) if c.logs(s)] == [4, 8, 10]  # the last step logs whatever log_every says
    assert [s for s in range(1, 11) if c.saves(s)] == [3, 6, 9]
    assert [s for s in range(1, 11) if c.syncs(s)] == [3, 4, 6, 8, 9, 10]


def test_log_every_one_syncs_every_step_and_no_checkpoints_without_every():
    c = Cadence(steps=5, log_every=1)
    assert all(c.logs(s) and c.syncs(s) for s in range(1, 6))
    assert not any(c.saves(s) for s in range(1, 6))

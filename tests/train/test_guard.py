"""The non-finite guard counts on the device and is read only at check(): counts, runs, the divergence verdict."""

from __future__ import annotations

import math

import pytest
import torch

from moe_tune.train import Diverged, NonFiniteGuard

NAN, INF = math.nan, math.inf


def _record(guard: NonFiniteGuard, norms: list[float], first_step: int = 1) -> None:
    for i, norm in enumerate(norms):
        guard.record(torch.tensor(norm), first_step + i)


@pytest.fixture
def no_host_sync(monkeypatch):
    """Any host read of a tensor fails: what record() must never do."""

    def refuse(*args, **kwargs):
        raise AssertionError("host sync in NonFiniteGuard.record")

    for name in ("item", "tolist", "__bool__", "__float__", "__int__", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, refuse)


def test_record_never_reads_the_device(no_host_sync):
    guard = NonFiniteGuard(max_in_a_row=2, device=torch.device("cpu"))
    _record(guard, [1.0, NAN, INF, 2.0])


def test_counts_skipped_steps_and_the_current_run():
    guard = NonFiniteGuard(max_in_a_row=2, device=torch.device("cpu"))
    _record(guard, [1.0, NAN, INF, 2.0, NAN])
    assert guard.check(5) is None
    assert (guard.skipped, guard.in_a_row) == (3, 1)
    _record(guard, [3.0], first_step=6)
    assert guard.check(6) is None and (guard.skipped, guard.in_a_row) == (3, 0)


def test_exactly_the_limit_in_a_row_goes_on():
    guard = NonFiniteGuard(max_in_a_row=2, device=torch.device("cpu"))
    _record(guard, [NAN, NAN, 1.0, NAN, NAN])
    assert guard.check(5) is None


def test_a_run_past_the_limit_diverges_at_the_check_even_after_finite_steps():
    """Checked only at logging steps: a run of 3 (limit 1) that ended before the check still stops the run."""
    guard = NonFiniteGuard(max_in_a_row=1, device=torch.device("cpu"))
    _record(guard, [1.0, NAN, NAN, NAN, 1.0, 1.0])
    assert guard.check(6) == Diverged(first=2, last=4)


def test_an_ongoing_run_is_reported_up_to_the_check():
    guard = NonFiniteGuard(max_in_a_row=2, device=torch.device("cpu"))
    _record(guard, [1.0, NAN, NAN, 1.0, NAN, NAN, NAN, NAN])
    assert guard.check(8) == Diverged(first=5, last=8)
    assert guard.skipped == 6 and guard.in_a_row == 4


def test_zero_allowed_stops_at_the_first():
    guard = NonFiniteGuard(max_in_a_row=0, device=torch.device("cpu"))
    _record(guard, [1.0, 1.0, INF])
    assert guard.check(3) == Diverged(first=3, last=3)

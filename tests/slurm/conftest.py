"""``slurm``: a real single-machine Slurm (munged, slurmctld, slurmd) for this test session, or a skip naming what
is missing. ``tests/slurm/install.sh`` installs the packages (the test command runs it)."""

from __future__ import annotations

import os

import pytest

from tests.slurm.cluster import LocalSlurm, missing_commands


@pytest.fixture(scope="session")
def slurm():
    missing = missing_commands()
    if missing:
        pytest.skip(f"Slurm is not installed here (no {', '.join(missing)}); tests/slurm/install.sh installs it")
    if os.geteuid() != 0:
        pytest.skip("the local Slurm runs its daemons as root; these tests need root")
    try:
        cluster = LocalSlurm.start()
    except (OSError, RuntimeError, TimeoutError) as e:
        pytest.skip(f"the local Slurm did not start: {e}")
    yield cluster
    cluster.stop()

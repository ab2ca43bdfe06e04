"""A rank of a launched run leaves without the interpreter's teardown: a gloo worker thread that needs Python
(a collective's tensors released, a work's callback run) once the teardown began would abort the process
("terminate called without an active exception", exit 134) where the run's error said exit 1."""

from __future__ import annotations

import subprocess

import pytest

from tests.harness import PY, free_port

pytestmark = pytest.mark.dist

# The failing rank: its run says its error and raises SystemExit(1) with a collective of a group still referenced
# (as the trainer's mesh keeps its groups) and finishing late; the teardown, once it reaches SlowTeardown, lets
# rank 1 finish the collective, whose callback then runs on the group's worker thread during the teardown.
FAILING_RANK = """
import sys, time
import torch
import torch.distributed as dist
from moe_tune.cli import train
from moe_tune.distributed.process_group import destroy_distributed, init_distributed

MARK = sys.argv[1]
GROUPS = []


class SlowTeardown:
    def __del__(self, sleep=time.sleep, open=open):
        open(MARK, "w").close()
        sleep(5)


def failing_run(cfg):
    init_distributed("gloo")
    GROUPS.append(dist.new_group(backend="gloo"))
    work = dist.all_gather([torch.zeros(1), torch.zeros(1)], torch.ones(1), group=GROUPS[0], async_op=True)
    work.get_future().then(lambda f: None)
    destroy_distributed()
    print("moe-tune: error: the run's line", file=sys.stderr)
    raise SystemExit(1)


train.run = failing_run
train.precheck = lambda argv: argv
_slow = SlowTeardown()  # underscored: cleared first, before GROUPS
sys.argv = ["moe-tune", "hydra.run.dir=" + sys.argv[2], "hydra.output_subdir=null"]
train.main()
"""

# The other rank: joins the collective once the failing rank's teardown began (or gives up after a minute).
OTHER_RANK = """
import os, sys, time
import torch
import torch.distributed as dist
from moe_tune.distributed.process_group import init_distributed

init_distributed("gloo")
group = dist.new_group(backend="gloo")
deadline = time.monotonic() + 60
while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
    time.sleep(0.05)
dist.all_gather([torch.zeros(1), torch.zeros(1)], torch.ones(1), group=group)
"""


def test_a_rank_that_fails_exits_with_its_code_not_an_abort_in_the_teardown(tmp_path, cli_env):
    mark = str(tmp_path / "teardown-began")
    env = {**cli_env, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    other = subprocess.Popen(
        [PY, "-c", OTHER_RANK, mark], env={**env, "RANK": "1", "LOCAL_RANK": "1"}, stderr=subprocess.DEVNULL
    )
    try:
        r = subprocess.run(
            [PY, "-c", FAILING_RANK, mark, str(tmp_path / "run")],
            env={**env, "RANK": "0", "LOCAL_RANK": "0"},
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        other.kill()
        other.wait()
    assert "terminate called" not in r.stderr, r.stderr[-3000:]
    assert (r.returncode, r.stderr.strip()) == (1, "moe-tune: error: the run's line"), r.stderr[-3000:]


def test_the_launcher_names_a_killed_rank_before_the_peers_that_lost_it():
    """torchrun's failures carry whole-second timestamps: a rank killed by a signal and its peer that exited 1 on
    the closed connection fail in the same second, and the killed one is named; torchrun's own SIGTERM to the
    ranks it stops is not a cause."""
    from types import SimpleNamespace as Failure

    from moe_tune.cli.launch import first_failure

    def first(*failures) -> int:
        return first_failure({rank: Failure(timestamp=t, exitcode=code) for rank, (t, code) in enumerate(failures)})[0]

    assert first((5, 1), (5, -9)) == 1
    assert first((5, 2), (5, -15)) == 0
    assert first((4, 1), (5, -9)) == 0

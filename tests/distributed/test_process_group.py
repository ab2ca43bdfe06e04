"""The launcher environment: rank, local rank and world size from torchrun or Slurm variables; the default group
made again under one torchrun."""

from __future__ import annotations

import subprocess

import pytest

from moe_tune.distributed.process_group import dist_env, first_slurm_host
from tests import harness
from tests.harness import PY, ROOT


def test_dist_env_from_launchers():
    torchrun = dist_env({"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8"})
    assert (torchrun.rank, torchrun.local_rank, torchrun.world_size, torchrun.launcher) == (5, 1, 8, "torchrun")
    slurm = dist_env({"SLURM_PROCID": "9", "SLURM_LOCALID": "1", "SLURM_NTASKS": "16"})
    assert (slurm.rank, slurm.local_rank, slurm.world_size, slurm.launcher) == (9, 1, 16, "slurm")
    assert dist_env({}).world_size == 1
    assert first_slurm_host("gpu[003-005,010],cpu7") == "gpu003"
    assert first_slurm_host("node7,node8") == "node7"


# Each job of a sweep makes the default group (and a group under it) again over torchrun's store, rank 0 a few
# seconds late, as when it writes the previous job's outputs alone.
AGAIN = """
import os, sys, time, torch, torch.distributed as dist
from moe_tune.distributed.process_group import destroy_distributed, init_distributed
out = open(os.path.join(sys.argv[1], "rank" + os.environ["RANK"]), "w")
for job in range(3):
    if os.environ["RANK"] == "0":
        time.sleep(2)
    init_distributed("gloo", timeout_s=60)
    t = torch.ones(1)
    dist.all_reduce(t, group=dist.new_group(backend="gloo"))
    print("job", job, int(t.item()), file=out, flush=True)
    destroy_distributed()
"""


@pytest.mark.slow
def test_the_default_group_made_again_under_torchrun_connects(tmp_path):
    """torchrun's store outlives a group: a group made again took the previous one's keys, and the early rank read
    its peer's old address (gloo: "Connection refused", then the run failed or hung) in the second or third job of a
    ``-m`` sweep under torchrun."""
    script = tmp_path / "again.py"
    script.write_text(AGAIN)
    cmd = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script), str(tmp_path)]
    env = dict(harness.cli_env(), PYTHONPATH=ROOT)
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    for rank in range(2):
        assert (tmp_path / f"rank{rank}").read_text().splitlines() == [f"job {j} 2" for j in range(3)]

"""The launcher environment: rank, local rank and world size from torchrun or Slurm variables."""

from __future__ import annotations

from moe_tune.distributed.process_group import dist_env, first_slurm_host


def test_dist_env_from_launchers():
    torchrun = dist_env({"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8"})
    assert (torchrun.rank, torchrun.local_rank, torchrun.world_size, torchrun.launcher) == (5, 1, 8, "torchrun")
    slurm = dist_env({"SLURM_PROCID": "9", "SLURM_LOCALID": "1", "SLURM_NTASKS": "16"})
    assert (slurm.rank, slurm.local_rank, slurm.world_size, slurm.launcher) == (9, 1, 16, "slurm")
    assert dist_env({}).world_size == 1
    assert first_slurm_host("gpu[003-005,010],cpu7") == "gpu003"
    assert first_slurm_host("node7,node8") == "node7"

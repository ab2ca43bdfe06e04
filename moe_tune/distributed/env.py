"""Where this process sits among the launched ranks, read from the environment alone: no torch import, so that a
line said while the run starts or stops (``cli.train.first_rank_of_node``) does not wait for one."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    launcher: str  # "torchrun", "slurm" or "single"

    @property
    def device(self) -> torch.device:
        """This rank's device: its local GPU, or the CPU when there is none."""
        import torch

        if not torch.cuda.is_available():
            return torch.device("cpu")
        return torch.device("cuda", self.local_rank % torch.cuda.device_count())


def dist_env(environ: dict[str, str] | None = None) -> DistEnv:
    """Where this process sits, read from the environment only (no process group needed)."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return DistEnv(int(env["RANK"]), int(env.get("LOCAL_RANK", "0")), int(env["WORLD_SIZE"]), "torchrun")
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return DistEnv(int(env["SLURM_PROCID"]), int(env.get("SLURM_LOCALID", "0")), int(env["SLURM_NTASKS"]), "slurm")
    return DistEnv(0, 0, 1, "single")


__all__ = ["DistEnv", "dist_env"]

"""Process groups and device meshes: ``env`` (rank and world from torchrun or Slurm), ``mesh`` (ParallelDims)."""

from moe_tune.dist.env import DistEnv, device_type, dist_env, init_distributed
from moe_tune.dist.mesh import ParallelDims, ParallelMesh

__all__ = ["DistEnv", "ParallelDims", "ParallelMesh", "device_type", "dist_env", "init_distributed"]

"""Process groups and device meshes: ``env`` (rank and world from torchrun or Slurm), ``mesh`` (the meshes of a
``moe_tune.config.ParallelDims`` layout)."""

from moe_tune.dist.env import DistEnv, device_type, dist_env, init_distributed
from moe_tune.dist.mesh import ParallelMesh, build_mesh

__all__ = ["DistEnv", "ParallelMesh", "build_mesh", "device_type", "dist_env", "init_distributed"]

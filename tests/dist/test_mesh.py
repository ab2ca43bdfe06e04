"""Device meshes for 64-1024 ranks on the fake backend (no processes), and the launcher environment."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from moe_tune.config import ConfigError, ParallelConfig, ParallelDims
from moe_tune.dist.env import dist_env, first_slurm_host
from moe_tune.dist.mesh import build_mesh

pytestmark = pytest.mark.dist


def _ranks(mesh, name: str) -> list[int]:
    return dist.get_process_group_ranks(mesh.group(name))


@pytest.mark.parametrize(
    "world,dp_replicate,ep,rank",
    [(64, 1, 8, 13), (128, 2, 4, 77), (256, 4, 16, 255), (512, 1, 64, 300), (1024, 8, 8, 517), (1024, 1, 1, 1)],
)
def test_mesh_shapes_and_groups(world, dp_replicate, ep, rank):
    dims = ParallelDims.from_config(ParallelConfig(dp_replicate=dp_replicate, ep=ep), world)
    dp_shard, efsdp = world // dp_replicate, world // dp_replicate // ep
    assert (dims.dp_shard, dims.efsdp, dims.dp) == (dp_shard, efsdp, world)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        mesh = build_mesh(dims, "cpu")
        assert mesh.root.shape == (dp_replicate, efsdp, ep)
        assert mesh.root.mesh_dim_names == ("dp_replicate", "efsdp", "ep")
        assert mesh["dense_fsdp"].shape == (dp_replicate, dp_shard)
        assert mesh["expert_fsdp"].shape == (dp_replicate, efsdp)
        r, rest = divmod(rank, dp_shard)
        f, e = divmod(rest, ep)
        # rank = (r * efsdp + f) * ep + e: ep groups are consecutive ranks, efsdp strides by ep.
        assert _ranks(mesh, "ep") == [r * dp_shard + f * ep + i for i in range(ep)]
        assert _ranks(mesh, "efsdp") == [r * dp_shard + i * ep + e for i in range(efsdp)]
        assert _ranks(mesh, "dp_shard") == list(range(r * dp_shard, (r + 1) * dp_shard))
        assert _ranks(mesh, "dp_replicate") == [i * dp_shard + rest for i in range(dp_replicate)]
        assert _ranks(mesh, "dp") == list(range(world))
        assert (mesh.local_rank("ep"), mesh.local_rank("efsdp"), mesh.local_rank("dp_replicate")) == (e, f, r)
        assert mesh.is_expert_writer() == (f == 0 and r == 0)
        dense_groups = [dist.get_process_group_ranks(g) for g in mesh["dense_fsdp"].get_all_groups()]
        assert dense_groups == [_ranks(mesh, "dp_replicate"), _ranks(mesh, "dp_shard")]
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "kwargs,world,message",
    [
        (dict(ep=3), 8, "parallel.ep (3) must divide parallel.dp_shard (8"),
        (dict(dp_replicate=3), 8, "parallel.dp_replicate (3) must divide the world size (8)"),
        (dict(dp_replicate=2, dp_shard=2), 8, "x parallel.dp_shard (2) must equal the world size (8)"),
    ],
)
def test_bad_layouts_fail_before_any_process_group(kwargs, world, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ParallelDims.from_config(ParallelConfig(**kwargs), world)
    with pytest.raises(ConfigError, match="must divide parallel.dp_shard"):
        ParallelDims(dp_replicate=1, dp_shard=6, ep=4, world_size=6)
    assert not dist.is_initialized()


def test_dist_env_from_launchers():
    torchrun = dist_env({"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8"})
    assert (torchrun.rank, torchrun.local_rank, torchrun.world_size, torchrun.launcher) == (5, 1, 8, "torchrun")
    slurm = dist_env({"SLURM_PROCID": "9", "SLURM_LOCALID": "1", "SLURM_NTASKS": "16"})
    assert (slurm.rank, slurm.local_rank, slurm.world_size, slurm.launcher) == (9, 1, 16, "slurm")
    assert dist_env({}).world_size == 1
    assert first_slurm_host("gpu[003-005,010],cpu7") == "gpu003"
    assert first_slurm_host("node7,node8") == "node7"

"""Device meshes for 64-1024 ranks on the fake backend (no processes)."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from moe_tune.config import ParallelConfig
from moe_tune.distributed.dims import ParallelDims
from moe_tune.distributed.mesh import build_mesh

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

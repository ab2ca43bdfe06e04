"""``ParallelDims`` (``moe_tune.config``) -> the device meshes every parallelism uses, built the torchtitan way.

Expert parallelism borrows its ranks from the data-parallel shard dimension: world = dp_replicate x dp_shard
and dp_shard = efsdp x ep. The root mesh is 3-D, ``(dp_replicate, efsdp, ep)``, row-major, so the ``ep``
ranks of a group are consecutive (one node's GPUs when ep <= GPUs per node) and ``efsdp`` strides by ep:

  rank = (r * efsdp + f) * ep + e        r: dp_replicate index, f: efsdp index, e: ep index

Views (each a DeviceMesh kept here, not re-sliced from the root; flattened dims are bookkept directly):
  ``dp_shard`` = efsdp x ep flattened: FSDP shards every dense parameter over it.
  ``dp``       = all ranks flattened: every rank is data-parallel (its own micro-batches).
  ``ep``, ``efsdp``, ``dp_replicate``: 1-D slices of the root.
  ``dense_fsdp``  = (dp_replicate, dp_shard): the FSDP2 mesh of dense parameters (HSDP if dp_replicate > 1).
  ``expert_fsdp`` = (dp_replicate, efsdp): the FSDP2 mesh of each rank's local experts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from moe_tune.config import ConfigError
from moe_tune.distributed.dims import ParallelDims

AXES = ("dp_replicate", "efsdp", "ep", "dp_shard", "dp", "dense_fsdp", "expert_fsdp")


def build_mesh(dims: ParallelDims, device_type: str) -> ParallelMesh:
    """Create the root mesh and its views; a collective over the default group (all ranks call it)."""
    if dist.get_world_size() != dims.world_size:
        raise ConfigError(f"the process group has {dist.get_world_size()} ranks but the layout expects {dims}")
    root = init_device_mesh(
        device_type, (dims.dp_replicate, dims.efsdp, dims.ep), mesh_dim_names=("dp_replicate", "efsdp", "ep")
    )
    dp = root._flatten("dp")
    views = {
        "dp_replicate": root["dp_replicate"],
        "efsdp": root["efsdp"],
        "ep": root["ep"],
        "dp_shard": root["efsdp", "ep"]._flatten("dp_shard"),
        "dp": dp,
        # Same ranks as (dp_replicate, dp_shard), built by unflattening dp so no flattened dim is re-sliced.
        "dense_fsdp": dp._unflatten(0, (dims.dp_replicate, dims.dp_shard), ("dp_replicate", "dp_shard")),
        "expert_fsdp": root["dp_replicate", "efsdp"],
    }
    return ParallelMesh(dims, root, views)


@dataclass
class ParallelMesh:
    """The meshes of one run, by axis name: ``mesh["ep"]`` is a DeviceMesh, ``mesh.group("ep")`` its group."""

    dims: ParallelDims
    root: DeviceMesh
    views: dict[str, DeviceMesh] = field(repr=False)

    def __getitem__(self, name: str) -> DeviceMesh:
        if name not in self.views:
            raise KeyError(f"no mesh axis {name!r}; axes are {', '.join(AXES)}")
        return self.views[name]

    def group(self, name: str) -> dist.ProcessGroup:
        mesh = self[name]
        if mesh.ndim != 1:
            raise ValueError(f"mesh {name!r} is {mesh.ndim}-D; take the group of one of its 1-D axes")
        return mesh.get_group()

    def local_rank(self, name: str) -> int:
        """This rank's index along a 1-D axis."""
        return self[name].get_local_rank()

    @property
    def device_type(self) -> str:
        return self.root.device_type

    def is_expert_writer(self) -> bool:
        """One rank per expert slice writes it on export: efsdp rank 0 of dp_replicate rank 0."""
        return self.local_rank("efsdp") == 0 and self.local_rank("dp_replicate") == 0

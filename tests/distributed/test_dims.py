"""ParallelDims: a layout that cannot be built fails with its values before any process group exists."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from moe_tune.config import ConfigError, ParallelConfig
from moe_tune.distributed.dims import ParallelDims


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

"""ParallelDims: a layout that cannot be built fails with its values before any process group exists."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from moe_tune.config import ConfigError, ParallelConfig, TrainConfig
from moe_tune.distributed.dims import BatchLayout, ParallelDims


@pytest.mark.parametrize(
    "kwargs,world,message",
    [
        (
            dict(ep=3),
            8,
            "must divide parallel.dp_shard (8, world size 8); expert parallelism borrows its ranks from "
            "dp_shard: try parallel.ep=1 or 2 or 4 or 8",
        ),
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


@pytest.mark.parametrize(
    ("global_batch", "micro_batch", "dp", "accum", "rows"),
    [(-1, 4, 3, 1, 12), (24, 4, 3, 2, 24), (24, 2, 3, 4, 24), (5, 5, 1, 1, 5)],
)
def test_batch_layout_accumulates_micro_batches_to_the_global_batch(global_batch, micro_batch, dp, accum, rows):
    layout = BatchLayout.from_config(TrainConfig(micro_batch_size=micro_batch, global_batch_size=global_batch), dp)
    assert layout == BatchLayout(micro_batch, accum, dp)
    assert (layout.rows_per_step, layout.rows_per_micro_batch) == (rows, micro_batch * dp)


def test_batch_layout_refuses_a_global_batch_of_partial_micro_batches():
    with pytest.raises(ConfigError) as e:
        BatchLayout.from_config(TrainConfig(micro_batch_size=2, global_batch_size=10), 3)
    assert str(e.value) == (
        "train.global_batch_size (10) must be a multiple of train.micro_batch_size (2) x data-parallel ranks (3); "
        "try train.global_batch_size=6"
    )

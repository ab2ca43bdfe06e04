"""``ParallelDims``: the parallel layout of a run, resolved and checked once, before any process group exists;
``BatchLayout``: the rows of one optimizer step over that layout's data-parallel ranks.

world = dp_replicate x dp_shard, and expert parallelism borrows its ranks from dp_shard: dp_shard = efsdp x ep.
``ParallelDims.from_config`` fills ``parallel.dp_shard=-1`` and raises ConfigError for any layout that does not
fit the world size; everything downstream (validate, the mesh, the model build, FSDP) receives the result.
``BatchLayout.from_config`` is made once from ``train.*`` and the data-parallel size; the data loader, the trainer,
the checkpoint (the global batch a resume keeps) and the metrics read it. Pure arithmetic: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_tune.config.schema import ConfigError, ParallelConfig, TrainConfig


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    ep: int
    world_size: int

    def __post_init__(self):
        if self.dp_replicate < 1 or self.ep < 1 or self.dp_shard < 1:
            raise ConfigError(
                f"parallel.dp_replicate ({self.dp_replicate}), parallel.dp_shard ({self.dp_shard}) and parallel.ep "
                f"({self.ep}) must be >= 1 (dp_shard=-1: every rank not used by dp_replicate)"
            )
        if self.dp_replicate * self.dp_shard != self.world_size:
            raise ConfigError(
                f"parallel.dp_replicate ({self.dp_replicate}) x parallel.dp_shard ({self.dp_shard}) must equal the "
                f"world size ({self.world_size}); try parallel.dp_shard=-1"
            )
        if self.dp_shard % self.ep:
            divisors = [e for e in range(1, self.dp_shard + 1) if self.dp_shard % e == 0]
            raise ConfigError(
                f"parallel.ep ({self.ep}) must divide parallel.dp_shard ({self.dp_shard}, world size "
                f"{self.world_size}); expert parallelism borrows its ranks from dp_shard: try parallel.ep="
                f"{' or '.join(map(str, divisors))}"
            )

    @classmethod
    def from_config(cls, parallel: ParallelConfig, world_size: int) -> ParallelDims:
        if parallel.dp_replicate >= 1 and world_size % parallel.dp_replicate:
            raise ConfigError(
                f"parallel.dp_replicate ({parallel.dp_replicate}) must divide the world size ({world_size}); "
                "try parallel.dp_replicate=1"
            )
        dp_shard = world_size // max(parallel.dp_replicate, 1) if parallel.dp_shard == -1 else parallel.dp_shard
        return cls(parallel.dp_replicate, dp_shard, parallel.ep, world_size)

    @property
    def efsdp(self) -> int:
        """FSDP ranks sharding each ep rank's experts."""
        return self.dp_shard // self.ep

    @property
    def dp(self) -> int:
        """Data-parallel ranks: every rank (EP borrows its ranks from dp_shard)."""
        return self.dp_replicate * self.dp_shard

    @property
    def experts_outside_fsdp(self) -> bool:
        """Each ep rank alone holds its experts (efsdp = dp_replicate = 1, e.g. EP over all GPUs): nothing to
        shard or reduce, so the experts stay plain parameters outside FSDP2, cast to the compute dtype and with
        their gradients averaged over dp by the experts themselves."""
        return self.ep > 1 and self.efsdp == 1 and self.dp_replicate == 1

    def check_experts(self, num_experts: int) -> None:
        """The one check that the model's experts split evenly over ``ep``."""
        if num_experts % self.ep:
            fit = max(d for d in range(1, self.dp_shard + 1) if num_experts % d == 0 and self.dp_shard % d == 0)
            raise ConfigError(
                f"the model's number of experts ({num_experts}) must be divisible by parallel.ep ({self.ep}); "
                f"try parallel.ep={fit}"
            )


@dataclass(frozen=True)
class BatchLayout:
    """One optimizer step's rows: ``accum`` micro-batches of ``micro_batch_size`` rows on each of ``dp_size``
    data-parallel ranks. Micro-batch m of rank r holds the step's rows ``(m x dp_size + r) x micro_batch_size``
    onwards (``moe_tune.data.packing.MicroBatches``), so the rows of a step depend on the step alone."""

    micro_batch_size: int
    accum: int
    dp_size: int

    @classmethod
    def from_config(cls, train: TrainConfig, dp_size: int) -> BatchLayout:
        """``train.global_batch_size=-1``: one micro-batch per rank; else as many as make the global batch, which
        must be a whole number of them (ConfigError naming the fix)."""
        per_micro = train.micro_batch_size * dp_size
        if train.global_batch_size == -1:
            return cls(train.micro_batch_size, 1, dp_size)
        if train.global_batch_size % per_micro:
            raise ConfigError(
                f"train.global_batch_size ({train.global_batch_size}) must be a multiple of train.micro_batch_size "
                f"({train.micro_batch_size}) x data-parallel ranks ({dp_size}); try train.global_batch_size={per_micro}"
            )
        return cls(train.micro_batch_size, train.global_batch_size // per_micro, dp_size)

    @property
    def rows_per_micro_batch(self) -> int:
        """Rows of one micro-batch on every rank together."""
        return self.micro_batch_size * self.dp_size

    @property
    def rows_per_step(self) -> int:
        """The global batch in rows: what a resume keeps (the data order)."""
        return self.micro_batch_size * self.accum * self.dp_size

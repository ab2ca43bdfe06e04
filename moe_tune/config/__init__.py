"""The run's configuration: the schema (Hydra structured configs), the parallel layout, and ``validate``.

Imports no torch and nothing of moe_tune below it: every other layer may import it.
"""

from moe_tune.config.dims import ParallelDims
from moe_tune.config.schema import (
    AC_MODES,
    COMM_CONFIGS,
    EXPERT_KERNELS,
    FP8_BACKWARDS,
    FP8_FORMATS,
    FP8_MODES,
    GROUPS,
    KERNEL_SETS,
    PRECISIONS,
    AllToAllConfig,
    CheckpointConfig,
    CommConfig,
    Config,
    ConfigError,
    DataConfig,
    DeepEPConfig,
    KernelsConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    SymmMemConfig,
    TrainConfig,
    comm_config,
    register_configs,
)
from moe_tune.config.validate import validate, world_size_from_env

__all__ = [
    "AC_MODES",
    "COMM_CONFIGS",
    "EXPERT_KERNELS",
    "FP8_BACKWARDS",
    "FP8_FORMATS",
    "FP8_MODES",
    "GROUPS",
    "KERNEL_SETS",
    "PRECISIONS",
    "AllToAllConfig",
    "CheckpointConfig",
    "CommConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "DeepEPConfig",
    "KernelsConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "ParallelDims",
    "SymmMemConfig",
    "TrainConfig",
    "comm_config",
    "register_configs",
    "validate",
    "world_size_from_env",
]

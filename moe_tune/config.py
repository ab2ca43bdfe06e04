"""Configuration schema: dataclasses registered in Hydra's ConfigStore, and ``validate``.

The schema is the single source of truth for every key; ``conf/<group>/<option>.yaml`` only fills values.
Unknown keys fail at compose time because every group is a structured config.
This module imports no torch, no backend and nothing else of moe_tune; whether the backends a config names
are usable on this machine is ``moe_tune.env.require_backends``'s check, run after ``validate``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

PRECISIONS = ("fp32", "amp_bf16", "bf16_fp32_master", "bf16")
COMMS = ("all_to_all", "deepep", "symm_mem")
KERNEL_SETS = ("torch", "te")
EXPERT_KERNELS = ("grouped_mm", "te", "loop")
FP8_MODES = ("none", "current", "delayed", "blockwise", "mxfp8")
FP8_BACKWARDS = ("fp8", "high_precision", "dequantized")
FP8_FORMATS = ("hybrid", "e4m3")
AC_MODES = ("none", "full", "selective")


class ConfigError(ValueError):
    """A configuration or input the user must fix: reported as one line, exit code 2."""


@dataclass
class ModelConfig:
    # A name from conf/model (tiny models are built locally) or a local Hugging Face directory in `path`.
    name: str = "tiny_qwen3_moe"
    path: str | None = None
    # dtype of the exported hf/ weights: "source" keeps each tensor's dtype from the source checkpoint.
    # (Training dtypes are train.precision's.)
    dtype: str = "source"
    # For built-in models: overrides of the Hugging Face config fields (e.g. num_hidden_layers).
    overrides: dict[str, Any] = field(default_factory=dict)
    # The Hugging Face model_type this model follows ("auto": read from model.path's config.json).
    family: str = "auto"


@dataclass
class ParallelConfig:
    dp_replicate: int = 1
    # -1: every rank not used by dp_replicate.
    dp_shard: int = -1
    ep: int = 1
    activation_checkpointing: str = "none"
    # Reshard parameters after forward (ZeRO-3); False keeps them gathered until backward (ZeRO-2-like).
    reshard_after_forward: bool = True


@dataclass
class CommConfig:
    name: str = "all_to_all"
    # DeepEP: streaming multiprocessors given to the communication kernels.
    num_sms: int = 24
    # symm_mem: worst-case rows per rank as a multiple of tokens x top_k.
    capacity_factor: float = 2.0


@dataclass
class KernelsConfig:
    name: str = "torch"
    experts: str = "grouped_mm"
    fp8: str = "none"
    # fp8=delayed only: the scale comes from the amax over this many past steps ("max") or the last ("most_recent").
    fp8_amax_history_len: int = 1024
    fp8_amax_compute_algo: str = "max"
    # fp8=current only: accumulate the forward GEMM in fp32 in chunks (TE's default for current is Hopper's fast,
    # ~14-bit accumulation there; blockwise always splits, delayed offers no choice).
    fp8_fprop_split_accumulator: bool = False
    # Backward GEMMs: "fp8" (quantized, TE's default), or FP8 in the forward only: "high_precision" keeps the bf16
    # operands for the backward, "dequantized" the FP8 ones dequantized (less memory). Not with fp8=delayed.
    # current + high_precision is the recommended FP8 setting: the only one within 2% of bf16 in all measured runs.
    fp8_backward: str = "fp8"
    # None: the recipe's own format (current and delayed: "hybrid", E4M3 forward and E5M2 gradients; blockwise
    # and mxfp8: E4M3). "e4m3": E4M3 throughout (measured: no smaller loss difference than hybrid on an H200).
    fp8_format: str | None = None
    compile: bool = False
    # Chunked linear cross-entropy that never materialises the full logits.
    fused_loss: bool = True
    loss_chunk_size: int = 4096

    def fp8_options(self) -> dict:
        """The keyword arguments of ``moe_tune.kernels.te.fp8_recipe`` that this config sets."""
        return {
            "amax_history_len": self.fp8_amax_history_len,
            "amax_compute_algo": self.fp8_amax_compute_algo,
            "fprop_split_accumulator": self.fp8_fprop_split_accumulator,
            "backward": self.fp8_backward,
            "fp8_format": self.fp8_format,
        }


@dataclass
class DataConfig:
    # "arithmetic" is the built-in instruction set; otherwise a jsonl/parquet file or directory in `path`.
    name: str = "arithmetic"
    path: str | None = None
    num_samples: int = 4096
    prompt_key: str = "prompt"
    response_key: str = "response"
    text_key: str = "text"
    # Mask prompt tokens out of the loss.
    mask_prompt: bool = True
    # Pack several samples into one sequence of train.seq_len.
    packing: bool = True


@dataclass
class OptimConfig:
    name: str = "adamw"
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    warmup_steps: int = 10
    schedule: str = "cosine"
    min_lr_ratio: float = 0.1
    max_grad_norm: float = 1.0
    # train.precision=bf16 only: AdamW in fp32 per chunk, rounded stochastically back to the bf16 parameters and
    # moments (moe_tune/optim/stochastic.py), so updates below bf16's resolution are not lost.
    stochastic_rounding: bool = False


@dataclass
class TrainConfig:
    steps: int = 60
    seq_len: int = 256
    micro_batch_size: int = 4
    # -1: micro_batch_size x data-parallel size (no gradient accumulation).
    global_batch_size: int = -1
    seed: int = 0
    lr: float = 3e-3
    precision: str = "bf16_fp32_master"
    # Load-balancing: auxiliary loss coefficient, router z-loss and aux-loss-free bias update rate.
    aux_loss_coef: float = 0.001
    z_loss_coef: float = 0.0
    bias_update_rate: float = 0.0
    # Forced balanced routing for benchmarks (token i goes to experts i*k..i*k+k-1 mod E).
    force_balanced_routing: bool = False
    log_every: int = 1
    warmup_steps_excluded: int = 3
    # A step whose global gradient norm is NaN/inf is skipped on the device (weights and optimizer state untouched);
    # after more than this many such steps in a row the run stops with exit code 1 (diverged, or broken data).
    max_nonfinite_steps: int = 5


@dataclass
class CheckpointConfig:
    every: int = 0
    resume: str = "auto"
    export_hf: bool = True
    # SIGTERM/SIGUSR1 (Slurm's time limit or preemption, torchrun's shutdown): every rank stops after the same
    # step, a checkpoint of that step is saved, and the process exits 128 + the signal number.
    save_on_signal: bool = True


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    output_dir: str = "outputs/run"


GROUPS = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "comm": CommConfig,
    "kernels": KernelsConfig,
    "data": DataConfig,
    "optim": OptimConfig,
    "train": TrainConfig,
}


def register_configs() -> None:
    """Store the schema as ``base_config`` and ``base_<group>`` so YAML files are type-checked against it."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    for group, schema in GROUPS.items():
        cs.store(group=group, name=f"base_{group}", node=schema)


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1")))


def _choice(value: str, allowed: tuple[str, ...], key: str) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not one of {', '.join(allowed)}; pick one of those")


def resolve_parallel(p: ParallelConfig, world_size: int) -> tuple[int, int, int]:
    """Return (dp_replicate, dp_shard, ep) with dp_shard=-1 filled in, or raise ConfigError."""
    if p.dp_replicate < 1 or p.ep < 1:
        raise ConfigError(f"parallel.dp_replicate ({p.dp_replicate}) and parallel.ep ({p.ep}) must be >= 1")
    if world_size % p.dp_replicate:
        raise ConfigError(
            f"parallel.dp_replicate ({p.dp_replicate}) must divide the world size ({world_size}); "
            f"try parallel.dp_replicate=1"
        )
    dp_shard = world_size // p.dp_replicate if p.dp_shard == -1 else p.dp_shard
    if p.dp_replicate * dp_shard != world_size:
        raise ConfigError(
            f"parallel.dp_replicate ({p.dp_replicate}) x parallel.dp_shard ({dp_shard}) must equal the world size "
            f"({world_size}); try parallel.dp_shard=-1"
        )
    if dp_shard % p.ep:
        raise ConfigError(
            f"parallel.ep ({p.ep}) must divide parallel.dp_shard ({dp_shard}, world size {world_size}); "
            f"expert parallelism borrows its ranks from dp_shard: try parallel.ep=1"
        )
    return p.dp_replicate, dp_shard, p.ep


def validate(cfg: Config, world_size: int | None = None, num_experts: int | None = None) -> None:
    """Cross-group checks, run before any process group exists. Raises ConfigError with one line."""
    world_size = world_size_from_env() if world_size is None else world_size
    _choice(cfg.train.precision, PRECISIONS, "train.precision")
    _choice(cfg.comm.name, COMMS, "comm")
    _choice(cfg.kernels.name, KERNEL_SETS, "kernels")
    _choice(cfg.kernels.experts, EXPERT_KERNELS, "kernels.experts")
    _choice(cfg.kernels.fp8, FP8_MODES, "kernels.fp8")
    _choice(cfg.kernels.fp8_amax_compute_algo, ("max", "most_recent"), "kernels.fp8_amax_compute_algo")
    _choice(cfg.kernels.fp8_backward, FP8_BACKWARDS, "kernels.fp8_backward")
    if cfg.kernels.fp8_format is not None:
        _choice(cfg.kernels.fp8_format, FP8_FORMATS, "kernels.fp8_format")
    if cfg.kernels.fp8_amax_history_len < 1:
        raise ConfigError(
            f"kernels.fp8_amax_history_len ({cfg.kernels.fp8_amax_history_len}) must be at least 1 (steps of amax "
            "history for kernels.fp8=delayed); try kernels.fp8_amax_history_len=1024"
        )
    _choice(cfg.parallel.activation_checkpointing, AC_MODES, "parallel.activation_checkpointing")
    _choice(cfg.model.dtype, ("source", "float32", "bfloat16"), "model.dtype")
    _choice(cfg.optim.name, ("adamw",), "optim")
    if cfg.train.max_nonfinite_steps < 0:
        raise ConfigError(
            f"train.max_nonfinite_steps ({cfg.train.max_nonfinite_steps}) must be >= 0 (0 stops at the first step "
            "with a non-finite gradient norm); try train.max_nonfinite_steps=5"
        )
    if cfg.optim.stochastic_rounding and cfg.train.precision != "bf16":
        raise ConfigError(
            f"optim.stochastic_rounding=true rounds bf16 parameters (got train.precision={cfg.train.precision}, "
            "whose master weights are not bf16); set train.precision=bf16 or drop optim.stochastic_rounding"
        )
    _choice(cfg.optim.schedule, ("cosine", "constant"), "optim.schedule")
    if cfg.data.path is None and cfg.data.name not in ("arithmetic", "random"):
        raise ConfigError(
            f"data={cfg.data.name!r} is not built in (arithmetic, random); pick one or set data.path=<jsonl|parquet|dir>"
        )
    _, dp_shard, ep = resolve_parallel(cfg.parallel, world_size)
    if cfg.model.path is not None and not os.path.isfile(os.path.join(cfg.model.path, "config.json")):
        raise ConfigError(
            f"model.path={cfg.model.path!r} has no config.json; give a local Hugging Face checkpoint directory"
        )
    if num_experts is not None and num_experts % ep:
        raise ConfigError(
            f"the model's number of experts ({num_experts}) must be divisible by parallel.ep ({ep}); "
            f"try parallel.ep={_largest_divisor(num_experts, dp_shard)}"
        )
    t = cfg.train
    if t.steps < 1 or t.seq_len < 2 or t.micro_batch_size < 1:
        raise ConfigError(
            f"train.steps ({t.steps}), train.seq_len ({t.seq_len}) and train.micro_batch_size "
            f"({t.micro_batch_size}) must be positive (seq_len >= 2)"
        )
    dp = world_size
    if t.global_batch_size != -1 and t.global_batch_size % (t.micro_batch_size * dp):
        raise ConfigError(
            f"train.global_batch_size ({t.global_batch_size}) must be a multiple of train.micro_batch_size "
            f"({t.micro_batch_size}) x data-parallel ranks ({dp}); try train.global_batch_size={t.micro_batch_size * dp}"
        )
    if cfg.kernels.experts == "te":
        raise ConfigError(
            "kernels.experts=te is not offered: TransformerEngine's GroupedLinear measured 28 TFLOP/s against 582 "
            "for grouped_mm on an H200 (it loops over experts); use kernels.experts=grouped_mm"
        )
    if cfg.comm.name != "all_to_all" and ep == 1:
        raise ConfigError(f"comm={cfg.comm.name} needs expert parallelism; set parallel.ep>1 or comm=all_to_all")
    k = cfg.kernels
    default = KernelsConfig()
    amax = (k.fp8_amax_history_len, k.fp8_amax_compute_algo)
    if k.fp8 != "delayed" and amax != (default.fp8_amax_history_len, default.fp8_amax_compute_algo):
        raise ConfigError(
            f"kernels.fp8_amax_history_len ({amax[0]}) / kernels.fp8_amax_compute_algo ({amax[1]}) apply to "
            f"kernels.fp8=delayed only (got kernels.fp8={k.fp8}); set kernels.fp8=delayed or drop them"
        )
    if k.fp8_backward != "fp8" and k.fp8 in ("none", "delayed"):
        raise ConfigError(
            f"kernels.fp8_backward={k.fp8_backward} needs kernels.fp8=current, blockwise or mxfp8 (got "
            f"kernels.fp8={k.fp8}: TE's delayed scaling always runs the backward in FP8); change one of them"
        )
    if k.fp8_fprop_split_accumulator and k.fp8 != "current":
        raise ConfigError(
            f"kernels.fp8_fprop_split_accumulator=true applies to kernels.fp8=current only (got kernels.fp8={k.fp8}: "
            "blockwise always splits, delayed has no such setting); set kernels.fp8=current or drop it"
        )
    if k.fp8_format is not None and k.fp8 == "none":
        raise ConfigError(
            f"kernels.fp8_format={k.fp8_format} needs an FP8 recipe (got kernels.fp8=none); "
            "set kernels.fp8=current or drop kernels.fp8_format"
        )
    tokens = t.micro_batch_size * t.seq_len
    if k.fp8 == "blockwise" and tokens % 128:
        raise ConfigError(
            f"kernels.fp8=blockwise quantizes in blocks of 128 tokens: train.micro_batch_size x train.seq_len "
            f"({t.micro_batch_size} x {t.seq_len} = {tokens}) must be a multiple of 128; "
            f"try train.seq_len={-(-t.seq_len // 128) * 128}"
        )
    if cfg.kernels.name != "te" and cfg.kernels.fp8 != "none":
        raise ConfigError(f"kernels.fp8={cfg.kernels.fp8} needs kernels=te; add kernels=te or set kernels.fp8=none")


def _largest_divisor(n: int, upper: int) -> int:
    return max(d for d in range(1, upper + 1) if n % d == 0 and upper % d == 0)

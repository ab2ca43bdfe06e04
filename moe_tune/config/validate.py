"""``validate(cfg)``: cross-group checks, run before any process group exists; one ConfigError line each.

Whether the backends a config names are usable on this machine is ``moe_tune.env.require_backends``'s check,
run right after (it imports torch and probes packages; this module imports neither).
"""

from __future__ import annotations

import math
import os

from moe_tune.config.data_checks import check_data
from moe_tune.config.data_schema import BAD_RECORD_POLICIES, DATA_FORMATS, PACKING_STRATEGIES, TRAIN_ON
from moe_tune.config.model_dir import model_dir_problem
from moe_tune.config.schema import (
    AC_MODES,
    COMM_CONFIGS,
    EXPERT_KERNELS,
    FP8_BACKWARDS,
    FP8_FORMATS,
    FP8_MODES,
    KERNEL_SETS,
    LOGGERS,
    OVERLAP_BACKENDS,
    PEFT_METHODS,
    PRECISIONS,
    PROFILE_WAIT,
    PROFILE_WARMUP,
    SCHEDULES,
    Config,
    ConfigError,
    KernelsConfig,
    PeftConfig,
    profiled_steps,
)
from moe_tune.distributed.dims import BatchLayout, ParallelDims


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1")))


def _choice(value: str, allowed, key: str) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not one of {', '.join(allowed)}; pick one of those")


def validate(
    cfg: Config,
    world_size: int | None = None,
    num_experts: int | None = None,
    expert_dims: tuple[int, int] | None = None,
) -> ParallelDims:
    """Check ``cfg`` for ``world_size`` ranks (default: from the launcher's environment) and, once the model is
    known, its ``num_experts`` and routed experts' (dim, hidden). Returns the resolved parallel layout. Raises
    ConfigError with one line."""
    world_size = world_size_from_env() if world_size is None else world_size
    check_values(cfg)
    dims = ParallelDims.from_config(cfg.parallel, world_size)
    if num_experts is not None:
        dims.check_experts(num_experts)
    if expert_dims is not None:
        check_expert_dims(cfg.kernels.experts, *expert_dims)
    BatchLayout.from_config(cfg.train, dims.dp)  # the global batch: a whole number of micro-batches
    if cfg.comm.name != "all_to_all" and dims.ep == 1:
        raise ConfigError(f"comm={cfg.comm.name} needs expert parallelism; set parallel.ep>1 or comm=all_to_all")
    if cfg.comm.overlap and dims.ep == 1:
        raise ConfigError(
            "comm.overlap=true hides expert-parallel communication and parallel.ep=1 has none; "
            "set parallel.ep>1 or comm.overlap=false"
        )
    return dims


def check_expert_dims(experts: str, dim: int, hidden: int) -> None:
    """kernels.experts=grouped_mm_fp8: FP8 rows of every GEMM operand must start on 16-byte boundaries, so the
    model dim and the expert hidden dim must be multiples of 16."""
    if experts == "grouped_mm_fp8" and (dim % 16 or hidden % 16):
        raise ConfigError(
            f"kernels.experts=grouped_mm_fp8 needs the model dim ({dim}) and the expert hidden dim ({hidden}) to be "
            "multiples of 16 (the FP8 grouped GEMM's alignment); use kernels.experts=grouped_mm for this model"
        )


def check_values(cfg: Config) -> None:
    """Every check that needs neither the world size nor the model: choices, ranges, combinations within a
    group. The CLI runs it before Hydra creates the run directory, so a bad value leaves nothing behind."""
    _check_choices(cfg)
    if cfg.data.path is None and cfg.data.name == "jsonl":
        raise ConfigError(
            "data=jsonl reads your records from data.path, which is not set; add data.path=<file|dir|hub name>"
        )
    if cfg.data.path is None and cfg.data.name not in ("arithmetic", "random"):  # before num_samples' range
        raise ConfigError(
            f"data={cfg.data.name!r} is not built in (arithmetic, random); pick one or set data.path=<jsonl|parquet|dir>"
        )
    if cfg.data.path is not None and cfg.data.name in ("arithmetic", "random"):  # read under a built-in set's name
        raise ConfigError(
            f"data={cfg.data.name} generates its records and reads no data.path ({cfg.data.path}); for your records "
            f"write data=jsonl data.path={cfg.data.path} (or data.path alone)"
        )
    _check_ranges(cfg)
    _check_train(cfg)
    _check_kernels(cfg)
    check_data(cfg)
    _check_peft(cfg)
    resume = cfg.checkpoint.resume
    if resume not in ("auto", "none") and not os.path.isdir(resume):
        raise ConfigError(
            f"checkpoint.resume={resume} does not exist; give a checkpoint directory (<output_dir>/checkpoints/"
            "step_<N>), auto (the newest in output_dir) or none"
        )
    problem = None if cfg.model.path is None else model_dir_problem(cfg.model.path)
    if problem:
        raise ConfigError(problem)


def _check_choices(cfg: Config) -> None:
    _choice(cfg.train.precision, PRECISIONS, "train.precision")
    _choice(cfg.comm.name, COMM_CONFIGS, "comm")
    _choice(cfg.kernels.name, KERNEL_SETS, "kernels")
    if cfg.kernels.experts == "te":
        raise ConfigError(
            "kernels.experts=te is not offered: TransformerEngine's GroupedLinear measured 28 TFLOP/s against 582 "
            "for grouped_mm on an H200 (it loops over experts); use kernels.experts=grouped_mm"
        )
    _choice(cfg.kernels.experts, EXPERT_KERNELS, "kernels.experts")
    _choice(cfg.kernels.fp8, FP8_MODES, "kernels.fp8")
    _choice(cfg.kernels.fp8_amax_compute_algo, ("max", "most_recent"), "kernels.fp8_amax_compute_algo")
    _choice(cfg.kernels.fp8_backward, FP8_BACKWARDS, "kernels.fp8_backward")
    if cfg.kernels.fp8_format is not None:
        _choice(cfg.kernels.fp8_format, FP8_FORMATS, "kernels.fp8_format")
    _choice(cfg.parallel.activation_checkpointing, AC_MODES, "parallel.activation_checkpointing")
    _choice(cfg.model.dtype, ("source", "float32", "bfloat16"), "model.dtype")
    _choice(cfg.optim.name, ("adamw",), "optim")
    _choice(cfg.optim.schedule, SCHEDULES, "optim.schedule")
    _choice(cfg.data.format, DATA_FORMATS, "data.format")
    _choice(cfg.data.train_on, TRAIN_ON, "data.train_on")
    _choice(cfg.data.on_bad_record, BAD_RECORD_POLICIES, "data.on_bad_record")
    _choice(cfg.data.packing_strategy, PACKING_STRATEGIES, "data.packing_strategy")
    _choice(cfg.logger.name, LOGGERS, "logger")
    _choice(cfg.logger.mode, ("offline", "online"), "logger.mode")
    _choice(cfg.peft.name, PEFT_METHODS, "peft")


def _ranges(cfg: Config) -> list[tuple[str, object, bool, str, str]]:
    """(key, value, in range?, the range, a value to try) per numeric field without a check of its own below."""
    t, k, d, lg = cfg.train, cfg.kernels, cfg.data, cfg.logger
    max_tokens = getattr(cfg.comm, "max_tokens", None)
    return [
        ("train.lr", t.lr, math.isfinite(t.lr) and t.lr > 0, "> 0", "3e-4"),
        (
            "train.global_batch_size",
            t.global_batch_size,
            t.global_batch_size == -1 or t.global_batch_size >= 1,
            ">= 1 or -1 (micro_batch_size x data-parallel ranks)",
            "-1",
        ),
        ("train.seed", t.seed, 0 <= t.seed < 2**63, ">= 0 and < 2**63 (torch's seed is a 64-bit integer)", "0"),
        ("train.aux_loss_coef", t.aux_loss_coef, t.aux_loss_coef >= 0, ">= 0", "0.001"),
        ("train.z_loss_coef", t.z_loss_coef, t.z_loss_coef >= 0, ">= 0", "0"),
        ("train.bias_update_rate", t.bias_update_rate, t.bias_update_rate >= 0, ">= 0", "0"),
        ("train.warmup_steps_excluded", t.warmup_steps_excluded, t.warmup_steps_excluded >= 0, ">= 0", "3"),
        *_optim_ranges(cfg),
        (
            "checkpoint.every",
            cfg.checkpoint.every,
            cfg.checkpoint.every >= 0,
            ">= 0 (steps between checkpoints; 0: none)",
            "100",
        ),
        (
            "checkpoint.keep_last",
            cfg.checkpoint.keep_last,
            cfg.checkpoint.keep_last >= 0,
            ">= 0 (complete checkpoints kept; 0: every one)",
            "3",
        ),
        ("kernels.loss_chunk_size", k.loss_chunk_size, k.loss_chunk_size >= 1, ">= 1 (tokens per loss chunk)", "4096"),
        (
            "data.num_samples",
            d.num_samples,
            d.path is not None or d.num_samples >= 1,
            ">= 1 (built-in records)",
            "4096",
        ),
        (
            "logger.expert_load_image_every",
            lg.expert_load_image_every,
            lg.expert_load_image_every >= 0,
            ">= 0 (0: never)",
            "0",
        ),
        ("comm.max_tokens", max_tokens, max_tokens is None or max_tokens >= 1, ">= 1 or null", "null"),
        *_peft_ranges(cfg),
    ]


def _optim_ranges(cfg: Config) -> list[tuple[str, object, bool, str, str]]:
    o = cfg.optim
    return [
        (
            "optim.min_lr_ratio",
            o.min_lr_ratio,
            0 <= o.min_lr_ratio <= 1,
            "in [0, 1] (the final learning rate over train.lr)",
            "0.1",
        ),
        ("optim.warmup_steps", o.warmup_steps, o.warmup_steps >= 0, ">= 0 (steps of linear warmup)", "10"),
        ("optim.eps", o.eps, math.isfinite(o.eps) and o.eps > 0, "> 0", "1e-8"),
        ("optim.weight_decay", o.weight_decay, o.weight_decay >= 0, ">= 0", "0.0"),
        (
            "optim.max_grad_norm",
            o.max_grad_norm,
            math.isfinite(o.max_grad_norm) and o.max_grad_norm >= 0,
            ">= 0 (the gradient clipping norm; 0: no clipping)",
            "1.0",
        ),
        (
            "optim.betas",
            list(o.betas),
            len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas),
            "two values in [0, 1)",
            "[0.9,0.95]",
        ),
    ]


def _peft_ranges(cfg: Config) -> list[tuple[str, object, bool, str, str]]:
    p = cfg.peft
    return [
        ("peft.rank", p.rank, p.rank >= 1, ">= 1", "16"),
        ("peft.alpha", p.alpha, math.isfinite(p.alpha) and p.alpha > 0, "> 0", "32"),
        ("peft.dropout", p.dropout, 0 <= p.dropout < 1, "in [0, 1)", "0.0"),
    ]


def _check_ranges(cfg: Config) -> None:
    for key, value, ok, allowed, example in _ranges(cfg):
        if not ok:
            shown = str(value).replace(" ", "")
            raise ConfigError(f"{key}={shown} is out of range: it must be {allowed}; try {key}={example}")


def _override(value) -> str:
    """A value as a command-line override spells it (a list as [a,b])."""
    return f"[{','.join(map(str, value))}]" if isinstance(value, (list, tuple)) else str(value)


def lora_keys_without_lora(given: list[str]) -> None:
    """``given`` (peft.* overrides) would be silently ignored under peft=none: a forgotten peft=lora."""
    raise ConfigError(
        f"{', '.join(given)} configures LoRA, but peft=none trains every weight; add peft=lora (or drop "
        f"{'them' if len(given) > 1 else 'it'})"
    )


def _check_peft(cfg: Config) -> None:
    p = cfg.peft
    if p.name == "none":  # the adapter keys would be silently ignored: a forgotten peft=lora
        default = PeftConfig()
        keys = ("rank", "alpha", "dropout", "target", "train_router")
        given = [f"peft.{k}={_override(getattr(p, k))}" for k in keys if getattr(p, k) != getattr(default, k)]
        if given:
            lora_keys_without_lora(given)
        return
    if p.name != "lora":
        return
    if not p.target:
        raise ConfigError("peft.target is empty: name what LoRA adapts, e.g. peft.target=[attention,experts]")
    if "experts" in p.target and cfg.kernels.experts in ("grouped_mm", "grouped_mm_fp8") and p.rank % 8:
        raise ConfigError(
            f"peft.rank={p.rank} with peft.target including experts: the grouped GEMMs need the rank to be a "
            "multiple of 8 (16-byte rows in bf16); try peft.rank=8 or peft.rank=16"
        )


def _check_train(cfg: Config) -> None:
    t = cfg.train
    if t.steps < 1 or t.seq_len < 2 or t.micro_batch_size < 1:
        raise ConfigError(
            f"train.steps ({t.steps}), train.seq_len ({t.seq_len}) and train.micro_batch_size "
            f"({t.micro_batch_size}) must be positive (seq_len >= 2)"
        )
    traced = profiled_steps()
    if t.profile and t.steps < traced[-1]:
        raise ConfigError(
            f"train.profile=true traces steps {traced[0]}-{traced[-1]} (after {PROFILE_WAIT} untraced steps and "
            f"{PROFILE_WARMUP} that warms the profiler up), so it needs train.steps >= {traced[-1]} (got "
            f"{t.steps}); set train.steps={traced[-1]}"
        )
    if t.log_every < 1:
        raise ConfigError(
            f"train.log_every ({t.log_every}) must be >= 1 (steps between logged rows, which are the only steps "
            "that wait for the GPU); try train.log_every=10"
        )
    if t.max_nonfinite_steps < 0:
        raise ConfigError(
            f"train.max_nonfinite_steps ({t.max_nonfinite_steps}) must be >= 0 (0 stops at the first step "
            "with a non-finite gradient norm); try train.max_nonfinite_steps=5"
        )
    if cfg.optim.stochastic_rounding is True and t.precision != "bf16":
        raise ConfigError(
            f"optim.stochastic_rounding=true rounds bf16 parameters (got train.precision={t.precision}, "
            "whose master weights are not bf16); set train.precision=bf16 or drop optim.stochastic_rounding"
        )
    comm = cfg.comm
    if comm.overlap and comm.name not in OVERLAP_BACKENDS:
        raise ConfigError(
            f"comm.overlap=true is implemented for comm={' or comm='.join(OVERLAP_BACKENDS)} only, not "
            f"comm={comm.name}; set comm.overlap=false or comm=all_to_all"
        )
    if comm.name == "deepep" and (comm.num_sms <= 0 or comm.num_sms % 2):
        raise ConfigError(
            f"comm.num_sms ({comm.num_sms}) must be a positive even number (DeepEP pairs SMs per channel); try 24"
        )
    if comm.name == "symm_mem" and comm.capacity_factor <= 0:
        raise ConfigError(
            f"comm.capacity_factor ({comm.capacity_factor}) must be > 0; comm.capacity_factor >= parallel.ep "
            "never overflows"
        )


def _check_kernels(cfg: Config) -> None:
    k, t = cfg.kernels, cfg.train
    if k.fp8_amax_history_len < 1:
        raise ConfigError(
            f"kernels.fp8_amax_history_len ({k.fp8_amax_history_len}) must be at least 1 (steps of amax "
            "history for kernels.fp8=delayed); try kernels.fp8_amax_history_len=1024"
        )
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
    if k.experts == "grouped_mm_fp8" and k.compile:
        raise ConfigError(
            "kernels.experts=grouped_mm_fp8 with kernels.compile=true is refused: compiled, its input and weight "
            "gradients came out wrong on an H200 (relative error 1.0 against eager, benchmarks/README.md); "
            "set kernels.compile=false or kernels.experts=grouped_mm"
        )
    if k.name != "te" and k.fp8 != "none":
        raise ConfigError(f"kernels.fp8={k.fp8} needs kernels=te; add kernels=te or set kernels.fp8=none")
    if k.name == "te" and k.compile:
        # TE's modules (their autograd Functions and FP8 state) fail inside dynamo with torch 2.11 + TE 2.20
        # (InternalTorchDynamoError: NotImplementedError); compiled around them, every layer would be split at
        # each TE module anyway.
        raise ConfigError(
            "kernels=te with kernels.compile=true is not supported (TransformerEngine's modules do not trace "
            "under torch.compile); pick one: kernels=torch kernels.compile=true, or kernels=te kernels.compile=false"
        )

"""Configuration schema: dataclasses registered in Hydra's ConfigStore.

The schema is the single source of truth for every key; ``moe_tune/conf/<group>/<option>.yaml`` only fills values.
Unknown keys fail at compose time because every group is a structured config. Each ``comm`` backend has a
typed options class of its own (``moe_tune/conf/comm/<name>.yaml`` carries only its keys), as torchtitan gives each
dispatcher its own config. This module imports no torch and nothing else of moe_tune.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, fields, replace
from typing import Any

from moe_tune.config.constraints import field
from moe_tune.config.data_schema import DataConfig

PRECISIONS = ("fp32", "amp_bf16", "bf16_fp32_master", "bf16")
KERNEL_SETS = ("torch", "te")
EXPERT_KERNELS = ("grouped_mm", "grouped_mm_fp8", "loop")
QUANTIZED_BASES = ("none", "fp8", "nf4")
QUANTIZED_GEMMS = ("torch", "triton")
FP8_MODES = ("none", "current", "delayed", "blockwise", "mxfp8")
FP8_BACKWARDS = ("fp8", "high_precision", "dequantized")
FP8_FORMATS = ("hybrid", "e4m3")
AC_MODES = ("none", "full", "selective")
SCHEDULES = ("cosine", "constant")
COMM_NAMES = ("all_to_all", "deepep", "symm_mem")  # COMM_CONFIGS' keys


class UserError(ValueError):
    """Something the user must fix: reported as one line naming the values and the fix, exit code 2."""


class ConfigError(UserError):
    """A configuration value (or combination) that cannot run."""


class DataError(UserError):
    """A data file or record that cannot be read as training data."""


class CheckpointError(UserError):
    """A model or training checkpoint directory that is missing, incomplete or does not match the model."""


@dataclass
class ModelConfig:
    # A name from moe_tune/conf/model (tiny models are built locally) or a local Hugging Face directory in `path`.
    name: str = "tiny_qwen3_moe"
    path: str | None = None
    # "source" keeps each tensor's dtype from the source checkpoint (training dtypes are train.precision's).
    dtype: str = field("source", choices=("source", "float32", "bfloat16"), help="the exported hf/ weights' dtype")
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
    activation_checkpointing: str = field(
        "none", choices=AC_MODES, help="recomputed in backward: nothing, each layer, or each layer's attention"
    )
    # Reshard parameters after forward (ZeRO-3); False keeps them gathered until backward (ZeRO-2-like).
    reshard_after_forward: bool = True


@dataclass
class CommConfig:
    """Token dispatch between expert-parallel ranks; ``name`` picks the backend and its options class."""

    name: str = field("all_to_all", choices=COMM_NAMES)
    # Split each MoE layer's tokens in two halves and pipeline them, so that one half's all-to-all runs on a side
    # CUDA stream while the other half's experts (or the shared expert) compute. Backends in OVERLAP_BACKENDS only.
    overlap: bool = False


# The comm backends that implement comm.overlap (validate refuses it for the others).
OVERLAP_BACKENDS = ("all_to_all",)


@dataclass
class AllToAllConfig(CommConfig):
    """NCCL/gloo ``all_to_all_single`` (split sizes cross the host once per layer)."""

    name: str = field("all_to_all", choices=COMM_NAMES)
    # Send each token once to every ep rank holding any of its experts (weighted and summed there), instead of
    # once per routed expert: with top-8 of 128 experts on 2 ranks, about 4x fewer rows on the wire. Off by
    # default until measured on GPUs (tested on CPU only; benchmarks/README.md, issue 14).
    dedup: bool = False


@dataclass
class DeepEPConfig(CommConfig):
    name: str = field("deepep", choices=COMM_NAMES)
    # Streaming multiprocessors given to DeepEP's communication kernels.
    num_sms: int = field(24, ge=2, multiple_of=2, help="DeepEP pairs SMs per channel")


@dataclass
class SymmMemConfig(CommConfig):
    name: str = field("symm_mem", choices=COMM_NAMES)
    # Worst-case rows one rank receives, per token, in units of top_k.
    capacity_factor: float = field(2.0, gt=0, help=">= parallel.ep never overflows")
    # Tokens per rank the symmetric buffers are sized for; None: the largest batch of any rank at the first step.
    max_tokens: int | None = field(None, ge=1)
    # Check capacity overflow after every batch (one host sync per layer) instead of once per logged step.
    debug: bool = False


COMM_CONFIGS: dict[str, type[CommConfig]] = dict(zip(COMM_NAMES, (AllToAllConfig, DeepEPConfig, SymmMemConfig)))


@dataclass
class KernelsConfig:
    name: str = field("torch", choices=KERNEL_SETS)
    # Routed experts: "grouped_mm" (bf16 grouped GEMMs), "grouped_mm_fp8" (the same GEMMs in FP8 E4M3 with row-wise
    # scales, forward and backward, through torch._scaled_grouped_mm: needs an sm90+ GPU and expert dims that are
    # multiples of 16; not with compile=true, whose gradients came out wrong; LoRA deltas and biases stay bf16;
    # slower than bf16 so far, its eager quantization dominating: an option, not the default; benchmarks/README.md,
    # "Precision and kernel sets"), "loop" (one matmul per expert: the reference).
    experts: str = field("grouped_mm", choices=EXPERT_KERNELS, help="the routed experts' GEMMs")
    fp8: str = field("none", choices=FP8_MODES, help="TransformerEngine's FP8 recipe, with kernels=te")
    # fp8=delayed only: the scale comes from the amax over this many past steps ("max") or the last ("most_recent").
    fp8_amax_history_len: int = field(1024, ge=1, help="steps of amax history for kernels.fp8=delayed")
    fp8_amax_compute_algo: str = field("max", choices=("max", "most_recent"))
    # fp8=current only: accumulate the forward GEMM in fp32 in chunks (TE's default for current is Hopper's fast,
    # ~14-bit accumulation there; blockwise always splits, delayed offers no choice).
    fp8_fprop_split_accumulator: bool = False
    # Backward GEMMs: "fp8" (quantized, TE's default), or FP8 in the forward only: "high_precision" keeps the bf16
    # operands for the backward, "dequantized" the FP8 ones dequantized (less memory). Not with fp8=delayed.
    # current + high_precision is the recommended FP8 setting: the only one whose loss stayed within the precision
    # protocol's bound of bf16 in every measured run (benchmarks/README.md, "Precision and kernel sets").
    fp8_backward: str = field("fp8", choices=FP8_BACKWARDS)
    # None: the recipe's own format (current and delayed: "hybrid", E4M3 forward and E5M2 gradients; blockwise
    # and mxfp8: E4M3). "e4m3": E4M3 throughout (measured: no smaller loss difference than hybrid on an H200).
    fp8_format: str | None = field(None, choices=FP8_FORMATS)
    compile: bool = False
    # torch.compile's ``dynamic`` for each layer. None (automatic): a graph first compiled for the shapes it met,
    # recompiled once with symbolic sizes where they change (the expert-parallel rows per step, packed sequence
    # lengths). False: one graph per shape, and past torch's recompile limit (8) that part runs eagerly.
    compile_dynamic: bool | None = None
    # Chunked linear cross-entropy that never materialises the full logits; on a GPU each chunk's softmax and
    # gradient are one Triton kernel in place over its bf16 logits (moe_tune/kernels/triton_loss.py).
    fused_loss: bool = True
    loss_chunk_size: int = field(4096, ge=1, help="tokens per loss chunk")
    # The quantized base's expert GEMMs (peft.quantize_base). "torch": FP8 through torch._scaled_grouped_mm both ways
    # (the input gradient reads a transposed copy of the experts made per call), NF4 a projection's experts
    # dequantized for bf16 grouped GEMMs (all at once where they fit 1 GiB: no host sync). "triton": the FP8 input
    # gradient and both NF4 directions through one Triton grouped GEMM that dequantizes weight tiles in registers (no
    # copy, no sync; CUDA only); measured slower than "torch" on an H100 (docs/lora.md). Changes nothing without a
    # quantized base.
    quantized_base: str = field("torch", choices=QUANTIZED_GEMMS, help="the quantized base's GEMMs")

    def fp8_options(self) -> dict:
        """The keyword arguments of ``moe_tune.kernels.te.fp8_recipe`` that this config sets."""
        return {
            "amax_history_len": self.fp8_amax_history_len,
            "amax_compute_algo": self.fp8_amax_compute_algo,
            "fprop_split_accumulator": self.fp8_fprop_split_accumulator,
            "backward": self.fp8_backward,
            "fp8_format": self.fp8_format,
        }


LOGGERS = ("none", "tensorboard", "wandb", "mlflow")


@dataclass
class LoggerConfig:
    """Experiment tracking beside metrics.jsonl: the same fields, plus expert load per layer."""

    name: str = field("none", choices=LOGGERS)
    # None: <output_dir>/<name> (tensorboard event files, wandb's offline run, mlflow's file store).
    log_dir: str | None = None
    project: str = "moe_tune"
    run_name: str | None = None
    # wandb: "offline" writes locally (wandb sync uploads it later); "online" needs network and a login.
    mode: str = field("offline", choices=("offline", "online"))
    # Every this many steps, an image of expert load per layer.
    expert_load_image_every: int = field(0, ge=0, help="0: never")


@dataclass
class OptimConfig:
    name: str = field("adamw", choices=("adamw",))
    weight_decay: float = field(0.0, ge=0)
    # false: weight decay leaves norms, biases (routers' and GPT-OSS's experts' included) and every other 1-D
    # parameter (GPT-OSS's attention sinks) alone, as Megatron does (Transformers' Trainer: norms and biases);
    # true: every trained parameter is decayed. (DeepSeek-V3's router correction bias is a buffer: never decayed.)
    decay_norms_and_biases: bool = False
    betas: tuple[float, float] = field((0.9, 0.95), ge=0, lt=1)
    eps: float = field(1e-8, gt=0, example="1e-8")
    warmup_steps: int = field(10, ge=0, help="steps of linear warmup")
    schedule: str = field("cosine", choices=SCHEDULES)
    min_lr_ratio: float = field(0.1, ge=0, le=1, help="the final learning rate over train.lr")
    # Gradients are scaled so their global norm is at most this (inside the optimizer's kernel).
    max_grad_norm: float = field(1.0, ge=0, help="the gradient clipping norm; 0: no clipping")
    # AdamW in fp32, rounded stochastically back to the bf16 parameters and moments (moe_tune/optim/stochastic.py),
    # so updates below bf16's resolution are not lost. None (automatic): on exactly when the parameters are bf16
    # (train.precision=bf16; ``rounds_stochastically``); true needs train.precision=bf16; false rounds to nearest.
    stochastic_rounding: bool | None = None
    # The update as Triton kernels on a GPU (moe_tune/kernels/adamw.py): AdamW as one kernel per large parameter
    # (torch's fused kernel for the rest; same maths and state as torch's fused AdamW, moe_tune/optim/adamw.py);
    # stochastic rounding as one kernel per parameter drawing its random bits inside: one pass over each parameter's
    # storage instead of several (benchmarks/README.md, "Stochastic rounding's update").
    # false: torch's fused AdamW (and stochastic rounding eagerly, with torch.randint's bits).
    compiled: bool = True


# train.profile's schedule from the run's first step: untraced, warming the profiler up, then traced.
PROFILE_WAIT, PROFILE_WARMUP, PROFILE_ACTIVE = 5, 1, 3
PROFILE_STEPS = PROFILE_WAIT + PROFILE_WARMUP + PROFILE_ACTIVE  # the run needs at least this many


def profiled_steps(start_step: int = 0) -> range:
    """The steps train.profile traces in a run that starts after ``start_step`` (0, or a resumed checkpoint's),
    numbered as the log, metrics.jsonl and the trace's ProfilerStep#N number them (the first step is 1)."""
    first = start_step + PROFILE_WAIT + PROFILE_WARMUP + 1
    return range(first, first + PROFILE_ACTIVE)


@dataclass
class TrainConfig:
    steps: int = field(60, ge=1, help="optimizer steps")
    seq_len: int = field(256, ge=2, help="tokens per row")
    micro_batch_size: int = field(4, ge=1, help="rows per rank and forward pass")
    # -1: micro_batch_size x data-parallel size (no gradient accumulation).
    global_batch_size: int = field(-1, ge=1, also=-1, help="micro_batch_size x data-parallel ranks")
    seed: int = field(0, ge=0, lt=2**63, help="torch's seed is a 64-bit integer")
    lr: float = field(3e-3, gt=0, help="the peak learning rate", example="3e-4")
    precision: str = field("bf16_fp32_master", choices=PRECISIONS)
    # Load-balancing: auxiliary loss coefficient, router z-loss and aux-loss-free bias update rate.
    aux_loss_coef: float = field(0.001, ge=0)
    z_loss_coef: float = field(0.0, ge=0)
    bias_update_rate: float = field(0.0, ge=0)
    # Forced balanced routing for benchmarks (token i goes to experts i*k..i*k+k-1 mod E).
    force_balanced_routing: bool = False
    # The host waits for the GPU (writes the metrics rows of the steps since, prints progress, checks for NaN and
    # signals) every this many steps and at the last; every step still gets its row. 1 costs a sync per step, which
    # shows at small micro-batches (benchmarks/README.md, index row "Logging cadence").
    log_every: int = field(10, ge=1, help="steps between logged rows, which are the only steps that wait for the GPU")
    # Held-out loss and perplexity every this many steps and at the end, when data has a validation set
    # (data.val_path or data.val_fraction).
    eval_every: int = field(0, ge=0, help="0: at the end only")
    # torch.profiler on rank 0 over steps 7-9 (profiled_steps: as the log numbers them, from the run's start): a step
    # summary and top ops in profile_rank0.{txt,json}, the trace in trace_rank0.json (moe_tune/train/profile.py).
    profile: bool = False
    warmup_steps_excluded: int = field(3, ge=0, help="first steps left out of the summary's medians")
    # A step whose global gradient norm is NaN/inf is skipped on the device (weights and optimizer state untouched);
    # after more than this many such steps in a row the run stops with exit code 1 (diverged, or broken data).
    max_nonfinite_steps: int = field(5, ge=0, help="0 stops at the first step with a non-finite gradient norm")


PEFT_METHODS = ("none", "lora")


@dataclass
class PeftConfig:
    """Parameter-efficient fine-tuning: ``none`` trains every weight; ``lora`` trains low-rank adapters only, the
    base frozen (stored in bf16 unless train.precision=fp32, with no gradients and no optimizer state)."""

    name: str = field("none", choices=PEFT_METHODS)
    rank: int = field(16, ge=1, help="the adapters' rank")
    alpha: float = field(32.0, gt=0, help="the adapters' scale is alpha / rank")
    dropout: float = field(0.0, ge=0, lt=1, help="on the adapters' input")
    # Words: attention (every linear of the attention), mlp (dense MLPs and shared experts), experts (the routed
    # experts, as grouped adapters); or the end of a linear's dotted name (q_proj, shared_experts.down_proj).
    target: list[str] = field(default_factory=lambda: ["attention", "experts"])
    # Train the routers' weights fully (frozen otherwise, and then the balancing losses are off: they would only
    # steer the adapters of earlier layers).
    train_router: bool = False
    # The frozen routed experts (95% of Qwen3-30B-A3B's weights) held quantized instead of in bf16: "fp8" (E4M3, one
    # power-of-two scale per expert and output row; Hopper FP8 GEMMs, emulated on the CPU) or "nf4" (4-bit
    # NormalFloat, a bf16 scale per 64 inputs; dequantized for bf16 GEMMs). Quantized as
    # the checkpoint is read; adapters train as usual and export against the original bf16 base.
    quantize_base: str = field("none", choices=QUANTIZED_BASES, help="the frozen experts' storage under LoRA")


@dataclass
class CheckpointConfig:
    every: int = field(0, ge=0, help="steps between checkpoints; 0: none", example="100")
    # After each save the oldest complete checkpoints beyond this many are deleted.
    keep_last: int = field(0, ge=0, help="complete checkpoints kept; 0: every one", example="3")
    resume: str = "auto"
    export_hf: bool = True
    # SIGTERM/SIGUSR1 (Slurm's time limit or preemption, torchrun's shutdown), SIGINT (Ctrl-C), SIGHUP and SIGQUIT
    # (passed on by torchrun too): every rank stops after the same step, a checkpoint of that step is saved, and
    # the process exits 128 + the signal number (a second Ctrl-C stops at once, without saving).
    save_on_signal: bool = True
    # Write checkpoints in the background: training stops only to copy the state into host memory (one copy of
    # this rank's share of the state, allocated ahead of the first save and kept for the run), then trains on while
    # a writer thread writes the files, the manifest and COMPLETE. The next save, the run's end and a signal stop
    # wait for the write. Where the node's copies would not fit in 80% of its available memory every save is
    # synchronous, with a warning. False: synchronous.
    async_save: bool = True


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    # Typed as the base class so that composing comm=<name> swaps in that backend's options class.
    comm: CommConfig = field(default_factory=CommConfig)
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)
    output_dir: str = "outputs/run"


GROUPS = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "kernels": KernelsConfig,
    "data": DataConfig,
    "optim": OptimConfig,
    "train": TrainConfig,
    "logger": LoggerConfig,
    "peft": PeftConfig,
}


def rounds_stochastically(precision: str, stochastic_rounding: bool | None) -> bool:
    """Whether a run with these ``train.precision`` and ``optim.stochastic_rounding`` values rounds its AdamW
    update stochastically: automatic (None) means exactly for bf16 parameters, whose round-to-nearest update loses
    every change below half a bf16 step, so at fine-tuning learning rates the loss stalls where stochastic rounding
    follows fp32 master weights at bf16's speed (benchmarks/README.md, "Stochastic rounding's update" and
    "Precision and kernel sets")."""
    return precision == "bf16" if stochastic_rounding is None else stochastic_rounding


def resolved(cfg: Config) -> Config:
    """``cfg`` with its automatic values decided, as the run applies them and as config.json, summary.json and
    checkpoints record them (``optim.stochastic_rounding``)."""
    stochastic = rounds_stochastically(cfg.train.precision, cfg.optim.stochastic_rounding)
    return replace(cfg, optim=replace(cfg.optim, stochastic_rounding=stochastic))


def ranks_per_node(dp_replicate: int, dp_shard: int, ep: int, nodes: int) -> int:
    """Ranks each of ``nodes`` nodes starts for a layout: dp_replicate x dp_shard in all, or with dp_shard=-1 (every
    rank not used by dp_replicate) the fewest that fit, dp_replicate x ep. The launcher presets' task count."""
    world = dp_replicate * (dp_shard if dp_shard > 0 else ep)
    if nodes < 1 or world % nodes:
        raise ConfigError(
            f"the layout's {world} ranks (parallel.dp_replicate x parallel.dp_shard, or x parallel.ep when "
            f"dp_shard=-1) do not split over hydra.launcher.nodes={nodes}; set parallel.dp_shard to a multiple of it"
        )
    return world // nodes


def register_configs() -> None:
    """Store the schema as ``base_config`` and ``base_<group>`` so YAML files are type-checked against it, and the
    ``moe_tune.ranks_per_node`` resolver the launcher presets use."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    # conf/hydra/launcher/submitit_slurm.yaml takes the place of the submitit plugin's preset on purpose (it keeps
    # its keys, so Hydra checks it against the plugin's schema): nothing for the user to migrate.
    warnings.filterwarnings("ignore", message="(?s).*is validated against ConfigStore schema with the same name")
    if not OmegaConf.has_resolver("moe_tune.ranks_per_node"):
        OmegaConf.register_new_resolver("moe_tune.ranks_per_node", ranks_per_node)
    cs = ConfigStore.instance()
    if cs.repo.get("base_config.yaml") is not None:
        return  # stored by an earlier call in this process (each store rebuilds the schema: a tenth of a second)
    cs.store(name="base_config", node=Config)
    for group, schema in GROUPS.items():
        cs.store(group=group, name=f"base_{group}", node=schema)
    for name, schema in COMM_CONFIGS.items():
        cs.store(group="comm", name=f"base_{name}", node=schema)


def comm_config(values: dict) -> CommConfig:
    """The typed options of ``values["name"]`` from a plain dict (a checkpoint's saved config). Keys another
    backend's class holds are dropped: checkpoints written before each backend had its own class saved them all."""
    cls = COMM_CONFIGS.get(values.get("name", "all_to_all"))
    if cls is None:
        raise ConfigError(f"comm={values.get('name')!r} is not one of {', '.join(COMM_CONFIGS)}")
    known = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in values.items() if k in known})

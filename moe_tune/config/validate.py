"""``validate(cfg)``: each key against its field's choices or range (one generic check of the schema's metadata,
``moe_tune.config.constraints``), then the rules between keys, before any process group exists; one ConfigError
line each.

Whether the backends a config names are usable on this machine is ``moe_tune.env.require_backends``'s check,
run right after (it imports torch and probes packages; this module imports neither).
"""

from __future__ import annotations

import os

# The module, not its names: moe_tune.distributed.dims imports this package, and may be the first one imported.
import moe_tune.distributed.dims as layout
from moe_tune.config.constraints import constrained_values, out_of_range, sibling_hint, spelled
from moe_tune.config.model_dir import model_dir_problem
from moe_tune.config.schema import (
    OVERLAP_BACKENDS,
    PROFILE_WAIT,
    PROFILE_WARMUP,
    Config,
    ConfigError,
    KernelsConfig,
    PeftConfig,
    profiled_steps,
)


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1")))


def validate(
    cfg: Config,
    world_size: int | None = None,
    num_experts: int | None = None,
    expert_dims: tuple[int, int] | None = None,
) -> layout.ParallelDims:
    """Check ``cfg`` for ``world_size`` ranks (default: from the launcher's environment) and, once the model is
    known, its ``num_experts`` and routed experts' (dim, hidden). Returns the resolved parallel layout. Raises
    ConfigError with one line."""
    world_size = world_size_from_env() if world_size is None else world_size
    check_values(cfg)
    dims = layout.ParallelDims.from_config(cfg.parallel, world_size)
    if num_experts is not None:
        dims.check_experts(num_experts)
    if expert_dims is not None:
        check_expert_dims(cfg, *expert_dims)
    layout.BatchLayout.from_config(cfg.train, dims.dp)  # the global batch: a whole number of micro-batches
    if cfg.comm.name != "all_to_all" and dims.ep == 1:
        raise ConfigError(f"comm={cfg.comm.name} needs expert parallelism; set parallel.ep>1 or comm=all_to_all")
    if cfg.comm.overlap and dims.ep == 1:
        raise ConfigError(
            "comm.overlap=true hides expert-parallel communication and parallel.ep=1 has none; "
            "set parallel.ep>1 or comm.overlap=false"
        )
    return dims


# FP8 rows start on 16-byte boundaries (the FP8 grouped GEMM's alignment).
FP8_ALIGN = 16
# The experts' dims where their weights are stored in blocks, per storage: the multiple both dims must be, and why.
BLOCKED_DIMS = {"fp8": (FP8_ALIGN, "the FP8 grouped GEMM's alignment"), "nf4": (32, "NF4's blocks of inputs")}


def blocked_dims_problem(key: str, storage: str, dim: int, hidden: int, fix: str) -> str | None:
    """The line refusing ``key`` (a setting that stores the experts as ``storage``, a BLOCKED_DIMS key) for a model
    dim and an expert hidden dim the storage cannot hold; None where it can."""
    multiple, why = BLOCKED_DIMS[storage]
    if not (dim % multiple or hidden % multiple):
        return None
    return (
        f"{key} needs the model dim ({dim}) and the expert hidden dim ({hidden}) to be multiples of {multiple} "
        f"({why}); use {fix} for this model"
    )


# torch's grouped GEMM (kernels.experts=grouped_mm) takes rows that start on 16-byte boundaries.
GROUPED_MM_ALIGN_BYTES = 16


def grouped_mm_dims_problem(key: str, dim: int, hidden: int, dtype: str, itemsize: int, fix: str) -> str | None:
    """The line refusing grouped GEMMs (``key``) in ``dtype`` (``itemsize`` bytes a value) for a model dim or an
    expert hidden dim whose rows do not start on 16-byte boundaries (torch raises mid-run there); None where they
    do."""
    multiple = max(1, GROUPED_MM_ALIGN_BYTES // itemsize)
    if not (dim % multiple or hidden % multiple):
        return None
    return (
        f"{key} needs the model dim ({dim}) and the expert hidden dim ({hidden}) to be multiples of {multiple} "
        f"(the grouped GEMM's 16-byte rows in {dtype}); use {fix} for this model"
    )


def quantized_base_fix(dim: int, hidden: int, fp8: str, none: str) -> str:
    """The fix for an NF4 base the dims refuse: FP8 only where its own alignment holds (a fix that is refused in
    turn is no fix)."""
    return fp8 if blocked_dims_problem("", "fp8", dim, hidden, "") is None else none


def check_expert_dims(cfg: Config, dim: int, hidden: int) -> None:
    """The experts' dims where their weights are stored in blocks: FP8 GEMMs (kernels.experts=grouped_mm_fp8,
    peft.quantize_base=fp8) need FP8 rows on 16-byte boundaries, NF4 (peft.quantize_base=nf4) whole blocks of 32
    inputs (``kernels.nf4_frozen.BLOCKS``): the model dim and the expert hidden dim must be multiples of them. Plain
    grouped GEMMs need 16-byte rows in their dtype."""
    quantized = cfg.peft.quantize_base if cfg.peft.name == "lora" else "none"
    grouped = _grouped_mm_problem(cfg.train.precision, dim, hidden)
    # Each fix passes these checks in turn: where plain grouped GEMMs are refused too, the loop of experts.
    plain = "kernels.experts=loop" if grouped else "kernels.experts=grouped_mm"
    loop = " kernels.experts=loop" if grouped and cfg.kernels.experts == "grouped_mm" else ""
    nf4_fix = quantized_base_fix(dim, hidden, "peft.quantize_base=fp8 or none", f"peft.quantize_base=none{loop}")
    for key, storage, fix in (
        ("kernels.experts=grouped_mm_fp8", "fp8", plain),
        ("peft.quantize_base=fp8", "fp8", f"peft.quantize_base=none{loop}"),
        ("peft.quantize_base=nf4", "nf4", nf4_fix),
    ):
        asked = key == f"kernels.experts={cfg.kernels.experts}" or key == f"peft.quantize_base={quantized}"
        problem = blocked_dims_problem(key, storage, dim, hidden, fix) if asked else None
        if problem:
            raise ConfigError(problem)
    if cfg.kernels.experts == "grouped_mm" and grouped:
        raise ConfigError(grouped)


def _grouped_mm_problem(precision: str, dim: int, hidden: int) -> str | None:
    """``grouped_mm_dims_problem`` for kernels.experts=grouped_mm under ``precision``: bf16 GEMMs under every
    precision but fp32."""
    dtype, itemsize = ("fp32", 4) if precision == "fp32" else ("bf16", 2)
    where = f"{dtype}, train.precision={precision}"
    return grouped_mm_dims_problem("kernels.experts=grouped_mm", dim, hidden, where, itemsize, "kernels.experts=loop")


def check_values(cfg: Config) -> None:
    """Every check that needs neither the world size nor the model: each key's choices or range, then the rules
    between keys. The CLI runs it before Hydra creates the run directory, so a bad value leaves nothing behind."""
    if cfg.kernels.experts == "te":  # a value once offered: its reason, not the list of choices
        raise ConfigError(
            "kernels.experts=te is not offered: TransformerEngine's GroupedLinear measured 28 TFLOP/s against 582 "
            "for grouped_mm on an H200 (it loops over experts); use kernels.experts=grouped_mm"
        )
    check_fields(cfg)
    _check_data(cfg)
    _check_train(cfg)
    _check_kernels(cfg)
    _check_peft(cfg)
    _check_compiled_fp32(cfg)
    resume = cfg.checkpoint.resume
    if resume not in ("auto", "none") and not os.path.isdir(resume):
        raise ConfigError(
            f"checkpoint.resume={resume} does not exist; give a checkpoint directory (<output_dir>/checkpoints/"
            "step_<N>), auto (the newest in output_dir) or none"
        )
    problem = None if cfg.model.path is None else model_dir_problem(cfg.model.path)
    if problem:
        raise ConfigError(problem)
    if cfg.model.path is not None and cfg.model.overrides:  # a checkpoint's config.json is read as it is
        given = " ".join(f"model.overrides.{k}={v}" for k, v in cfg.model.overrides.items())
        drop = " ".join(f"~model.overrides.{k}" for k in cfg.model.overrides)
        raise ConfigError(
            f"{given} changes a built-in preset's shape, and model.path={cfg.model.path} loads that checkpoint's "
            f"own config.json unchanged; leave it out ({drop} removes an experiment's) or edit the checkpoint"
        )


def check_fields(cfg: Config) -> None:
    """Each key against its own field's choices or range (``moe_tune.config.constraints``), in schema order."""
    constraints = {key: constraint for key, _, constraint in constrained_values(cfg)}
    for key, value, constraint in constrained_values(cfg):
        problem = constraint.problem(key, value, sibling_hint(key, value, constraints))
        if problem:
            raise ConfigError(problem)


def _check_data(cfg: Config) -> None:
    d = cfg.data
    if d.path is None and d.name == "jsonl":
        raise ConfigError(
            "data=jsonl reads your records from data.path, which is not set; add data.path=<file|dir|hub name>"
        )
    if d.path is None and d.name not in ("arithmetic", "random"):  # before num_samples' range
        raise ConfigError(
            f"data={d.name!r} is not built in (arithmetic, random); pick one or set data.path=<jsonl|parquet|dir>"
        )
    if d.path is not None and d.name in ("arithmetic", "random"):  # read under a built-in set's name
        raise ConfigError(
            f"data={d.name} generates its records and reads no data.path ({d.path}); for your records "
            f"write data=jsonl data.path={d.path} (or data.path alone)"
        )
    if d.path is None and d.num_samples < 1:  # built-in records only: a file's records are counted, not asked for
        raise ConfigError(out_of_range("data.num_samples", d.num_samples, ">= 1 (built-in records)", "4096"))
    if d.val_fraction > 0 and d.val_path is not None:
        raise ConfigError(
            f"data.val_path ({d.val_path}) and data.val_fraction ({d.val_fraction}) both set; keep one of them"
        )
    if d.streaming and d.val_fraction > 0:
        raise ConfigError(
            f"data.val_fraction ({d.val_fraction}) splits records held in memory; with data.streaming=true "
            "give the held-out records as data.val_path"
        )
    if d.chat_template is not None and not os.path.isfile(d.chat_template):
        raise ConfigError(f"data.chat_template={d.chat_template!r} is not a file; give a Jinja chat template file")
    if d.chat_template is not None:
        _check_template_file(d.chat_template)


def _check_template_file(path: str) -> None:
    """A data.chat_template file that is no template would be blamed on the first record (a tokenizer_config.json
    rendered as text, 'no token carries loss; raise train.seq_len'), or on every record under skip: a JSON file, a
    blank one, one without a Jinja tag (a data file) and Jinja's syntax errors are one line naming the file."""
    import json

    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"data.chat_template={path} cannot be read ({e}); give a Jinja chat template file") from None
    fix = "give a Jinja chat template file"
    if not text.strip():
        raise ConfigError(f"data.chat_template={path} is empty; {fix}")
    try:
        found = json.loads(text)
    except ValueError:
        found = None
    if isinstance(found, dict):
        held = " (its chat_template holds one: write that string to a .jinja file)" if "chat_template" in found else ""
        raise ConfigError(f"data.chat_template={path} is a JSON file, not a Jinja template{held}; {fix}")
    if "{{" not in text and "{%" not in text:  # a data file (JSON Lines, a JSON array) renders as itself
        raise ConfigError(f"data.chat_template={path} holds no Jinja tag ({{{{ ... }}}} or {{% ... %}}); {fix}")
    try:
        import jinja2
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # the renderer's own compile: checked when the records are rendered instead
        return
    try:
        _compile_jinja_template(text)
    except jinja2.TemplateSyntaxError as e:
        raise ConfigError(
            f"data.chat_template={path}:{e.lineno}: not a valid Jinja template ({e.message}); {fix}"
        ) from None


def lora_keys_without_lora(given: list[str]) -> None:
    """``given`` (peft.* overrides) would be silently ignored under peft=none: a forgotten peft=lora. Named by key
    first, as any value of them (``none`` too) is refused."""
    keys = list(dict.fromkeys(g.partition("=")[0].lstrip("+~") for g in given))
    raise ConfigError(
        f"{', '.join(keys)} {'apply' if len(keys) > 1 else 'applies'} to LoRA (peft=lora), and peft=none trains every "
        f"weight: add peft=lora, or drop {', '.join(given)}"
    )


def _check_peft(cfg: Config) -> None:
    p = cfg.peft
    if p.name == "none":  # the adapter keys would be silently ignored: a forgotten peft=lora
        default = PeftConfig()
        keys = ("rank", "alpha", "dropout", "target", "train_router", "quantize_base")
        given = [f"peft.{k}={spelled(getattr(p, k))}" for k in keys if getattr(p, k) != getattr(default, k)]
        if given:
            lora_keys_without_lora(given)
        return
    if p.name != "lora":
        return
    if not p.target:
        raise ConfigError("peft.target is empty: name what LoRA adapts, e.g. peft.target=[attention,experts]")
    if p.quantize_base != "none" and cfg.kernels.experts == "grouped_mm_fp8":
        raise ConfigError(
            f"kernels.experts=grouped_mm_fp8 quantizes trained expert weights at every step; with "
            f"peft.quantize_base={p.quantize_base} the frozen experts are quantized once, at load, and their GEMMs "
            "read them as stored: drop kernels.experts=grouped_mm_fp8"
        )
    if "experts" in p.target and cfg.kernels.experts in ("grouped_mm", "grouped_mm_fp8") and p.rank % 8:
        raise ConfigError(
            f"peft.rank={p.rank} with peft.target including experts: the grouped GEMMs need the rank to be a "
            "multiple of 8 (16-byte rows in bf16); try peft.rank=8 or peft.rank=16"
        )


def _check_compiled_fp32(cfg: Config) -> None:
    """torch.compile traces grouped_mm through its fake kernel, which takes bf16 operands only (torch 2.11-2.13):
    fp32 expert GEMMs under ``kernels.compile=true`` would fail at the first step, on any device. They run where
    the experts' weights are fp32 grouped GEMMs and wherever the experts carry LoRA adapters (their deltas are
    grouped GEMMs too); a quantized base's own GEMMs are custom ops that the compiler does not trace."""
    k, p = cfg.kernels, cfg.peft
    if not k.compile or cfg.train.precision != "fp32" or k.experts != "grouped_mm":
        return
    lora = p.name == "lora"
    quantized = lora and p.quantize_base != "none"
    adapted = lora and "experts" in p.target
    if quantized and not adapted:
        return
    which = "the LoRA adapters of the experts" if quantized else "the experts"
    raise ConfigError(
        f"kernels.compile=true with train.precision=fp32 runs grouped GEMMs in fp32 (in {which}), which "
        "torch.compile cannot trace (its grouped_mm takes bf16 only): use "
        "train.precision=bf16_fp32_master (fp32 master weights, bf16 compute) or amp_bf16, or kernels.compile=false"
    )


def _check_train(cfg: Config) -> None:
    t = cfg.train
    traced = profiled_steps()
    if t.profile and t.steps < traced[-1]:
        raise ConfigError(
            f"train.profile=true traces steps {traced[0]}-{traced[-1]} (after {PROFILE_WAIT} untraced steps and "
            f"{PROFILE_WARMUP} that warms the profiler up), so it needs train.steps >= {traced[-1]} (got "
            f"{t.steps}); set train.steps={traced[-1]}"
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


def _check_kernels(cfg: Config) -> None:
    k, t = cfg.kernels, cfg.train
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

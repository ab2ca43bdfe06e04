"""The one model-building recipe (``assemble``: build on meta -> parallelize -> materialize -> load), used by the
trainer (``build_training_model``), the Python API (``from_pretrained``), ``moe-tune-export``
(``from_checkpoint``) and the benchmarks.

``build_training_model(cfg, env) -> Built`` is the default builder the ``Trainer`` is given; the benchmark's
Transformers baseline gives it another builder (its own Hugging Face model behind the same interface).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from moe_tune.config import CheckpointError, Config, ConfigError, ModelConfig, validate
from moe_tune.config.model_dir import model_dir_problem
from moe_tune.distributed.dims import ParallelDims
from moe_tune.distributed.expert_parallel import ep_dispatchers
from moe_tune.distributed.fsdp import experts_options
from moe_tune.distributed.mesh import ParallelMesh, build_mesh
from moe_tune.distributed.parallelize import parallelize
from moe_tune.distributed.process_group import rank_world
from moe_tune.lora import LoRASpec, frozen_base_dtype
from moe_tune.metrics import flops_per_token
from moe_tune.models.base_model import BASE_MODEL, drop_stale_base_model
from moe_tune.models.families import expert_dims, num_experts
from moe_tune.models.fp8_checkpoint import checkpoint_block_size
from moe_tune.models.hf_io import load_state
from moe_tune.models.host_memory import check_fits_host
from moe_tune.models.init import init_random
from moe_tune.models.lora import init_lora
from moe_tune.models.model import ModelOptions, MoECausalLM, build_model, materialize
from moe_tune.models.source_check import check_overrides, check_source_dir
from moe_tune.moe.experts import ExpertsOptions

log = logging.getLogger("moe_tune")


@dataclass
class Built:
    """What the trainer needs from a build.

    ``model``: forward(input_ids, labels=, position_ids=, loss_normalizer=) -> an output with ``.loss`` (what is
    minimised) and ``.ce_loss`` (the cross-entropy part, logged); ``.config.vocab_size``; FSDP2 roots also have
    ``set_requires_gradient_sync``. ``moe_layers``: moe_tune MoE layers (their dispatchers are checked after
    logging steps, their loads logged and bias-updated); empty for a model that is not moe_tune's.
    ``checkpointable``: moe_tune's checkpoints and Hugging Face export apply to ``model``.
    ``clip_grad_norm``: the model's own clipping (returns the global norm); None uses moe_tune's over ``mesh``.
    ``describe``: extra summary.json fields saying what was built."""

    model: torch.nn.Module
    mesh: Any
    source: str | None
    tokenizer: Any
    flops_per_token: float
    moe_layers: list = field(default_factory=list)
    checkpointable: bool = True
    clip_grad_norm: Callable[[], torch.Tensor] | None = None
    describe: dict = field(default_factory=dict)


def build_source(cfg: Config, rank: int) -> tuple[str | None, object]:
    """(checkpoint dir or None for a random-initialised preset, transformers config)."""
    from transformers import AutoConfig

    from moe_tune.models.presets import build_tiny_checkpoint, preset_config

    if cfg.model.path is not None:
        return cfg.model.path, AutoConfig.from_pretrained(cfg.model.path)
    if cfg.model.name.startswith("tiny_"):
        # Absolute: checkpoints and exported adapters name it as their base, read from any directory.
        path = os.path.abspath(os.path.join(cfg.output_dir, BASE_MODEL))
        if rank == 0:
            drop_stale_base_model(path, cfg.model.name, cfg.model.overrides, cfg.train.seed)
            build_tiny_checkpoint(path, cfg.model.name, cfg.model.overrides, seed=cfg.train.seed)
        if dist.is_initialized():
            dist.barrier()  # the other ranks read what rank 0 wrote
        return path, AutoConfig.from_pretrained(path)
    return None, preset_config(cfg.model.name, cfg.model.overrides)


def check_model_source(cfg: Config, weights: bool = True) -> None:
    """Before any process group or write: a model.path's config.json and safetensors headers can be read, a
    preset's overrides have the types of the fields they replace (one line each, exit 2). ``weights=False``: for a
    plan, which needs config.json alone (``check_source_dir``)."""
    if cfg.model.path is not None:
        problem = model_dir_problem(cfg.model.path)
        if problem:
            raise CheckpointError(problem)
        hf = check_source_dir(cfg.model.path, weights)
        check_family(cfg.model, hf["model_type"], hf.get("architectures"))
        check_tokenizer(cfg, hf.get("vocab_size"))
    else:
        check_overrides(cfg.model.name, cfg.model.overrides)


def check_family(model: ModelConfig, model_type: str, architectures: list[str] | None = None) -> None:
    """The checkpoint's architecture is a supported family, and the one ``model.family`` names (or auto)."""
    from moe_tune.models.families import get_family

    get_family(model_type, architectures)
    if model.family in ("auto", model_type):
        return
    if model.name != "hf" and model.path is not None:  # a preset's family, with the user's checkpoint
        raise ConfigError(
            f"model.path={model.path} has model_type {model_type}, but model={model.name} is a preset of family "
            f"{model.family}; load your checkpoint with model=hf model.path={model.path}"
        )
    raise ConfigError(
        f"model.family={model.family} but the checkpoint's model_type is {model_type}; "
        f"set model.family={model_type} or model.family=auto"
    )


# Any of these makes a directory's tokenizer loadable by AutoTokenizer (fast, sentencepiece or BPE vocabularies).
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model")


def has_tokenizer(source: str) -> bool:
    return any(os.path.isfile(os.path.join(source, name)) for name in TOKENIZER_FILES)


def build_tokenizer(source: str | None):
    """The checkpoint's own tokenizer, or moe_tune's built-in character tokenizer for a preset and for a
    checkpoint without tokenizer files (built-in data only: ``check_tokenizer`` refuses the user's records)."""
    from moe_tune.models.presets import build_tokenizer as builtin

    if source is not None and has_tokenizer(source):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(source)
    return builtin()


def check_tokenizer(cfg: Config, vocab_size: int | None) -> None:
    """Before anything is written: the user's records are never tokenized by the built-in tokenizer in place of a
    checkpoint's missing one, and no token id reaches past the model's embedding (an index error mid-run, a
    device-side assert on a GPU)."""
    path = cfg.model.path
    if cfg.data.path is None and cfg.data.name == "random":  # token ids drawn below vocab_size, no tokenizer
        return
    if not has_tokenizer(path) and cfg.data.path is not None:
        raise ConfigError(
            f"model.path={path} has no tokenizer ({', '.join(TOKENIZER_FILES[:2])}, ...), so data.path "
            "cannot be tokenized as the model was trained; copy the checkpoint's tokenizer files into it"
        )
    size = len(build_tokenizer(path))
    if vocab_size is not None and size > vocab_size:
        raise ConfigError(
            f"model.path={path}: its tokenizer has {size} tokens but the model's vocab_size is {vocab_size}; resize "
            "the embeddings (model.resize_token_embeddings(len(tokenizer)), then save_pretrained) or use the "
            "tokenizer the model was trained with"
        )


def lora_spec(cfg: Config) -> LoRASpec | None:
    """``peft=lora`` as the model's LoRA options; None for full fine-tuning. The frozen base is stored in bf16
    (fp32 only for train.precision=fp32), the adapters in the precision's parameter dtype."""
    p = cfg.peft
    if p.name != "lora":
        return None
    return LoRASpec(p.rank, p.alpha, p.dropout, tuple(p.target), p.train_router, frozen_base_dtype(cfg.train.precision))


def model_options(cfg: Config, dims: ParallelDims) -> ModelOptions:
    """The model's construction options for a run: every choice the config makes about the model, in one place.
    LoRA with frozen routers computes no balancing loss: it would only steer the adapters of earlier layers."""
    k, t = cfg.kernels, cfg.train
    lora = lora_spec(cfg)
    balancing = lora is None or lora.train_router
    return ModelOptions(
        dtype=torch.bfloat16 if t.precision == "bf16" else torch.float32,
        kernels=k.name,
        fp8=k.fp8,
        fp8_options=k.fp8_options(),
        experts=dataclasses.replace(
            experts_options(dims, t.precision, k.experts),
            quantized_base=cfg.peft.quantize_base if lora is not None and cfg.peft.quantize_base != "none" else None,
            quantized_gemm=k.quantized_base,
        ),
        loss_chunk_size=k.loss_chunk_size if k.fused_loss else None,
        aux_loss_coef=t.aux_loss_coef if balancing else 0.0,
        z_loss_coef=t.z_loss_coef if balancing else 0.0,
        force_balanced_routing=t.force_balanced_routing,
        # Packed rows or not: with moe_tune's attention function transformers builds no mask, and its mask
        # building checks the position ids for packed sequences with a host sync on every forward.
        packed_attention=True,
        lora=lora,
    )


def assemble(
    hf_config,
    options: ModelOptions,
    load: Callable[[MoECausalLM], None],
    device: torch.device | str = "cpu",
    source: str | None = None,
    parallel: tuple[ParallelMesh, Config] | None = None,
    training: bool = False,
) -> MoECausalLM:
    """The recipe every entry point uses: build on the meta device (each rank's experts only, under expert
    parallelism) -> parallelize on the mesh -> materialize on ``device`` (on the CPU, once it is known to fit,
    with gradients and AdamW moments when ``training``) -> ``load`` (each rank reads its own shards).
    ``parallel``: (mesh, run config) for a process group; None for one process without parallelism."""
    mesh, cfg = parallel if parallel is not None else (None, None)
    # The trainer runs every dispatcher's check() on all ranks after a step (symm_mem's capacity overflow).
    make_dispatcher = ep_dispatchers(mesh, cfg.comm, checked_after_step=True) if mesh is not None else None
    model = build_model(hf_config, options, make_dispatcher, source)
    if mesh is not None:
        parallelize(model, mesh, cfg)
    if torch.device(device).type == "cpu":
        check_fits_host(model, training)
    materialize(model, device)
    load(model)
    return model


def source_loader(source: str | None, seed: int) -> Callable[[MoECausalLM], None]:
    """Load the source checkpoint's tensors, or (a preset without one) draw random weights by name; then LoRA
    adapters, if the model has them, start as PEFT's do (B = 0: the model is the base model)."""

    def load(model: MoECausalLM) -> None:
        if source is not None:
            if (block := checkpoint_block_size(source)) and rank_world()[0] == 0:
                log.info("%s: fp8 weights in %dx%d blocks (quantization_config), read dequantized", source, *block)
            load_state(model, source, model.family)
        else:
            init_random(model, seed=seed, num_experts=model.num_experts)
        if model.options.lora is not None:
            init_lora(model, seed)

    return load


def build_training_model(cfg: Config, env) -> Built:
    """moe_tune's model for ``cfg`` on this process group (``env``: ``moe_tune.distributed.process_group``'s rank, world, device)."""
    source, hf_config = build_source(cfg, env.rank)
    tokenizer = build_tokenizer(source)
    check_family(cfg.model, hf_config.model_type)
    dims = validate(
        cfg, world_size=env.world_size, num_experts=num_experts(hf_config), expert_dims=expert_dims(hf_config)
    )
    mesh = build_mesh(dims, env.device.type)
    load = source_loader(source, cfg.train.seed)
    model = assemble(hf_config, model_options(cfg, dims), load, env.device, source, (mesh, cfg), training=True)
    model.train()
    if source is not None and not has_tokenizer(source) and env.rank == 0:  # built-in data (check_tokenizer)
        log.warning("%s has no tokenizer files: moe_tune's character tokenizer reads the built-in data", source)
    longest = getattr(hf_config, "max_position_embeddings", None)
    if longest and cfg.train.seq_len > longest and env.rank == 0:
        log.warning(
            "train.seq_len=%d is longer than the model's max_position_embeddings=%d: positions past %d are ones it "
            "was not trained on; lower train.seq_len, or extend the model's context first (its config's rope_scaling)",
            cfg.train.seq_len,
            longest,
            longest,
        )
    return Built(
        model=model,
        mesh=mesh,
        source=source,
        tokenizer=tokenizer,
        flops_per_token=flops_per_token(model, cfg.train.seq_len, frozen_base=model.options.lora is not None),
        moe_layers=list(model.moe_layers()),
    )


def from_pretrained(path: str, dtype=torch.float32, kernels: str = "torch", device=None, **options) -> MoECausalLM:
    """One process, no parallelism: a Hugging Face MoE checkpoint as moe_tune's model (the Python API), in eval
    mode as transformers returns it (``model.train()`` to train). ``options``: further ``ModelOptions`` fields
    (e.g. ``aux_loss_coef``, ``loss_chunk_size``)."""
    from transformers import AutoConfig

    problem = model_dir_problem(path, key="path")
    if problem:
        raise CheckpointError(problem)
    check_source_dir(path)  # config.json's sizes and the safetensors headers, as moe-tune checks them
    from moe_tune.models.api_args import model_options as api_model_options

    model_options = api_model_options(dtype, kernels, options)
    model = assemble(AutoConfig.from_pretrained(path), model_options, source_loader(path, 0), device or "cpu", path)
    return model.eval()


def _stored_dtype(source: str | None) -> torch.dtype | None:
    """The dtype most of a checkpoint directory's tensors are stored in (None: no files, a random built-in)."""
    if source is None:
        return None
    from collections import Counter

    from moe_tune.models.hf_io import source_dtypes

    return Counter(source_dtypes(source).values()).most_common(1)[0][0]


def _checkpoint_base(checkpoint: str, meta: dict, cfg: Config, base: str | None) -> str | None:
    """The directory a checkpoint's model is built from: ``base`` if given, else the run's source if it is still
    there; a LoRA checkpoint's base must exist and match the fingerprint it was saved with (CheckpointError)."""
    source = base or meta.get("source")
    if source and not os.path.isfile(os.path.join(source, "config.json")):
        if cfg.peft.name == "lora":  # adapters alone are no model
            from moe_tune.checkpoint.state import missing_base

            raise CheckpointError(missing_base(checkpoint, source, given=base is not None))
        return None
    if cfg.peft.name == "lora" and source and meta.get("base_fingerprint"):
        from moe_tune.checkpoint.state import check_base

        fix = "give --base the directory of the base model they were trained on"
        check_base(meta, {}, cfg.train.seed, source, checkpoint, fix=fix)
    return source


def from_checkpoint(checkpoint: str, base: str | None = None) -> tuple[MoECausalLM, Config]:
    """One CPU process: a training checkpoint (``checkpoints/step_<N>``, any parallel layout: experts are stored
    one per key) as moe_tune's model, with the run's config. Only the model's tensors are read; for a LoRA run,
    the base model first, from the source the checkpoint points to or from ``base`` (checked to be the same). In
    eval mode, as ``from_pretrained`` returns its model (``model.train()`` to train it)."""
    from transformers import AutoConfig

    from moe_tune.checkpoint import load_model_weights, read_meta

    meta, cfg = read_meta(checkpoint)
    source = _checkpoint_base(checkpoint, meta, cfg, base)
    if source:
        hf_config = AutoConfig.from_pretrained(source)
    else:
        from moe_tune.models.presets import preset_config

        hf_config = preset_config(cfg.model.name, cfg.model.overrides)
    # LoRA: the frozen base in the dtype its files hold (not training's bf16 copy of an fp32 source, so a merge loses
    # nothing; not fp32 for a bf16 source, so a 30B model takes 61 GB, not 122); the adapters in the dtype they
    # trained in (bf16 under train.precision=bf16, else fp32): the checkpoint's values as they are.
    lora = lora_spec(cfg)
    if lora is not None:
        lora = dataclasses.replace(lora, base_dtype=_stored_dtype(source))
    # A run's per-expert loop, kept: it ran experts whose rows grouped GEMMs cannot take (check_expert_dims).
    experts = ExpertsOptions(impl="loop") if cfg.kernels.experts == "loop" else ExpertsOptions()
    dtype = torch.bfloat16 if cfg.train.precision == "bf16" else torch.float32
    options = ModelOptions(dtype=dtype, lora=lora, experts=experts)

    def load(model: MoECausalLM) -> None:
        if lora is not None:  # the base from where the run read it, then the checkpoint's adapters
            source_loader(source, cfg.train.seed)(model)
        load_model_weights(model, checkpoint)

    return assemble(hf_config, options, load, "cpu", source).eval(), cfg


__all__ = [
    "Built",
    "assemble",
    "build_source",
    "build_tokenizer",
    "build_training_model",
    "check_model_source",
    "lora_spec",
    "from_checkpoint",
    "from_pretrained",
    "model_options",
    "source_loader",
]

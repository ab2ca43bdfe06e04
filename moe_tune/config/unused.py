"""Settings a run accepts but that change nothing in it, as lines for the run's log at its start (the run goes on: a
value that cannot work is an error in ``validate`` instead)."""

from __future__ import annotations

import os

from moe_tune.config.schema import Config, TrainConfig


def unused_settings(
    cfg: Config, device_type: str = "cuda", world_size: int = 1, routed_experts: bool = True
) -> list[str]:
    """``device_type``: the run's device ("cpu" or "cuda"; some kernels exist on CUDA only); ``world_size``: its
    ranks; ``routed_experts``: whether the built model has any (a MoE family's config may make every layer dense)."""
    t, d, default = cfg.train, cfg.data, TrainConfig()
    lines = _emulated_fp8_base(cfg, device_type) + _quantized_gemm(cfg, device_type) + _loop_on_quantized(cfg)
    lines += _quantized_copies(cfg, world_size) + _quantized_without_experts(cfg, routed_experts)
    if t.eval_every > 0 and d.val_path is None and d.val_fraction == 0:
        lines.append(
            f"train.eval_every={t.eval_every} has no validation set to evaluate, so no val_loss is logged; add "
            "data.val_path=<file> or data.val_fraction=0.02"
        )
    if d.val_path is not None and d.path is not None and _same_path(d.val_path, d.path):
        lines.append(
            f"data.val_path is data.path ({d.path}): val_loss is measured on the training records, not held-out "
            "ones; give held-out records as data.val_path, or data.val_fraction=0.02 in its place"
        )
    if cfg.optim.warmup_steps > t.steps:
        lines.append(
            f"optim.warmup_steps={cfg.optim.warmup_steps} is more than train.steps={t.steps}: the learning rate "
            f"never reaches train.lr={t.lr} (it ends at {t.steps}/{cfg.optim.warmup_steps} of it); lower "
            "optim.warmup_steps"
        )
    if t.warmup_steps_excluded >= t.steps > 0:
        lines.append(
            f"train.warmup_steps_excluded={t.warmup_steps_excluded} leaves no step of train.steps={t.steps} to time: "
            "summary.json's medians take every step, the first ones' start-up cost included; raise train.steps"
        )
    if cfg.peft.name == "lora" and not cfg.peft.train_router:
        for key in ("aux_loss_coef", "z_loss_coef"):
            if getattr(t, key) != getattr(default, key):
                lines.append(
                    f"train.{key}={getattr(t, key)} changes nothing with peft=lora and frozen routers (no balancing "
                    "loss is computed); add peft.train_router=true to train the routers with it"
                )
    if cfg.logger.expert_load_image_every > 0 and cfg.logger.name == "none":
        lines.append(
            f"logger.expert_load_image_every={cfg.logger.expert_load_image_every} draws images for a tracker, and "
            "logger=none has none; add logger=tensorboard (or wandb, mlflow)"
        )
    return lines


def _same_path(a: str, b: str) -> bool:
    """Whether two data paths name the same file or directory (a hub name: the same text)."""
    if os.path.exists(a) and os.path.exists(b):
        return os.path.samefile(a, b)
    return a == b


def _quantized_gemm(cfg: Config, device_type: str) -> list[str]:
    """kernels.quantized_base chooses the GEMMs of a quantized base's experts: only with one, and Triton on CUDA."""
    gemm = cfg.kernels.quantized_base
    if gemm == "torch":
        return []
    if cfg.peft.name != "lora" or cfg.peft.quantize_base == "none":
        lora = cfg.peft.name == "lora"
        quantized = "peft.quantize_base=none" if lora else f"peft={cfg.peft.name}"
        add = "peft.quantize_base=fp8" if lora else "peft=lora peft.quantize_base=fp8"  # only what the run lacks
        return [
            f"kernels.quantized_base={gemm} chooses the GEMMs of a quantized base's experts, and {quantized} keeps "
            f"them in bf16; add {add} (or nf4) to quantize them"
        ]
    if device_type != "cuda":
        return [
            f"kernels.quantized_base={gemm} is a CUDA kernel; on the {device_type} the quantized experts are "
            "dequantized and multiplied in PyTorch"
        ]
    return []


def _emulated_fp8_base(cfg: Config, device_type: str) -> list[str]:
    """An FP8 base off CUDA runs the kernel's emulation: a run that says nothing looks like FP8 on a GPU."""
    if cfg.peft.name != "lora" or cfg.peft.quantize_base != "fp8" or device_type == "cuda":
        return []
    return [
        f"peft.quantize_base=fp8 on the {device_type} emulates the FP8 GEMMs (the same E4M3 values, multiplied in "
        "fp32): the numbers and the memory of FP8, far slower; its kernel needs an sm90 GPU (H100, H200)"
    ]


def _loop_on_quantized(cfg: Config) -> list[str]:
    """The reference loop multiplies each expert's weights as fp32 copies: a quantized base's saving is gone there."""
    quantized = cfg.peft.quantize_base if cfg.peft.name == "lora" else "none"
    if cfg.kernels.experts != "loop" or quantized == "none":
        return []
    return [
        f"kernels.experts=loop with peft.quantize_base={quantized} runs the reference loop over fp32 copies of the "
        "quantized experts, made at every forward (more memory than a bf16 base, activations never quantized); "
        "kernels.experts=grouped_mm multiplies them as they are held"
    ]


# Copies of each quantized expert over the job (ranks / parallel.ep) from which a rank holds more than FSDP2's shard
# of a bf16 base (16 / copies bits a weight): NF4 is 4 bits and a scale per block, FP8 8 bits and a scale per row.
MORE_THAN_BF16_FROM = {"nf4": 4, "fp8": 2}


def _quantized_copies(cfg: Config, world_size: int) -> list[str]:
    """Quantized experts are held whole on every rank of an expert shard group, where FSDP2 shards bf16 ones."""
    quantized = cfg.peft.quantize_base if cfg.peft.name == "lora" else "none"
    copies = world_size // cfg.parallel.ep
    if quantized == "none" or copies <= 1:
        return []
    than = "more than a bf16 base sharded over them" if copies >= MORE_THAN_BF16_FROM[quantized] else "less saved"
    return [
        f"peft.quantize_base={quantized} with parallel.ep={cfg.parallel.ep} of {world_size} ranks holds each rank's "
        f"experts quantized whole on {copies} ranks ({than}); parallel.ep={world_size} holds the least"
    ]


def _quantized_without_experts(cfg: Config, routed_experts: bool) -> list[str]:
    """A quantized base holds the routed experts quantized: a model without any has nothing to quantize."""
    quantized = cfg.peft.quantize_base if cfg.peft.name == "lora" else "none"
    if routed_experts or quantized == "none":
        return []
    return [
        f"peft.quantize_base={quantized} quantizes the routed experts, and this model has none (no MoE layer): "
        "every weight stays as stored; drop peft.quantize_base"
    ]

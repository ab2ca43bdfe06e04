"""Optimizer and learning-rate schedule.

The optimizer is AdamW with torch's state layout; its state is fp32 whenever the parameters are (the default
``bf16_fp32_master`` precision keeps fp32 parameters as the master copy). ``optim.compiled=true`` (the default)
runs ``moe_tune.optim.adamw.CompiledAdamW``: one Triton kernel per large parameter on a GPU, torch's fused
multi-tensor kernel for the rest; ``optim.compiled=false`` runs torch's fused AdamW alone
(``torch.optim.AdamW(fused=True)``, one kernel per dtype/device group). Checkpoints move between the two. With
bf16 parameters, ``optim.stochastic_rounding=true`` swaps in ``moe_tune.optim.stochastic.StochasticRoundingAdamW``
(its update one Triton kernel per parameter on a GPU, eager with ``optim.compiled=false`` and on a CPU).
"""

from __future__ import annotations

import logging
import math

import torch

from moe_tune.config import ConfigError, OptimConfig

log = logging.getLogger("moe_tune")


def param_groups(params) -> list[dict]:
    """FSDP2 parameters are DTensors; experts kept outside FSDP2 are plain tensors. A fused/foreach kernel
    cannot take both in one list, so they go in separate groups (each group gets its own kernel launches)."""
    params = [p for p in params if p.requires_grad]
    sharded = [p for p in params if hasattr(p, "to_local")]
    plain = [p for p in params if not hasattr(p, "to_local")]
    return [{"params": g} for g in (sharded, plain) if g]


def report_rounding(precision: str, stochastic: bool) -> None:
    """How a bf16 run's updates round: said once (rank 0), a warning where updates are lost."""
    if precision != "bf16":
        return
    if stochastic:
        log.info("bf16 parameters: AdamW rounds its updates stochastically (optim.stochastic_rounding)")
        return
    log.warning(
        "optim.stochastic_rounding=false with train.precision=bf16 rounds every AdamW update to the nearest bf16 "
        "value: updates below half a bf16 step are lost (at lr 3e-5 its loss stalled at 1.9-2.8x fp32 master "
        "weights' on an H200); drop the override to round stochastically (0.99x the speed there)"
    )


def build_optimizer(params, cfg: OptimConfig, lr: float, seed: int = 0, shard_index: int = 0) -> torch.optim.Optimizer:
    """``cfg.stochastic_rounding`` as the run applies it (``moe_tune.config.rounds_stochastically``; None here:
    off). ``seed`` and ``shard_index`` (this rank's position within its data-parallel replica) seed stochastic
    rounding's random bits, with each parameter's step and index."""
    if cfg.name != "adamw":
        raise ConfigError(f"optim={cfg.name!r} is not one of adamw")
    if cfg.stochastic_rounding:
        from moe_tune.optim.stochastic import StochasticRoundingAdamW

        return StochasticRoundingAdamW(
            param_groups(params),
            lr,
            tuple(cfg.betas),
            cfg.eps,
            cfg.weight_decay,
            seed=seed,
            shard_index=shard_index,
            compiled=cfg.compiled,
        )
    if cfg.compiled:
        from moe_tune.optim.adamw import CompiledAdamW

        return CompiledAdamW(param_groups(params), lr, tuple(cfg.betas), cfg.eps, cfg.weight_decay)
    return torch.optim.AdamW(
        param_groups(params),
        lr=lr,
        betas=tuple(cfg.betas),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        fused=True,  # CUDA and CPU: one kernel per group, and it can skip a step on device (found_inf)
    )


def lr_lambda(cfg: OptimConfig, total_steps: int):
    """Linear warm-up, then cosine (or constant) down to ``min_lr_ratio`` of the peak."""
    if cfg.schedule not in ("cosine", "constant"):
        raise ConfigError(f"optim.schedule={cfg.schedule!r} is not one of cosine, constant")

    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.schedule == "constant":
            return 1.0
        progress = (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return f


def build_scheduler(optimizer, cfg: OptimConfig, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, total_steps))

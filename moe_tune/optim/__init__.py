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

from moe_tune.config import SCHEDULES, ConfigError, OptimConfig

log = logging.getLogger("moe_tune")


def is_decayed(name: str, p: torch.Tensor) -> bool:
    """Megatron's rule: weight decay leaves every 1-D parameter (norms' weights, biases, GPT-OSS's attention sinks)
    and every bias alone, GPT-OSS's stacked expert biases ([experts, out]) included."""
    return p.ndim > 1 and not name.endswith("bias")


def param_groups(params, weight_decay: float = 0.0, decay_norms_and_biases: bool = True) -> list[dict]:
    """The trained parameters in groups: FSDP2 parameters are DTensors, experts kept outside FSDP2 plain tensors,
    and a fused/foreach kernel cannot take both in one list, so they go in separate groups (each group gets its own
    kernel launches). With ``weight_decay`` > 0 and not ``decay_norms_and_biases``, each is split once more: the
    parameters ``is_decayed`` leaves out get weight_decay 0. ``params``: (name, parameter) pairs, as
    ``named_parameters()`` gives them, or parameters alone (then only the 1-D part of the rule can apply)."""
    named = [item if isinstance(item, tuple) else ("", item) for item in params]
    named = [(n, p) for n, p in named if p.requires_grad]
    split = weight_decay > 0 and not decay_norms_and_biases
    groups = []
    for sharded in (True, False):
        kind = [(n, p) for n, p in named if hasattr(p, "to_local") == sharded]
        if not split:
            groups.append({"params": [p for _, p in kind]})
            continue
        groups.append({"params": [p for n, p in kind if is_decayed(n, p)]})
        groups.append({"params": [p for n, p in kind if not is_decayed(n, p)], "weight_decay": 0.0})
    return [g for g in groups if g["params"]]


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
    """``params``: the model's ``named_parameters()`` (the names decide what weight decay leaves alone:
    ``param_groups``). ``cfg.stochastic_rounding`` as the run applies it (``moe_tune.config.rounds_stochastically``;
    None here: off). ``seed`` and ``shard_index`` (this rank's position within its data-parallel replica) seed
    stochastic rounding's random bits, with each parameter's step and index."""
    if cfg.name != "adamw":
        raise ConfigError(f"optim={cfg.name!r} is not one of adamw")
    groups = param_groups(params, cfg.weight_decay, cfg.decay_norms_and_biases)
    if cfg.stochastic_rounding:
        from moe_tune.optim.stochastic import StochasticRoundingAdamW

        return StochasticRoundingAdamW(
            groups,
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

        return CompiledAdamW(groups, lr, tuple(cfg.betas), cfg.eps, cfg.weight_decay)
    return torch.optim.AdamW(
        groups,
        lr=lr,
        betas=tuple(cfg.betas),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        fused=True,  # CUDA and CPU: one kernel per group, and it can skip a step on device (found_inf)
    )


def lr_lambda(cfg: OptimConfig, total_steps: int):
    """The learning rate of step ``s`` over the peak (``s`` from 0: the step's lr is applied by its optimizer step;
    the scheduler then moves on to s + 1). Linear warm-up reaches the peak at the ``warmup_steps``-th step
    (s = warmup_steps - 1); "cosine" then falls to ``min_lr_ratio`` of the peak exactly at the last step
    (s = total_steps - 1), "constant" stays at the peak."""
    if cfg.schedule not in SCHEDULES:
        raise ConfigError(f"optim.schedule={cfg.schedule!r} is not one of {', '.join(SCHEDULES)}")
    peak = max(cfg.warmup_steps, 1) - 1  # the first step at the peak

    def f(step: int) -> float:
        if step < peak:
            return (step + 1) / cfg.warmup_steps
        if cfg.schedule == "constant":
            return 1.0
        progress = min((step - peak) / max(1, total_steps - 1 - peak), 1.0)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def build_scheduler(optimizer, cfg: OptimConfig, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, total_steps))

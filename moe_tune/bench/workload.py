"""The workload every row of ``moe-tune-bench`` shares: the overrides' defaults, the resolved config, each row's
config and the result's workload fields, and the rows' comparison with the reference loss curve."""

from __future__ import annotations

import json
import os

# Written out for every row unless the overrides set them: no export or checkpoint writes in a benchmark
# (not even when a row is stopped at its timeout), and never resume from an earlier run's checkpoint.
BENCH_DEFAULTS = (
    "checkpoint.export_hf=false",
    "checkpoint.every=0",
    "checkpoint.resume=none",
    "checkpoint.save_on_signal=false",  # a row stopped at its timeout (SIGTERM) writes no checkpoint
)
PEAK_SOURCE = "NVIDIA datasheet dense BF16 tensor-core peak, without sparsity"


def with_defaults(overrides: list[str]) -> list[str]:
    keys = {o.partition("=")[0].lstrip("+~") for o in overrides}
    return [d for d in BENCH_DEFAULTS if d.partition("=")[0] not in keys] + overrides


def compose_config(overrides: list[str]):
    """The resolved ``Config`` of a set of overrides, or the one-line reason it does not compose."""
    from moe_tune.config import UserError
    from moe_tune.config.overrides import check, to_config

    try:
        return to_config(check(overrides)), None
    except UserError as e:  # an unknown key, option or value type, as moe-tune words it
        return None, str(e)


def variant_problem(plans, common: list[str]) -> str | None:
    """The first moe_tune row whose overrides do not compose (a typo, a placeholder), before any row runs."""
    for plan in plans:
        if plan.kind == "moe_tune" and plan.overrides != common:
            error = compose_config(plan.overrides)[1]
            if error:
                given = " ".join(plan.overrides[len(common) :])
                return f"--variants row {plan.name!r} ({given}): {error}"
    return None


def row_config(cfg, kind: str, experts: str | None = None) -> dict:
    if cfg is None:
        return {}
    common = {
        "precision": cfg.train.precision,
        "activation_checkpointing": cfg.parallel.activation_checkpointing,
        "micro_batch_size": cfg.train.micro_batch_size,
    }
    if kind == "peer":
        return {"kernels": "nemo_automodel", **common}  # the rest comes from its summary.json
    if kind == "baseline":
        return {
            "comm": "none",
            "kernels": "transformers",
            "experts": experts,
            "ep": 1,
            "fsdp": "per layer + root",
            **common,
        }
    return {
        "comm": cfg.comm.name,
        "kernels": cfg.kernels.name,
        "experts": cfg.kernels.experts,
        "fp8": cfg.kernels.fp8,
        "compile": cfg.kernels.compile,
        "fused_loss": cfg.kernels.fused_loss,
        "ep": cfg.parallel.ep,
        "dp_replicate": cfg.parallel.dp_replicate,
        **common,
    }


def workload(cfg, nproc: int) -> dict:
    from moe_tune.models.presets import PRESETS

    t = cfg.train
    published = PRESETS.get(cfg.model.name, {}).get("num_hidden_layers") if cfg.model.path is None else None
    num_layers = cfg.model.overrides.get("num_hidden_layers", published)
    if cfg.model.path is not None:
        with open(os.path.join(cfg.model.path, "config.json")) as f:
            num_layers = json.load(f).get("num_hidden_layers")
    return {
        "model": cfg.model.path or cfg.model.name,
        "num_layers": num_layers,
        "published_num_layers": published,
        "seq_len": t.seq_len,
        "global_batch_size": t.micro_batch_size * nproc if t.global_batch_size == -1 else t.global_batch_size,
        "micro_batch_size": t.micro_batch_size,
        "precision": t.precision,
        "routing": "forced_balanced" if t.force_balanced_routing else "real",
        "activation_checkpointing": cfg.parallel.activation_checkpointing,
        "steps": t.steps,
        "warmup_steps_excluded": t.warmup_steps_excluded,
        "data": cfg.data.path or cfg.data.name,
        "seed": t.seed,
        "lr": t.lr,
        "peft": None
        if cfg.peft.name == "none"
        else f"rank {cfg.peft.rank}, alpha {cfg.peft.alpha:g} on {', '.join(cfg.peft.target)}",
    }


def max_loss_diff(losses: list[float], reference: list[float], relative: bool = False) -> float | None:
    """Largest per-step difference of two loss curves (absolute, or relative to the reference's loss)."""
    pairs = list(zip(losses, reference))
    if not pairs:
        return None
    return max(abs(a - b) / (max(abs(b), 1e-12) if relative else 1.0) for a, b in pairs)


def finish_rows(rows: list[dict], peak: float | None, reference: str | None = None) -> str | None:
    """Fill MFU and each row's loss-curve difference from the reference row: the variant named ``reference``,
    else the first baseline that ran. Returns the reference's name (None when it did not run)."""
    ok = [r for r in rows if r["status"] == "ok"]
    if reference is None:
        ref = next((r for r in ok if r["kind"] == "baseline"), None)
    else:
        ref = next((r for r in ok if r["variant"] == reference), None)
    for r in rows:
        r["mfu"] = r["tflops_per_gpu"] / peak if peak and r["tflops_per_gpu"] is not None else None
        same = ref is not None and r["status"] == "ok"
        r["max_loss_diff_vs_baseline"] = max_loss_diff(r["losses"], ref["losses"]) if same else None
        r["max_loss_rel_diff_vs_reference"] = max_loss_diff(r["losses"], ref["losses"], relative=True) if same else None
    return ref["variant"] if ref else None

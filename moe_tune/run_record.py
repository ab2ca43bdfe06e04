"""What a run leaves beside its metrics: the logging setup, the resolved config, summary.json with the commit,
versions and hardware it ran on (docs/checkpoints-and-outputs.md), and the log's line on what it trains. Shared by
the trainer, the benchmark and its baselines."""

from __future__ import annotations

import json
import logging
import os
import subprocess
from dataclasses import asdict

import torch

from moe_tune.config import Config
from moe_tune.lora import frozen_base_dtype


def setup_logging(rank: int) -> None:
    """Rank 0 logs at INFO, the others only warnings; every line names its rank."""
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank{rank}] %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )


def git_commit() -> str:
    """``MOE_TUNE_COMMIT`` if set (a container without .git), else ``git rev-parse HEAD`` of this checkout."""
    if os.environ.get("MOE_TUNE_COMMIT"):
        return os.environ["MOE_TUNE_COMMIT"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        cmd = ["git", "-C", root, "rev-parse", "HEAD"]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=5).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def hardware_name(world: int, device: torch.device) -> str:
    """'2 x NVIDIA H200', or 'cpu (2 cores) x 2 processes'."""
    if device.type == "cuda":
        return f"{world} x {torch.cuda.get_device_name(device)}"
    return f"cpu ({os.cpu_count()} cores) x {world} processes"


def write_json(path: str, obj) -> None:
    """Write through a temporary file, flushed to disk, and rename: a reader never sees half a file, and a crash
    right after leaves the whole file."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, default=str)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_config(cfg: Config) -> None:
    """The resolved config as config.json in the run directory (rank 0 calls it)."""
    os.makedirs(cfg.output_dir, exist_ok=True)
    write_json(os.path.join(cfg.output_dir, "config.json"), asdict(cfg))


def write_run_summary(cfg: Config, rank: int, world: int, device, flops_per_token: float, metrics, **extra) -> dict:
    """summary.json (docs/checkpoints-and-outputs.md): resolved config, versions, hardware, commit, ``extra``, then
    the metrics' aggregates. Every rank returns it; rank 0 writes it."""
    from moe_tune.env import versions

    summary = {
        "config": asdict(cfg),
        "versions": versions(),
        "hardware": hardware_name(world, device),
        "num_gpus": world if device.type == "cuda" else 0,
        "world_size": world,
        "commit": git_commit(),
        "flops_per_token": flops_per_token,
        "routing": "forced_balanced" if cfg.train.force_balanced_routing else "real",
        **extra,
        **metrics.summary(),
    }
    if rank == 0:
        write_json(os.path.join(cfg.output_dir, "summary.json"), summary)
    return summary


def trained_what(cfg: Config, routed_experts: bool = True) -> str:
    """What the optimizer updates, for the run's log: every weight, or LoRA's adapters over a frozen base and how
    that base's routed experts (``routed_experts``: the model has some) are held (``frozen_base_dtype``, or
    quantized)."""
    p = cfg.peft
    if p.name != "lora":
        return "every weight (a full fine-tune)"
    if p.quantize_base != "none" and routed_experts:
        base = f"{p.quantize_base} (peft.quantize_base)"
    else:
        base = {torch.float32: "fp32", torch.bfloat16: "bf16"}[frozen_base_dtype(cfg.train.precision)]
    router = " and the routers" if p.train_router else ""
    held = "the frozen routed experts held" if routed_experts else "the frozen base (no routed experts) held"
    return f"LoRA adapters of rank {p.rank} (alpha {p.alpha:g}) on {', '.join(p.target)}{router}; {held} in {base}"


__all__ = [
    "git_commit",
    "hardware_name",
    "setup_logging",
    "trained_what",
    "write_config",
    "write_json",
    "write_run_summary",
]

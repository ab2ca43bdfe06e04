"""Throughput, FLOPs and memory accounting, and the metrics.jsonl / summary.json writers.

FLOPs per token (training, forward + backward = 3 x forward):
    6 * N_active + 6 * L * S * d_attn
N_active: matmul parameters one token passes through: attention projections, the top_k routed experts'
    (and shared experts') projections, the router, dense MLPs, and the output embedding (not the input
    embedding, a lookup). d_attn = num_attention_heads * head_dim, S the sequence length, L the layers:
    QK^T and AV cost 2*S*d_attn multiply-adds each per token and layer, halved by the causal mask.
For Qwen3-30B-A3B shapes with 8 layers at S=4096 this gives about 5.4 GFLOP/token.
LoRA (a frozen base): the base matmuls cost forward + the input gradient only, 4 * N_active instead of 6; the
adapters' own FLOPs (about 2% at rank 16 on attention and experts of Qwen3-30B-A3B) are not counted.

Timing is per logging interval (``train.log_every`` steps, fewer for the last): the host synchronizes with the
device only at the interval's last step, so a row's ``step_time_s`` is the interval's wall time divided by its
``interval_steps``, and ``tokens_per_s``, ``tokens_per_s_per_gpu`` and ``tflops_per_gpu`` are averages over the
interval. Checkpoint saves and the logging itself are left out of the wall time. ``peak_mem_gib`` is the peak
over the interval. ``loss`` and ``grad_norm`` are those of the row's own step. With ``log_every=1`` every row is
one step, as before. A row of an evaluation step also has ``val_loss`` (mean cross-entropy over every validation
label token of all ranks) and ``val_ppl`` (its exp); the evaluation is left out of the row's wall time, not of
its ``peak_mem_gib`` (no_grad forwards: below a training step's peak).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time

import torch


def active_matmul_params(model) -> int:
    """Matmul parameters per token; a sharded (DTensor) weight reports its global shape."""
    from moe_tune.moe.layer import MoE

    total = 0
    for module in model.modules():
        if isinstance(module, MoE):
            s = module.spec
            per_expert = 3 * s.experts.dim * s.experts.hidden
            total += s.router.top_k * per_expert + s.router.num_experts * s.experts.dim
        elif isinstance(module, torch.nn.Linear) or type(module).__name__ == "Linear":  # torch or TE Linear
            total += module.weight.shape.numel()
    return total


def flops_per_token(model, seq_len: int, frozen_base: bool = False) -> float:
    c = model.config
    heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    if getattr(c, "v_head_dim", None):  # MLA: scores over qk (nope + rope) dims, values over v_head_dim
        d_attn = heads * ((c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim) / 2)
    else:
        d_attn = heads * head_dim
    per_param = 4.0 if frozen_base else 6.0
    return per_param * active_matmul_params(model) + 6.0 * c.num_hidden_layers * seq_len * d_attn


def peak_memory_gib(device: torch.device) -> tuple[float, float]:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30, torch.cuda.max_memory_reserved(device) / 2**30
    return 0.0, 0.0


def step_row(
    step: int,
    loss: float,
    grad_norm: float,
    lr: float,
    tokens: int,
    dt: float,
    world: int,
    flops_per_token: float,
    device: torch.device,
    **extra,
) -> dict:
    """One metrics.jsonl line (the fields README.md lists under Outputs, then ``extra``); ``dt``: seconds per step,
    averaged over the logging interval the row closes."""
    alloc, reserved = peak_memory_gib(device)
    tps = tokens / dt
    return {
        "step": step,
        "loss": loss,
        "lr": lr,
        "grad_norm": grad_norm,
        "tokens_per_s": tps,
        "tokens_per_s_per_gpu": tps / world,
        "tflops_per_gpu": tps / world * flops_per_token / 1e12,
        "peak_mem_gib": alloc,
        "peak_reserved_gib": reserved,
        "step_time_s": dt,
        **extra,
    }


class IntervalTimer:
    """Wall time of the steps of one logging interval, with one host sync where the interval's timing pauses.

    ``start`` (re)starts the clock, ``tick`` counts a step, ``pause`` waits for the device and adds the time
    since ``start``; the caller pauses around what is not training (metrics, checkpoint saves) and reads
    ``seconds_per_step`` at a logging step, then ``new_interval`` clears the counts and the peak memory."""

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds, self.steps = 0.0, 0
        self._t0: float | None = None

    def start(self) -> None:
        self._t0 = time.perf_counter()

    def tick(self) -> None:
        self.steps += 1

    def pause(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # host sync: the interval's queued work ends here
        if self._t0 is not None:
            self.seconds += time.perf_counter() - self._t0
        self._t0 = None

    def seconds_per_step(self) -> float:
        return self.seconds / max(self.steps, 1)

    def new_interval(self) -> None:
        self.seconds, self.steps = 0.0, 0
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)


def _row_step(line: str) -> float:
    """The step of a metrics.jsonl line; a torn last line (a crash mid-write) counts as after every step."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return math.inf


class MetricsWriter:
    """Rank 0 appends one JSON object per logged step; ``summary`` aggregates the rows whose interval started
    after the warm-up steps (``interval_steps``, 1 when absent)."""

    def __init__(self, output_dir: str, enabled: bool, warmup_steps: int):
        self.enabled, self.warmup = enabled, warmup_steps
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self.rows: list[dict] = []
        if enabled:
            os.makedirs(output_dir, exist_ok=True)

    def drop_after(self, step: int) -> None:
        """Before a run starts (or resumes) at ``step``: remove the rows of later steps, which a run that crashed
        after its last checkpoint logged and this one replays; rewritten atomically (a temporary file renamed), so
        metrics.jsonl never loses the rows it keeps. Rank 0 only (``enabled``)."""
        if not self.enabled or not os.path.isfile(self.path):
            return
        with open(self.path) as f:
            lines = f.readlines()
        kept = [line for line in lines if _row_step(line) <= step]
        if len(kept) == len(lines):
            return
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(line if line.endswith("\n") else line + "\n" for line in kept)
        os.replace(tmp, self.path)

    def log(self, row: dict) -> None:
        self.rows.append(row)
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")

    def summary(self) -> dict:
        timed = [r for r in self.rows if r["step"] - r.get("interval_steps", 1) >= self.warmup] or self.rows
        med = lambda k: statistics.median(r[k] for r in timed) if timed else 0.0  # noqa: E731
        return {
            "final_loss": self.rows[-1]["loss"] if self.rows else None,
            "first_loss": self.rows[0]["loss"] if self.rows else None,
            "tokens_per_s_per_gpu": med("tokens_per_s_per_gpu"),
            "tokens_per_s": med("tokens_per_s"),
            "tflops_per_gpu": med("tflops_per_gpu"),
            "peak_mem_gib": max((r["peak_mem_gib"] for r in self.rows), default=0.0),
            "peak_reserved_gib": max((r.get("peak_reserved_gib", 0.0) for r in self.rows), default=0.0),
            "steps_timed": len(timed),
            **self.validation_summary(),
        }

    def validation_summary(self) -> dict:
        """``final_val_loss``/``final_val_ppl`` (the last evaluation) and ``best_val_loss``/``best_val_step`` (the
        lowest, the earliest of equals); empty when no row was evaluated."""
        evaluated = [r for r in self.rows if "val_loss" in r]
        if not evaluated:
            return {}
        best = min(evaluated, key=lambda r: (math.isnan(r["val_loss"]), r["val_loss"]))
        last = evaluated[-1]
        return {
            "final_val_loss": last["val_loss"],
            "final_val_ppl": last["val_ppl"],
            "best_val_loss": best["val_loss"],
            "best_val_step": best["step"],
        }

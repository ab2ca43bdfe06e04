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

Timing is per step without a host sync per step: on a GPU a CUDA event is recorded on the compute stream as each
step's work is queued, and the device time between consecutive events (idle gaps included: it is the step's
share of the wall clock) is read at the next step where the host waits anyway (every ``train.log_every``-th,
checkpoint and last steps). So every optimizer step has its own row, written at those steps. Checkpoint saves,
evaluation and the logging itself are left out of the times (the clock restarts after them). ``peak_mem_gib`` is
the step's peak (the caching allocator's, read on the host as the step is queued); an evaluation step's row
also counts the evaluation's (no_grad forwards: below a training step's peak). A row of an evaluation step also
has ``val_loss`` (mean cross-entropy over every validation label token of all ranks) and ``val_ppl`` (its exp);
the row of a step where the host waits has the expert loads of that step's last micro-batch.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from array import array

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


def attention_width(c) -> float:
    """d_attn of a Hugging Face config: heads x head dim (MLA: scores over the qk (nope + rope) dims, values over
    v_head_dim, their mean)."""
    heads = c.num_attention_heads
    if getattr(c, "v_head_dim", None):
        return heads * ((c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim) / 2)
    return heads * (getattr(c, "head_dim", None) or c.hidden_size // heads)


def flops_per_token(model, seq_len: int, frozen_base: bool = False) -> float:
    c = model.config
    per_param = 4.0 if frozen_base else 6.0
    return per_param * active_matmul_params(model) + 6.0 * c.num_hidden_layers * seq_len * attention_width(c)


def peak_memory_gib(device: torch.device) -> tuple[float, float]:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30, torch.cuda.max_memory_reserved(device) / 2**30
    return 0.0, 0.0


def step_row(
    step: int,
    loss: float,
    grad_norm: float,
    lr: float,
    tokens: tuple[int, int, int],
    dt: float,
    world: int,
    flops_per_token: float,
    peak: tuple[float, float],
    **extra,
) -> dict:
    """One metrics.jsonl line (the fields docs/checkpoints-and-outputs.md lists, then ``extra``); ``tokens``: the step's
    (real tokens, label tokens, row positions) over all ranks; ``dt``: its seconds; ``peak``: its peak allocated
    and reserved GiB (``peak_memory_gib``). tokens_per_s counts real tokens, not padding; tflops_per_gpu counts
    every position, which the GPU computes padding or not."""
    real, label, positions = tokens
    return {
        "step": step,
        "loss": loss,
        "lr": lr,
        "grad_norm": grad_norm,
        "tokens_per_s": real / dt,
        "tokens_per_s_per_gpu": real / dt / world,
        "label_tokens_per_s": label / dt,
        "row_fill": real / positions,
        "tflops_per_gpu": positions / dt / world * flops_per_token / 1e12,
        "peak_mem_gib": peak[0],
        "peak_reserved_gib": peak[1],
        "step_time_s": dt,
        **extra,
    }


class StepTimer:
    """Each step's time and peak memory, with one host sync where timing pauses (not one per step).

    ``start`` begins timing (again, after what is not training: metrics, checkpoints, evaluation); ``tick``
    marks the end of a step's queued work (a CUDA event on the current stream; on a CPU, where work runs as it
    is queued, the host clock) and reads the step's peak memory; ``pause`` waits for the last mark and turns the
    marks since ``start`` into per-step seconds; ``take`` returns ``(seconds, peak)`` per step since the last
    ``take`` and forgets them."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self._marks: list = []
        self._peaks: list[tuple[float, float]] = []
        self._done: list[tuple[float, tuple[float, float]]] = []

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def start(self) -> None:
        self._marks = [self._mark()]
        self._reset_peak()

    def tick(self) -> None:
        self._marks.append(self._mark())
        self._peaks.append(peak_memory_gib(self.device))
        self._reset_peak()

    def pause(self) -> None:
        marks = self._marks
        if self.cuda:
            marks[-1].synchronize()  # host sync: the queued steps' work ends here
            seconds = [a.elapsed_time(b) / 1e3 for a, b in zip(marks, marks[1:])]
        else:
            seconds = [b - a for a, b in zip(marks, marks[1:])]
        self._done += zip(seconds, self._peaks)
        self._marks, self._peaks = [], []

    def take(self) -> list[tuple[float, tuple[float, float]]]:
        done, self._done = self._done, []
        return done


def _row(line: str) -> dict | None:
    """A metrics.jsonl line's row; None for a torn last line (a crash mid-write) or one without a step."""
    try:
        row = json.loads(line)
        return row if isinstance(row.get("step"), (int, float)) else None
    except (ValueError, AttributeError):
        return None


# What summary.json reads of every row, kept as doubles (8 bytes a value against about a kilobyte for a row's dict:
# a run of a million steps holds some 80 MB, not a gigabyte); the medians' keys, then the maxima's.
MEDIANS = ("tokens_per_s_per_gpu", "tokens_per_s", "label_tokens_per_s", "row_fill", "tflops_per_gpu")
MAXIMA = ("peak_mem_gib", "peak_reserved_gib")


class MetricsWriter:
    """Rank 0 appends one JSON object per step; ``summary`` aggregates the rows after the warm-up steps. Of each
    row only what the summary reads stays in memory (``MEDIANS``, ``MAXIMA``, step and loss; an evaluation's
    validation loss), so a week of steps costs megabytes."""

    def __init__(self, output_dir: str, enabled: bool, warmup_steps: int):
        self.enabled, self.warmup = enabled, warmup_steps
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self._clear()
        if enabled:
            os.makedirs(output_dir, exist_ok=True)

    def _clear(self) -> None:
        self.columns = {k: array("d") for k in ("step", "loss", *MEDIANS, *MAXIMA)}
        self.evaluated: list[dict] = []  # step, val_loss and val_ppl of each evaluation's row

    def drop_after(self, step: int) -> None:
        """Before a run starts (or resumes) at ``step``: remove the rows of later steps, which a run that crashed
        after its last checkpoint logged and this one replays; rewritten atomically (a temporary file renamed), so
        metrics.jsonl never loses the rows it keeps. The kept rows count in ``summary`` (the whole run's first
        loss and medians, not only the resumed part's). Read a line at a time. Rank 0 only (``enabled``)."""
        if not self.enabled or not os.path.isfile(self.path):
            return
        self._clear()
        tmp, dropped = self.path + ".tmp", False
        with open(self.path) as f, open(tmp, "w") as kept:
            for line in f:
                row = _row(line)
                if row is None or row["step"] > step:
                    dropped = True
                    continue
                self._keep(row)
                kept.write(line if line.endswith("\n") else line + "\n")
        if dropped:
            os.replace(tmp, self.path)
        else:
            os.remove(tmp)

    def log(self, row: dict) -> None:
        self._keep(row)
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")

    def _keep(self, row: dict) -> None:
        for k, values in self.columns.items():
            v = row.get(k)
            values.append(float(v) if isinstance(v, (int, float)) else math.nan)
        if "val_loss" in row:
            self.evaluated.append({k: row[k] for k in ("step", "val_loss", "val_ppl") if k in row})

    def summary(self) -> dict:
        c, n = self.columns, len(self.columns["step"])
        timed = [i for i in range(n) if c["step"][i] > self.warmup] or range(n)

        def med(k: str) -> float:
            values = [c[k][i] for i in timed if not math.isnan(c[k][i])]
            return statistics.median(values) if values else 0.0

        def top(k: str) -> float:
            return max((v for v in c[k] if not math.isnan(v)), default=0.0)

        return {
            "final_loss": c["loss"][-1] if n else None,
            "first_loss": c["loss"][0] if n else None,
            **{k: med(k) for k in MEDIANS},
            **{k: top(k) for k in MAXIMA},
            "steps_timed": len(timed),
            **self.validation_summary(),
        }

    def validation_summary(self) -> dict:
        """``final_val_loss``/``final_val_ppl`` (the last evaluation) and ``best_val_loss``/``best_val_step`` (the
        lowest, the earliest of equals); empty when no row was evaluated."""
        if not self.evaluated:
            return {}
        best = min(self.evaluated, key=lambda r: (math.isnan(r["val_loss"]), r["val_loss"]))
        last = self.evaluated[-1]
        return {
            "final_val_loss": last["val_loss"],
            "final_val_ppl": last["val_ppl"],
            "best_val_loss": best["val_loss"],
            "best_val_step": best["step"],
        }

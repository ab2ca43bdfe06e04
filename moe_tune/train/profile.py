"""``train.profile=true``: torch.profiler on rank 0 over steps 7-9 of the run (``profiled_steps``: numbered as the
log and metrics.jsonl number them, and the trace's ProfilerStep#N with them; a resumed run's from its checkpoint's
step: 107-109 after step 100). Writes to the run directory: ``profile_rank0.txt`` (a step summary, then the top ops
by device time, by CPU time without a GPU), ``profile_rank0.json`` (the summary; null without GPU kernels) and a
Chrome trace ``trace_rank0.json``. The step after the traced ones also pays for writing them (its tokens/s reads
low).

The summary answers "is the GPU idle, and is communication exposed?" per traced step: the wall time, the time
any kernel runs (the union over streams), the communication kernels' time (NCCL, NVSHMEM, DeepEP) and the part
of it no compute kernel runs beside (exposed), the kernel launches and the host syncs.
"""

from __future__ import annotations

import json
import logging
import os
import re

import torch

from moe_tune.config.schema import PROFILE_WAIT, PROFILE_WARMUP, profiled_steps

log = logging.getLogger("moe_tune")

COMM_KERNEL = re.compile(r"nccl|nvshmem|deep_ep|all_to_all|alltoall", re.IGNORECASE)
# CUDA runtime calls that block the host until the device is done (cudaMemcpy: the synchronous copy only).
SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


class NoProfiler:
    """What the loop calls when nothing is profiled."""

    def step(self) -> None:
        pass

    def stop(self) -> None:
        pass


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _minus(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of the union ``a`` outside the union ``b`` (both sorted, disjoint)."""
    outside, j = 0.0, 0
    for start, end in a:
        cursor = start
        while j < len(b) and b[j][1] <= cursor:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            outside += max(0.0, min(b[k][0], end) - cursor)
            cursor = max(cursor, b[k][1])
            k += 1
        outside += max(0.0, end - cursor)
    return outside


def timeline_summary(
    kernels: list[tuple[str, float, float]], wall: tuple[float, float], steps: int, host_syncs: int
) -> dict:
    """Per-step figures from device kernels ``(name, start_us, end_us)`` over ``steps`` steps spanning ``wall``
    (start_us, end_us). Communication kernels are those named like NCCL's, NVSHMEM's or DeepEP's."""
    comm = _union([(s, e) for n, s, e in kernels if COMM_KERNEL.search(n)])
    compute = _union([(s, e) for n, s, e in kernels if not COMM_KERNEL.search(n)])
    busy = _union(comm + compute)
    wall_us = max(wall[1] - wall[0], 1e-9)
    per_step = 1e3 * steps  # us over all steps -> ms per step
    return {
        "steps": steps,
        "wall_ms_per_step": round(wall_us / per_step, 2),
        "gpu_busy_ms_per_step": round(_length(busy) / per_step, 2),
        "gpu_busy_fraction": round(_length(busy) / wall_us, 3),
        "compute_ms_per_step": round(_length(compute) / per_step, 2),
        "communication_ms_per_step": round(_length(comm) / per_step, 2),
        "exposed_communication_ms_per_step": round(_minus(comm, compute) / per_step, 2),
        "kernels_per_step": round(len(kernels) / steps),
        "host_syncs_per_step": round(host_syncs / steps, 1),
    }


DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")  # Chrome-trace categories of device work (not annotations)


def summarize_trace(path: str) -> dict | None:
    """``timeline_summary`` of a Chrome trace written by torch.profiler (None without device work or steps).
    Steps are the ``ProfilerStep#N`` annotations; host syncs the CUDA runtime calls that wait for the device."""
    with open(path) as f:
        events = json.load(f).get("traceEvents", [])
    kernels, steps, syncs = [], [], 0
    for e in events:
        if e.get("ph") != "X":
            continue
        cat, name, start = e.get("cat", ""), e.get("name", ""), float(e.get("ts", 0))
        end = start + float(e.get("dur", 0))
        if cat in DEVICE_WORK:
            kernels.append((name, start, end))
        elif cat == "user_annotation" and name.startswith("ProfilerStep#"):
            steps.append((start, end))
        elif cat == "cuda_runtime" and name in SYNC_EVENTS:
            syncs += 1
    if not kernels or not steps:
        return None
    wall = (min(s for s, _ in steps), max(max(e for _, e in steps), max(e for _, _, e in kernels)))
    return timeline_summary(kernels, wall, len(steps), syncs)


def build_profiler(enabled: bool, rank: int, output_dir: str, start_step: int = 0, steps: int | None = None):
    """A started profiler (``step()`` after each optimizer step, ``stop()`` at the end) on rank 0 when
    ``enabled``, else a ``NoProfiler``. ``start_step``: the step the run starts after (a resumed checkpoint's);
    ``steps``: the step it ends at (train.steps), for the start's note of what is traced."""
    if not enabled or rank != 0:
        return NoProfiler()
    from torch.profiler import ProfilerAction, ProfilerActivity, profile

    traced = profiled_steps(start_step)
    first, last = traced[0], traced[-1]
    if steps is not None and steps < last:  # a resumed run that ends before: the request changes nothing
        log.info(
            f"note: train.profile=true traces steps {first}-{last} of a run resumed after step {start_step}, and this "
            f"one ends at step {steps}: nothing is traced; set train.steps={last} or more"
        )
        return NoProfiler()
    log.info(
        f"train.profile=true: rank 0 traces steps {first}-{last} (ProfilerStep#{first}-{last} in trace_rank0.json), "
        f"after {PROFILE_WAIT} untraced steps and {PROFILE_WARMUP} that warms the profiler up"
    )

    def action(step: int) -> ProfilerAction:
        """What the profiler does while ``step`` (numbered as the log numbers it) runs."""
        if step in traced:
            return ProfilerAction.RECORD_AND_SAVE if step == last else ProfilerAction.RECORD
        return ProfilerAction.WARMUP if first - PROFILE_WARMUP <= step < first else ProfilerAction.NONE

    def on_ready(prof) -> None:
        key = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=key, row_limit=40, max_name_column_width=60)
        os.makedirs(output_dir, exist_ok=True)
        trace = os.path.join(output_dir, "trace_rank0.json")
        prof.export_chrome_trace(trace)
        summary = summarize_trace(trace)
        with open(os.path.join(output_dir, "profile_rank0.txt"), "w") as f:
            if summary is not None:
                f.write("".join(f"{k}: {v}\n" for k, v in summary.items()) + "\n")
            f.write(table)
        with open(os.path.join(output_dir, "profile_rank0.json"), "w") as f:
            json.dump(summary, f, indent=2)

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    prof = profile(activities=activities, schedule=action, on_trace_ready=on_ready)
    # torch.profiler numbers the steps it sees from 0 (ProfilerStep#0 the first) and asks the schedule with that
    # number: counting from the run's first step instead, the schedule and the trace use the log's numbers.
    prof.step_num = start_step + 1
    prof.start()
    return prof


__all__ = ["NoProfiler", "build_profiler", "summarize_trace", "timeline_summary"]

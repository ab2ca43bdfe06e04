"""``train.profile=true``: torch.profiler over steps 6-8 (counted from 0; the run needs at least 9 steps) on rank
0. Writes to the run directory: ``profile_rank0.txt`` (a step summary, then the top ops by device time, by CPU
time without a GPU), ``profile_rank0.json`` (the summary; null without GPU kernels) and a Chrome trace
``trace_rank0.json``. The step after the traced ones also pays for writing them (its tokens/s reads low).

The summary answers "is the GPU idle, and is communication exposed?" per traced step: the wall time, the time
any kernel runs (the union over streams), the communication kernels' time (NCCL, NVSHMEM, DeepEP) and the part
of it no compute kernel runs beside (exposed), the kernel launches and the host syncs.
"""

from __future__ import annotations

import json
import os
import re

import torch

from moe_tune.config.schema import PROFILE_ACTIVE, PROFILE_WAIT, PROFILE_WARMUP

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


def build_profiler(enabled: bool, rank: int, output_dir: str):
    """A started profiler (``step()`` after each optimizer step, ``stop()`` at the end) on rank 0 when
    ``enabled``, else a ``NoProfiler``."""
    if not enabled or rank != 0:
        return NoProfiler()
    from torch.profiler import ProfilerActivity, profile, schedule

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
    prof = profile(
        activities=activities,
        schedule=schedule(wait=PROFILE_WAIT, warmup=PROFILE_WARMUP, active=PROFILE_ACTIVE, repeat=1),
        on_trace_ready=on_ready,
    )
    prof.start()
    return prof


__all__ = ["NoProfiler", "build_profiler", "summarize_trace", "timeline_summary"]

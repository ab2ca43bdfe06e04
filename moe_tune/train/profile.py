"""``train.profile=true``: torch.profiler over steps 6-8 on rank 0; writes the top kernels by device time to
``profile_rank0.txt`` and a Chrome trace to ``trace_rank0.json`` in the run directory."""

from __future__ import annotations

import os

import torch

WAIT, WARMUP, ACTIVE = 5, 1, 3  # steps counted from 0: 0-4 untraced, 5 warms the profiler up, 6-8 traced


class NoProfiler:
    """What the loop calls when nothing is profiled."""

    def step(self) -> None:
        pass

    def stop(self) -> None:
        pass


def build_profiler(enabled: bool, rank: int, output_dir: str):
    """A started profiler (``step()`` after each optimizer step, ``stop()`` at the end) on rank 0 when
    ``enabled``, else a ``NoProfiler``."""
    if not enabled or rank != 0:
        return NoProfiler()
    from torch.profiler import ProfilerActivity, profile, schedule

    def on_ready(prof) -> None:
        table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=40, max_name_column_width=60)
        os.makedirs(output_dir, exist_ok=True)
        with open(os.path.join(output_dir, "profile_rank0.txt"), "w") as f:
            f.write(table)
        prof.export_chrome_trace(os.path.join(output_dir, "trace_rank0.json"))

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    prof = profile(
        activities=activities,
        schedule=schedule(wait=WAIT, warmup=WARMUP, active=ACTIVE, repeat=1),
        on_trace_ready=on_ready,
    )
    prof.start()
    return prof


__all__ = ["NoProfiler", "build_profiler"]

"""Profile a few training steps with torch.profiler and summarise where the device time goes.

Used by the benchmark scripts beside it: ``profile_steps(step, sync, path)`` runs ``step`` twice under the
profiler, writes the top-25 tables (by self device time and by total device time) to ``path`` and returns
a per-step summary: device time by category, the top aten ops, kernel launches and host syncs.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

# Categories by aten op name; an op's *self* device time is the kernels it launched itself, so no double count.
CATEGORIES = [
    ("expert grouped GEMM", r"grouped_mm"),
    ("attention (SDPA)", r"flash|efficient_attention|cudnn_attention|scaled_dot_product"),
    ("dense GEMM", r"^aten::(mm|addmm|bmm|baddbmm)$"),
    ("gather/scatter/sort", r"index|gather|scatter|sort|topk|embedding|histc|cumsum|repeat_interleave|nonzero"),
    ("optimizer", r"fused_adam|_foreach"),
    ("copy/cast", r"copy_|_to_copy|clone|contiguous|^aten::cat$|fill_|zero_"),
]
OTHER = "other elementwise/reduction"
SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def _self_device_us(evt) -> float:
    for name in ("self_device_time_total", "self_cuda_time_total"):
        if hasattr(evt, name):
            return float(getattr(evt, name))
    return 0.0


def _tables(avgs, title: str) -> str:
    parts = []
    for key in ("self_device_time_total", "device_time_total"):
        try:
            table = avgs.table(sort_by=key, row_limit=25, max_name_column_width=90)
        except Exception:  # older names
            table = avgs.table(sort_by=key.replace("device", "cuda"), row_limit=25, max_name_column_width=90)
        parts.append(f"# {title}, top 25 by {key}\n{table}")
    return "\n\n".join(parts)


def profile_steps(step, sync, path: Path, cuda: bool = True, steps: int = 2) -> dict:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        wall_ms = (time.perf_counter() - t0) * 1e3 / steps
    avgs = prof.key_averages()
    Path(path).write_text(_tables(avgs, f"{Path(path).stem}: {steps} training steps"))
    cats = {name: 0.0 for name, _ in CATEGORIES} | {OTHER: 0.0}
    ops: dict[str, list] = {}
    kernels = syncs = 0
    for e in avgs:
        if not str(getattr(e, "device_type", "")).endswith("CPU"):
            kernels += e.count  # kernels, memcpys and memsets on the device
            continue
        if e.key in SYNC_EVENTS:
            syncs += e.count
        if not e.key.startswith("aten::"):
            continue
        ms = _self_device_us(e) / 1e3 / steps
        cats[next((n for n, pat in CATEGORIES if re.search(pat, e.key)), OTHER)] += ms
        ops[e.key] = [round(ms, 3), e.count // steps]
    busy = sum(cats.values())
    top = dict(sorted(ops.items(), key=lambda kv: -kv[1][0])[:20])
    return {
        "wall_ms_per_step_under_profiler": round(wall_ms, 2),
        "device_ms_per_step_total": round(busy, 2),
        "device_busy_fraction": round(busy / wall_ms, 3) if wall_ms else None,
        "device_ms_per_step_by_category": {k: round(v, 2) for k, v in cats.items()},
        "top_aten_ops_ms_and_calls_per_step": top,
        "kernel_launches_per_step": kernels // steps,
        "host_syncs_per_step": syncs / steps,
    }

"""The step summary of any torch.profiler Chrome trace (moe_tune's ``trace_rank0.json``, or a peer's):

    python benchmarks/trace_summary.py [--gaps N] TRACE.json [TRACE.json ...]

Prints, per file, the JSON of ``moe_tune.train.profile.summarize_trace``: wall time per step, GPU busy, the
communication kernels' time and its exposed part, kernel launches and host syncs per step. Exit 2 with one line
for a file that is not such a trace, or one without GPU kernels or ``ProfilerStep#`` steps (a CPU-only run).

``--gaps N`` adds where the GPU sat idle inside the traced steps, and why: for each idle interval of at least
``--min-gap-us``, the kernel after it and when the host launched that kernel (its runtime call, matched by the
trace's correlation id). Launched after the GPU went idle, the host was late, and the innermost host op around the
launch names what it was doing (a Python-heavy op, a host sync before it); launched before, the kernel waited on
something else (another stream, an event). Totals by cause and by host op, then the N longest gaps.
"""

from __future__ import annotations

import argparse
import json
import sys

from moe_tune.train.profile import DEVICE_WORK, summarize_trace


def _events(path: str) -> list[dict]:
    with open(path) as f:
        return [e for e in json.load(f).get("traceEvents", []) if e.get("ph") == "X"]


def _span(e: dict) -> tuple[float, float]:
    start = float(e.get("ts", 0))
    return start, start + float(e.get("dur", 0))


def _innermost_op(ops: list[dict], tid, t: float) -> str:
    """The shortest host op on thread ``tid`` running at time ``t`` (the innermost one), or "(none)"."""
    around = [e for e in ops if e.get("tid") == tid and _span(e)[0] <= t <= _span(e)[1]]
    return min(around, key=lambda e: float(e.get("dur", 0)))["name"] if around else "(none)"


def idle_gaps(path: str, min_gap_us: float = 20.0) -> list[dict]:
    """The GPU's idle intervals inside the traced steps of at least ``min_gap_us``, longest first: ``start_us``,
    ``us``, ``before`` and ``after`` (the kernels around it), ``host_late`` (the next kernel launched after the GPU
    went idle) and ``host_op`` (the innermost host op around that launch)."""
    events = _events(path)
    steps = [_span(e) for e in events if e.get("cat") == "user_annotation" and e["name"].startswith("ProfilerStep#")]
    kernels = sorted((e for e in events if e.get("cat") in DEVICE_WORK), key=lambda e: _span(e)[0])
    launches = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})
    }
    ops = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation", "python_function")]
    gaps, busy_until, before = [], None, None
    for k in kernels:
        start, end = _span(k)
        inside = any(a <= start <= b for a, b in steps)
        if busy_until is not None and start - busy_until >= min_gap_us and inside:
            launch = launches.get(k.get("args", {}).get("correlation"))
            late = launch is not None and _span(launch)[0] > busy_until
            gaps.append(
                {
                    "start_us": busy_until,
                    "us": start - busy_until,
                    "before": before,
                    "after": k["name"],
                    "host_late": late,
                    "host_op": _innermost_op(ops, launch.get("tid"), _span(launch)[0]) if launch else "(no launch)",
                }
            )
        if busy_until is None or end > busy_until:
            busy_until, before = end, k["name"]
    return sorted(gaps, key=lambda g: -g["us"])


def gaps_report(path: str, top: int, min_gap_us: float = 20.0) -> dict:
    """``idle_gaps`` summed by cause and by host op (ms), with the ``top`` longest."""
    gaps = idle_gaps(path, min_gap_us)
    by_op: dict[str, float] = {}
    for g in gaps:
        if g["host_late"]:
            by_op[g["host_op"]] = by_op.get(g["host_op"], 0.0) + g["us"] / 1e3
    return {
        "idle_ms_host_late": round(sum(g["us"] for g in gaps if g["host_late"]) / 1e3, 3),
        "idle_ms_waiting_otherwise": round(sum(g["us"] for g in gaps if not g["host_late"]) / 1e3, 3),
        "host_late_ms_by_op": {k: round(v, 3) for k, v in sorted(by_op.items(), key=lambda kv: -kv[1])[:top]},
        "longest": [{**g, "us": round(g["us"], 1)} for g in gaps[:top]],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+", help="Chrome trace files written by torch.profiler")
    parser.add_argument("--gaps", type=int, default=0, help="also list the N longest idle gaps and their causes")
    parser.add_argument("--min-gap-us", type=float, default=20.0, help="the shortest idle interval counted")
    args = parser.parse_args(argv)
    for path in args.traces:
        try:
            summary = summarize_trace(path)
        except (OSError, ValueError, AttributeError) as e:  # unreadable, not JSON, or JSON of another shape
            print(
                f"trace_summary: error: {path} is not a readable Chrome trace ({type(e).__name__}: {e})",
                file=sys.stderr,
            )
            return 2
        if summary is None:
            print(
                f"trace_summary: error: {path} has no GPU kernels or no ProfilerStep# steps (a CPU-only run, or "
                "not a training trace); nothing to summarise",
                file=sys.stderr,
            )
            return 2
        if args.gaps:
            summary["gaps"] = gaps_report(path, args.gaps, args.min_gap_us)
        print(json.dumps({"trace": path, **summary}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

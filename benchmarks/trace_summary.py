"""The step summary of any torch.profiler Chrome trace (moe_tune's ``trace_rank0.json``, or a peer's):

    python benchmarks/trace_summary.py TRACE.json [TRACE.json ...]

Prints, per file, the JSON of ``moe_tune.train.profile.summarize_trace``: wall time per step, GPU busy, the
communication kernels' time and its exposed part, kernel launches and host syncs per step. Exit 2 with one line
for a file that is not such a trace, or one without GPU kernels or ``ProfilerStep#`` steps (a CPU-only run).
"""

from __future__ import annotations

import argparse
import json
import sys

from moe_tune.train.profile import summarize_trace


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+", help="Chrome trace files written by torch.profiler")
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
        print(json.dumps({"trace": path, **summary}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

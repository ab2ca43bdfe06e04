"""``moe-tune-env``: what this machine has, and which backends actually work here.

Prints versions, the GPUs and how they are linked, then one line per backend (grouped_mm, deepep,
symm_mem/NVSHMEM, transformer_engine, fp8 modes) found by *running* a tiny call of it (``backends.probe``),
with the reason when it does not work. ``--json`` prints the same as one JSON object. Always exits 0: an
unusable backend is a finding, not an error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from moe_tune.cli import described, quiet_on_closed_pipe
from moe_tune.env.backends import BACKENDS, probe
from moe_tune.env.report import LABELS, collect, gpus, versions


def _print_header(report: dict) -> None:
    v = report["versions"]
    print("versions")
    for key, value in v.items():
        print(f"  {key:<18} {value}")
    g = report["gpus"]
    print(f"GPUs: {g['count']}")
    for d in g["devices"]:
        print(
            f"  GPU{d['index']}  {d['name']}  {d['memory_gib']} GiB  sm{d['compute_capability'].replace('.', '')}  {d['sms']} SMs"
        )
    if g["count"] > 1:
        print(f"links ({g['links_source']}):")
        for link in g["links"]:
            print(f"  GPU{link['a']} <-> GPU{link['b']}  {link['link']}")
    elif g["count"] == 1:
        print("links: single GPU, none to report")
    sys.stdout.flush()


def _print_backend(row: dict) -> None:
    status = "ok" if row["ok"] else "unavailable"
    print(f"  {LABELS.get(row['backend'], row['backend']):<20} {status:<12} {row['detail']}", flush=True)


@quiet_on_closed_pipe
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="moe-tune-env", description=described(__doc__.splitlines()[0]))
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    args = parser.parse_args(argv)
    os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    if args.json:
        print(json.dumps(collect(), indent=2))
        return 0
    # Text: print what is known before the (slower) probes run, so a hang still shows the versions.
    report = {"versions": versions(), "gpus": gpus()}
    _print_header(report)
    print("backends (each found by running a tiny call of it):")
    for name in BACKENDS:
        ok, detail = probe(name)
        _print_backend({"backend": name, "ok": ok, "detail": detail})
    return 0

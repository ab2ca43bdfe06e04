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
import platform
import re
import shutil
import subprocess
import sys
from importlib import metadata

from moe_tune.env.backends import BACKENDS, probe

_PACKAGES = {
    "moe_tune": ("moe_tune", "moe-tune"),  # a wheel install has no git commit: its version says what ran
    "transformers": ("transformers",),
    "hydra": ("hydra-core",),
    "omegaconf": ("omegaconf",),
    "triton": ("triton",),
    "TransformerEngine": (
        "transformer-engine",
        "transformer_engine",
        "transformer-engine-cu13",
        "transformer-engine-cu12",
    ),
    "DeepEP": ("deep_ep", "deep-ep"),
}
_LABELS = {"symm_mem": "symm_mem (NVSHMEM)"}


def _dist_version(names: tuple[str, ...]) -> str:
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return "not installed"


def _run(cmd: list[str], timeout: float = 20) -> str | None:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return p.stdout if p.returncode == 0 else None


def versions() -> dict[str, str]:
    import torch

    v = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "CUDA": torch.version.cuda or "none (CPU build)",
    }
    try:
        v["NCCL"] = ".".join(str(x) for x in torch.cuda.nccl.version()) if torch.cuda.is_available() else "n/a (no GPU)"
    except Exception:  # CPU builds have no NCCL
        v["NCCL"] = "not built in"
    for label, names in _PACKAGES.items():
        v[label] = _dist_version(names)
    driver = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    v["driver"] = driver.splitlines()[0].strip() if driver else "n/a"
    return v


def parse_topo(text: str) -> list[dict]:
    """Pairs of GPUs and their link from ``nvidia-smi topo -m`` (e.g. NV18 = 18 NVLinks, PIX/PXB/PHB/NODE/SYS
    = PCIe paths of growing distance)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)
    lines = [ln for ln in text.splitlines() if ln.strip()]
    # The header is the first line that starts with a GPU name; rows follow it and start with their own.
    start = next((n for n, ln in enumerate(lines) if re.match(r"\s*GPU\d+\s", ln)), None)
    if start is None:
        return []
    header = lines[start].split()
    gpu_cols = [i for i, name in enumerate(header) if re.fullmatch(r"GPU\d+", name)]
    pairs = []
    for ln in lines[start + 1 :]:
        cells = ln.split()
        if not cells or not re.fullmatch(r"GPU\d+", cells[0]):
            continue
        a = int(cells[0][3:])
        for i in gpu_cols:
            if i + 1 < len(cells):
                b = int(header[i][3:])
                if b > a:
                    pairs.append({"a": a, "b": b, "link": cells[i + 1]})
    return pairs


def gpus() -> dict:
    import torch

    if not torch.cuda.is_available():
        return {"count": 0, "devices": [], "links": [], "links_source": "none"}
    devices = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        devices.append(
            {
                "index": i,
                "name": p.name,
                "memory_gib": round(p.total_memory / 2**30, 1),
                "compute_capability": f"{p.major}.{p.minor}",
                "sms": p.multi_processor_count,
            }
        )
    links, source = [], "single GPU"
    if len(devices) > 1:
        topo = _run(["nvidia-smi", "topo", "-m"])
        links = parse_topo(topo) if topo else []
        source = "nvidia-smi topo -m"
        if not links:
            source = "torch.cuda.can_device_access_peer"
            for a in range(len(devices)):
                for b in range(a + 1, len(devices)):
                    peer = torch.cuda.can_device_access_peer(a, b)
                    links.append({"a": a, "b": b, "link": "P2P" if peer else "no P2P"})
    return {"count": len(devices), "devices": devices, "links": links, "links_source": source}


def collect() -> dict:
    report = {"versions": versions(), "gpus": gpus(), "backends": []}
    for name in BACKENDS:
        ok, detail = probe(name)
        report["backends"].append({"backend": name, "ok": ok, "detail": detail})
    return report


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
    print(f"  {_LABELS.get(row['backend'], row['backend']):<20} {status:<12} {row['detail']}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="moe-tune-env", description=__doc__.splitlines()[0])
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

"""What ``moe-tune-env`` reports (``moe_tune.cli.env``): ``versions()``, ``gpus()`` and ``collect()``, the whole report
with every backend probed."""

from __future__ import annotations

import platform
import re
import shutil
import subprocess
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
LABELS = {"symm_mem": "symm_mem (NVSHMEM)"}


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

"""Rank, local rank and world size from the launcher, and the one ``init_distributed`` every entry point calls.

Launchers, in order of precedence:
  - torchrun (also one torchrun per node under ``srun``): ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``.
  - ``srun python -m moe_tune`` without torchrun: ``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_NTASKS``; the
    rendezvous host is the first node of ``SLURM_JOB_NODELIST`` unless ``MASTER_ADDR`` is set.
  - neither: one process, rank 0 of 1.
A process group is created in every case (world size 1 included), so one code path serves 1..N ranks.
"""

from __future__ import annotations

import os
import re
import subprocess
from datetime import timedelta

import torch
import torch.distributed as dist

from moe_tune.distributed.env import DistEnv, dist_env

DEFAULT_PORT = 29500
# Default groups this process has made over the launcher's store. torchrun's store outlives a group, and one made
# again (the next job of a ``-m`` sweep) would take the same keys: a rank reading the previous job's addresses
# before its peer wrote new ones connects to a closed port and hangs or fails. Each group after the first keys its
# rendezvous (and every group made under it) by its number; every rank runs the same jobs, so the numbers agree.
_groups_made = 0


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def first_slurm_host(nodelist: str) -> str:
    """First host of a Slurm node list (``node[003-005,010],gpu7`` -> ``node003``), without calling scontrol."""
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist)
    if m is None:
        raise ValueError(f"cannot parse SLURM_JOB_NODELIST={nodelist!r}; set MASTER_ADDR")
    prefix, ranges = m.group(1), m.group(2)
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def _slurm_master_addr() -> str:
    nodelist = os.environ.get("SLURM_JOB_NODELIST", os.environ.get("SLURM_NODELIST", ""))
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
        return out.stdout.split()[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        return first_slurm_host(nodelist)


def init_distributed(backend: str | None = None, timeout_s: float = 1800.0) -> DistEnv:
    """Create the default process group (nccl with CUDA, else gloo) and select this rank's GPU.

    Idempotent: if a group exists already, returns the environment unchanged."""
    env = dist_env()
    if dist.is_initialized():
        return env
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    device_id = None
    if torch.cuda.is_available():
        # Modulo: a Slurm task bound to one GPU (CUDA_VISIBLE_DEVICES set per task) sees it as device 0.
        local = torch.device("cuda", env.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(local)
        # Only nccl's group is bound to the GPU; a gloo group asked for explicitly stays a CPU group.
        device_id = local if backend == "nccl" else None
    timeout = timedelta(seconds=timeout_s)
    if env.launcher == "single" and "MASTER_ADDR" not in os.environ:
        # One process: an in-memory store, so no port is needed and nothing can collide.
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout, device_id=device_id
        )
        return env
    if env.launcher == "slurm":
        os.environ.setdefault("MASTER_ADDR", _slurm_master_addr())
    os.environ.setdefault("MASTER_PORT", str(DEFAULT_PORT))
    global _groups_made
    store, rank, world_size = next(dist.rendezvous("env://", env.rank, env.world_size, timeout=timeout))
    store.set_timeout(timeout)
    # torch's own prefix for a store it makes, then this group's number (none for the first: torch's keys).
    prefix = "default_pg" + (f"/{_groups_made}" if _groups_made else "")
    store = dist.PrefixStore(prefix, store)
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, timeout=timeout, device_id=device_id
    )
    _groups_made += 1
    return env


def rank_world() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()

"""Whether a model built on the meta device can be materialized in this machine's memory, asked before it is: a
run on the CPU (no GPU visible) of a model larger than the host's memory would otherwise fill it tensor by tensor
and be killed by the kernel minutes later (exit 137), with nothing said.

The bytes counted are a floor, so a refusal is never wrong: the rank's own parameters and buffers as built (its
experts only under expert parallelism; a quantized base's codes and scales), and for training each trained
parameter's gradient and AdamW's two moments at its size. Activations, the data and the allocator's slack come on
top. The memory available is the kernel's ``MemAvailable``, capped by the cgroup's limit (a container's), shared
evenly by the ranks on this node.
"""

from __future__ import annotations

import os

import torch

from moe_tune.config import ConfigError
from moe_tune.distributed.shard import local_bytes

GIB = 2**30
_CGROUP_FILES = (
    ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),  # cgroup v2
    ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),  # v1
)


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def available_bytes() -> int | None:
    """Memory this machine can still give (None: unknown, not Linux)."""
    free = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    free = int(line.split()[1]) * 1024
    except OSError:
        return None
    for limit_path, usage_path in _CGROUP_FILES:
        limit, usage = _read_int(limit_path), _read_int(usage_path)
        if limit is not None and usage is not None and limit < 2**60:
            free = limit - usage if free is None else min(free, limit - usage)
    return free


def local_ranks() -> int:
    """Processes of this run on this node (torchrun's LOCAL_WORLD_SIZE, Slurm's tasks per node), 1 if unknown."""
    for key in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        value = os.environ.get(key, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1


def needed_bytes(model: torch.nn.Module, training: bool) -> tuple[int, int]:
    """(the rank's parameters and buffers, the trained parameters' gradients and AdamW moments when ``training``)."""
    weights = sum(local_bytes(t) for t in [*model.parameters(), *model.buffers()])
    trained = sum(local_bytes(p) for p in model.parameters() if p.requires_grad) if training else 0
    return weights, 3 * trained


# '++' adds the key or replaces it: some presets set num_hidden_layers in model.overrides (a plain key then works,
# '+' fails), others leave it out ('+' then works, a plain key fails).
FEWER_LAYERS = "++model.overrides.num_hidden_layers=2"


def check_fits_host(model: torch.nn.Module, training: bool) -> None:
    """ConfigError when the floor of what ``model`` needs on the CPU is more than this rank's share of the memory
    available."""
    free = available_bytes()
    if free is None:
        return
    share = free // local_ranks()
    weights, states = needed_bytes(model, training)
    if weights + states <= share:
        return
    states_text = f" + {states / GIB:.1f} GiB of gradients and AdamW moments" if training else ""
    raise ConfigError(
        f"the model needs at least {(weights + states) / GIB:.1f} GiB of host memory on the CPU "
        f"({weights / GIB:.1f} GiB of weights{states_text}; no GPU is visible), and this process has "
        f"{share / GIB:.1f} GiB available: run where a GPU is visible (moe-tune-env says what torch sees), or "
        f"train a smaller model (e.g. {FEWER_LAYERS} for a built-in one, or a smaller model.path)"
    )

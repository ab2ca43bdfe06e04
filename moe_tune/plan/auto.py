"""``auto`` for ``parallel.ep``, ``parallel.activation_checkpointing`` and ``train.micro_batch_size`` on
``moe-tune``'s command line: the planner's search over those keys (the others as given) for the world size the
launcher gives and this machine's GPU memory, before anything is composed or written; the fastest layout that fits
takes their place, said in one line. Every rank decides alike (the same inputs, no randomness).
"""

from __future__ import annotations

import sys

from moe_tune.config import ConfigError
from moe_tune.config.overrides import AUTO_KEYS
from moe_tune.distributed.env import dist_env


def auto_keys(overrides: list[str]) -> list[str]:
    return [
        o.split("=", 1)[0]
        for o in overrides
        if "=" in o and o.split("=", 1)[1] == "auto" and o.split("=", 1)[0] in AUTO_KEYS
    ]


def world_size() -> int:
    """The world size the run's process group will have (torchrun's WORLD_SIZE, Slurm's SLURM_NTASKS for an srun
    task), read as the run reads it: 1 for a lone process, in an allocation's shell (SLURM_NTASKS alone) too."""
    return dist_env().world_size


def gpu_memory_gib() -> float | None:
    """This rank's GPU's memory, or None without one (then the planner's default GPU)."""
    import torch

    if not torch.cuda.is_available():
        return None
    local = dist_env().local_rank % torch.cuda.device_count()
    return torch.cuda.get_device_properties(local).total_memory / 2**30


def host_memory_gib() -> float | None:
    """This rank's share of the host memory available (what a run on the CPU checks before it builds the model,
    ``moe_tune.models.host_memory``), or None where it cannot be read."""
    from moe_tune.models.host_memory import available_bytes, local_ranks

    free = available_bytes()
    return None if free is None else free / local_ranks() / 2**30


def memory_budget() -> tuple[float, str]:
    """(GiB per rank to plan against, what they are when not this GPU's, for the auto line): this GPU's memory;
    without a GPU the run trains on the CPU, so its process's share of the host memory available; the planner's
    default GPU only where neither can be read."""
    from moe_tune.plan import DEFAULT_GPU_MEM_GIB

    gpu = gpu_memory_gib()
    if gpu is not None:
        return gpu, ""
    host = host_memory_gib()
    if host is not None:
        return host, " of host memory, this process's share (no GPU visible: the run trains on the CPU)"
    return DEFAULT_GPU_MEM_GIB, " (an H200's: no GPU visible and the host's memory unreadable)"


def resolve(overrides: list[str], multirun: bool = False) -> list[str]:
    """``overrides`` with every ``<key>=auto`` of ``AUTO_KEYS`` replaced by the planner's choice (ConfigError when
    no layout fits, naming the smallest need)."""
    keys = auto_keys(overrides)
    if not keys:
        return overrides
    if multirun:
        raise ConfigError(
            f"{'/'.join(k + '=auto' for k in keys)}: a sweep's launcher picks the world size per job, so auto cannot "
            "be planned here; run moe-tune-plan --search for the layout and give its values"
        )
    from moe_tune.config.overrides import check, to_config
    from moe_tune.plan import search

    given = [o for o in overrides if o.split("=", 1)[0] not in keys]
    cfg = to_config(check(given))
    gpus, (memory, of_what) = world_size(), memory_budget()
    fitting, rejected = search(cfg, gpus, memory, vary=tuple(keys))
    if not fitting:
        why = rejected[0][1] if rejected else "no layout to try"
        raise ConfigError(
            f"{', '.join(k + '=auto' for k in keys)}: no layout of {gpus} {'process(es)' if of_what else 'GPU(s)'} of "
            f"{memory:.0f} GiB{of_what} fits "
            f"(the first tried: {why}); use more GPUs, peft=lora, or a shorter train.seq_len"
        )
    best = fitting[0]
    chosen = {
        "parallel.ep": best.census.dims.ep,
        "parallel.activation_checkpointing": best.config.parallel.activation_checkpointing,
        "train.micro_batch_size": best.config.train.micro_batch_size,
    }
    picked = [f"{k}={chosen[k]}" for k in keys]
    batch = ""
    if "train.micro_batch_size" in keys and cfg.train.global_batch_size == -1:
        # No global batch given: it is the micro-batch times the data-parallel ranks, so the choice sets it too.
        dims = best.census.dims
        sequences = best.config.train.micro_batch_size * dims.dp_replicate * dims.dp_shard
        batch = f"; the global batch is then {sequences} sequences, give train.global_batch_size to hold it"
    # The speed model's rates are an H200's: without a GPU the line names the layout they rank first, no tokens/s.
    speed = f"{best.speed['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU"
    if of_what:
        speed = "the fastest that fits by the planner's H200 rates"
    if dist_env().rank == 0:  # torchrun's RANK or srun's SLURM_PROCID, as the run reads them
        print(
            f"moe-tune: auto: {' '.join(picked)} (predicted {best.memory.peak / 2**30:.1f} GiB peak of "
            f"{memory:.0f} GiB{of_what}, {speed}{batch}; moe-tune-plan --search lists every layout)",
            file=sys.stderr,
            flush=True,
        )
    return [*given, *picked]

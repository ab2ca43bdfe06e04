"""Resumable checkpoints with torch.distributed.checkpoint (DCP), and the Hugging Face export of a run.

Layout: ``checkpoints/step_<N>/`` holds DCP shards of the model and optimizer, ``meta.json`` (step,
scheduler, source checkpoint, resolved config) and ``COMPLETE``, written last by rank 0: a directory
without it is an interrupted save and is never resumed from.

Expert tensors are stored one expert per key (``...experts.gate_up_proj@<j>``, j the global expert index)
so that a checkpoint does not depend on how experts were split: it can be resumed under another expert-
parallel or FSDP layout. The per-expert entries are views of the live tensors, so DCP reads straight into
place. This needs each rank to hold whole experts: (experts / ep) divisible by the FSDP ranks sharding them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re

import torch
import torch.distributed as dist

from moe_tune.config import CheckpointError
from moe_tune.models.hf_io import EXPERT_PARAM, expert_offsets, local_rows

COMPLETE = "COMPLETE"
log = logging.getLogger("moe_tune")


def _split_experts(flat: dict, offsets: dict[str, int], fqn_of=lambda k: k) -> dict:
    """Replace each stacked expert entry by one view per expert, keyed by global expert index."""
    out = {}
    for key, value in flat.items():
        fqn = fqn_of(key)
        if EXPERT_PARAM.match(fqn) and isinstance(value, torch.Tensor) and value.dim() >= 2:
            local, first = local_rows(value)
            for i in range(local.shape[0]):
                out[f"{key}@{offsets.get(fqn, 0) + first + i}"] = local[i]
        else:
            out[key] = value
    return out


def _is_extra_state(key: str) -> bool:
    return key.endswith("_extra_state")


def _extra_state_file(path: str, rank: int) -> str:
    return os.path.join(path, f"extra_state.rank{rank}.pt")


@contextlib.contextmanager
def _te_pickled_extra_state_allowed(allowed: bool):
    """TransformerEngine (2.20+) refuses to unpickle its FP8 delayed-scaling state unless
    NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1, so a kernels.fp8=delayed run could not resume from its own
    checkpoint. A resume trusts the checkpoint directory already (DCP's ``.metadata`` is a pickle), so the
    opt-in is set for this load only, and only when the extra state was read from the checkpoint."""
    key = "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"
    before = os.environ.get(key)
    if allowed:
        os.environ[key] = "1"
    try:
        yield
    finally:
        if allowed:
            if before is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = before


def _flat_state(trainer) -> tuple[dict, dict, dict]:
    """Everything DCP saves and loads, flat. Modules' extra state (TransformerEngine's FP8 scaling history: a
    pickled uint8 tensor whose length changes once FP8 has run) is left out: DCP loads into tensors of the
    current size. It is saved per rank beside the shards instead."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer)
    offsets = expert_offsets(trainer.model)
    sharded = {k: v for k, v in model_sd.items() if not _is_extra_state(k)}
    flat = {f"model.{k}": v for k, v in _split_experts(sharded, offsets).items()}
    for fqn, state in optim_sd["state"].items():
        for name, value in state.items():
            key = f"optim.{fqn}.{name}"
            if EXPERT_PARAM.match(fqn) and isinstance(value, torch.Tensor) and value.dim() >= 2:
                flat.update(_split_experts({key: value}, offsets, fqn_of=lambda k, f=fqn: f))
            else:
                flat[key] = value
    return flat, model_sd, optim_sd


def save(trainer, path: str) -> None:
    import torch.distributed.checkpoint as dcp

    flat, model_sd, optim_sd = _flat_state(trainer)
    extra = {k: v for k, v in model_sd.items() if _is_extra_state(k)}
    if extra:  # before dcp.save, whose collectives every rank passes before rank 0 writes COMPLETE
        os.makedirs(path, exist_ok=True)
        torch.save(extra, _extra_state_file(path, trainer.rank))
    dcp.save(flat, checkpoint_id=path)
    if trainer.rank == 0:
        from dataclasses import asdict

        meta = {
            "step": trainer.step,
            "scheduler": trainer.scheduler.state_dict(),
            "param_groups": optim_sd["param_groups"],
            "source": trainer.source,
            "config": asdict(trainer.cfg),
        }
        with open(os.path.join(path, "meta.json"), "w") as f:
            json.dump(meta, f, indent=2, default=str)
        with open(os.path.join(path, COMPLETE), "w") as f:
            f.write(str(trainer.step))
    if dist.is_initialized():
        dist.barrier()


def latest(run_dir: str) -> str | None:
    root = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(root):
        return None
    steps = [
        (int(m.group(1)), os.path.join(root, n))
        for n in os.listdir(root)
        if (m := re.fullmatch(r"step_(\d+)", n)) and os.path.isfile(os.path.join(root, n, COMPLETE))
    ]
    return max(steps)[1] if steps else None


def maybe_resume(trainer, resume: str) -> int:
    """Returns the step to start from: 0, or the step of the checkpoint resumed."""
    if resume == "none":
        return 0
    path = latest(trainer.cfg.output_dir) if resume == "auto" else resume
    if path is None:
        return 0
    if not os.path.isfile(os.path.join(path, COMPLETE)):
        raise CheckpointError(f"checkpoint.resume={path} is not a complete checkpoint (no {COMPLETE} file)")
    load(trainer, path)
    return trainer.step


def load(trainer, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    flat, model_sd, optim_sd = _flat_state(trainer)
    dcp.load(flat, checkpoint_id=path)
    # Expert entries were views: the stacked tensors are filled already. Others were replaced in ``flat``.
    for key, value in flat.items():
        if key.startswith("model.") and "@" not in key:
            model_sd[key[len("model.") :]] = value
    extra_keys = [k for k in model_sd if _is_extra_state(k)]
    extra_state_loaded = False
    if extra_keys:
        extra_file = _extra_state_file(path, trainer.rank)
        if os.path.isfile(extra_file):
            model_sd.update(torch.load(extra_file, weights_only=True))  # uint8 tensors only
            extra_state_loaded = True
        else:
            log.warning(
                "%s has no module extra state for rank %d (FP8 scaling history starts afresh)", path, trainer.rank
            )
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    # Learning rate, betas etc. as they were at the save (the fresh optimizer holds step 0's values).
    optim_sd["param_groups"] = [{**g, "betas": tuple(g["betas"])} if "betas" in g else g for g in meta["param_groups"]]
    with _te_pickled_extra_state_allowed(extra_state_loaded):
        set_state_dict(trainer.model, trainer.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    trainer.scheduler.load_state_dict(meta["scheduler"])
    trainer.step = meta["step"]


def read_meta(path: str):
    """(meta.json, the run's ``Config``) of a complete checkpoint; CheckpointError naming what is missing."""
    from omegaconf import OmegaConf

    from moe_tune.config import Config, comm_config

    meta_path = os.path.join(path, "meta.json")
    if not os.path.isfile(os.path.join(path, COMPLETE)) or not os.path.isfile(meta_path):
        raise CheckpointError(f"{path} is not a complete moe-tune checkpoint (needs meta.json and {COMPLETE})")
    with open(meta_path) as f:
        meta = json.load(f)
    saved = dict(meta["config"])
    comm = comm_config(saved.pop("comm", {}))
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), saved))
    cfg.comm = comm
    return meta, cfg


def load_model_weights(model, path: str) -> None:
    """Only the model's tensors of a checkpoint into ``model`` (any layout: experts are stored one per key)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    model_sd = get_model_state_dict(model)
    sharded = {k: v for k, v in model_sd.items() if not _is_extra_state(k)}
    flat = {f"model.{k}": v for k, v in _split_experts(sharded, expert_offsets(model)).items()}
    dcp.load(flat, checkpoint_id=path)
    for key, value in flat.items():
        if "@" not in key:
            model_sd[key[len("model.") :]] = value
    set_model_state_dict(model, model_sd)

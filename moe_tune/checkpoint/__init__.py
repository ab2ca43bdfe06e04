"""Resumable checkpoints with torch.distributed.checkpoint (DCP), and the Hugging Face export of a run.

Layout: ``checkpoints/step_<N>/`` holds DCP shards of the model and optimizer, ``meta.json`` (step,
scheduler, source checkpoint, resolved config) and ``COMPLETE``, written last by rank 0: a directory
without it is an interrupted save and is never resumed from.

Every tensor is keyed by its parameter's name, experts one per global expert index, and param groups and the
scheduler are matched by parameter names (``moe_tune.checkpoint.state``): a checkpoint resumes at any layout
(world size, ep, dp_shard, dp_replicate), not only the one it was saved at.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re

import torch
import torch.distributed as dist

from moe_tune.checkpoint.state import (
    flat_state,
    model_entries,
    names_match,
    param_groups_by_name,
    restore_model,
    scheduler_by_name,
)
from moe_tune.checkpoint.state import is_extra_state as _is_extra_state
from moe_tune.config import CheckpointError

COMPLETE = "COMPLETE"
log = logging.getLogger("moe_tune")


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


def save(trainer, path: str) -> None:
    import torch.distributed.checkpoint as dcp

    flat, model_sd, optim_sd = flat_state(trainer.model, trainer.optimizer)
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

    flat, model_sd, optim_sd = flat_state(trainer.model, trainer.optimizer)
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    # Learning rate, betas etc. as they were at the save (the fresh optimizer holds step 0's values), matched by
    # parameter name: the groups' number and order depend on the layout. CheckpointError if the names differ.
    optim_sd["param_groups"], group_of = param_groups_by_name(optim_sd["param_groups"], meta["param_groups"], path)
    with names_match(path):
        dcp.load(flat, checkpoint_id=path)
    restore_model(flat, model_sd)
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
    with _te_pickled_extra_state_allowed(extra_state_loaded):
        set_state_dict(trainer.model, trainer.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    num_saved = len(meta["param_groups"])
    trainer.scheduler.load_state_dict(scheduler_by_name(meta["scheduler"], group_of, num_saved, path))
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
    flat = model_entries(model, model_sd)
    with names_match(path):
        dcp.load(flat, checkpoint_id=path)
    restore_model(flat, model_sd)
    set_model_state_dict(model, model_sd)

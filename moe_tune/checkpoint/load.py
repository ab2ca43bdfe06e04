"""Loading a training checkpoint into a run's components (``RunState``), checked first: the settings it fits
(``fit``), the global batch and the base a LoRA checkpoint belongs to; then the tensors, the param groups and
scheduler matched by parameter name (``state``), and this run's hyperparameters (``resume``)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
from dataclasses import asdict

import torch

from moe_tune.checkpoint import manifest, resume, safe
from moe_tune.checkpoint.fit import check_settings, mismatch_fix
from moe_tune.checkpoint.run_state import Resumed, RunState
from moe_tune.checkpoint.start import note_finished
from moe_tune.checkpoint.state import (
    check_base,
    extra_state_file,
    flat_state,
    frozen_names,
    is_extra_state,
    names_match,
    param_groups_by_name,
    restore_model,
    scheduler_by_name,
)

log = logging.getLogger("moe_tune")


def maybe_resume(state: RunState, resume_from: str) -> Resumed | None:
    """Load ``checkpoint.resume``'s checkpoint into ``state``'s components: the newest intact one (damaged ones
    passed over with a warning), or the one named, checked. None: nothing to resume, the run starts afresh."""
    path = manifest.pick(state.cfg.output_dir, resume_from)
    if path is None:
        return None
    if state.rank == 0:
        log.info("resuming from %s", path)
    resumed = load(state, path)
    if state.rank == 0:
        note_finished(path, resumed.step, state.cfg.train.steps)
    named = [*state.model.state_dict().items(), *_optimizer_tensors(state.optimizer)]
    safe.check_finite(named, f"checkpoint {path}")
    return resumed


def _optimizer_tensors(optimizer):
    for i, opt_state in enumerate(optimizer.state.values()):
        for name, value in opt_state.items():
            if isinstance(value, torch.Tensor):
                yield f"optimizer state {name} of parameter {i}", value


def load(state: RunState, path: str) -> Resumed:
    """Checkpoint ``path`` into ``state``'s model, optimizer and scheduler (each through its state dict, this
    run's hyperparameters written in); the step and layout to continue with are returned, for the run to apply."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    cfg = state.cfg
    flat, model_sd, optim_sd = flat_state(state.model, state.optimizer)
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    check_settings(meta, cfg, path)  # another peft: named in settings, before any tensor is read
    layout = resume.keep_global_batch(state.layout, cfg.train, meta, path, state.rank)
    if frozen_names(state.model):  # adapters only: the base is the run's own, and must be the one they fit
        check_base(meta, asdict(cfg.model), cfg.train.seed, state.source, path)
    # Learning rate, betas etc. as they were at the save (the fresh optimizer holds step 0's values), matched by
    # parameter name: the groups' number and order depend on the layout. CheckpointError if the names differ.
    fix = mismatch_fix(meta, cfg, path)
    groups, group_of = param_groups_by_name(optim_sd["param_groups"], meta["param_groups"], path, fix)
    with names_match(path, fix):
        safe.dcp_load(flat, path)  # no unpickling of anything but DCP's metadata classes
    restore_model(flat, model_sd)
    extra_state_loaded = _read_extra_state(model_sd, path, state.rank)
    scheduler_sd = scheduler_by_name(meta["scheduler"], group_of, len(meta["param_groups"]), path)
    decays = resume.weight_decays(state.model, state.optimizer, cfg)
    changes, shape = resume.this_runs_hyperparameters(cfg, meta["config"], groups, scheduler_sd, decays)
    optim_sd["param_groups"] = groups
    with _te_pickled_extra_state_allowed(extra_state_loaded):
        set_state_dict(state.model, state.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    state.scheduler.load_state_dict(scheduler_sd)
    if state.rank == 0:
        resume.report(cfg, meta["config"], changes, shape)
        if (other := resume.other_rows_message(cfg, meta, path, state.data_rows)) is not None:
            log.warning(other)
    return Resumed(path, meta["step"], layout, tuple(changes + shape))


def _read_extra_state(model_sd: dict, path: str, rank: int) -> bool:
    """This rank's modules' extra state (TransformerEngine's FP8 scaling history) into ``model_sd``, screened;
    False when the model has none or the checkpoint holds none for this rank."""
    if not any(is_extra_state(k) for k in model_sd):
        return False
    extra_file = extra_state_file(path, rank)
    if not os.path.isfile(extra_file):
        log.warning("%s has no module extra state for rank %d (FP8 scaling history starts afresh)", path, rank)
        return False
    extra_state = torch.load(extra_file, weights_only=True)  # uint8 tensors only
    safe.check_extra_state(extra_state, extra_file)  # TE unpickles them: only allowlisted classes
    model_sd.update(extra_state)
    return True


@contextlib.contextmanager
def _te_pickled_extra_state_allowed(allowed: bool):
    """TransformerEngine (2.20+) refuses to unpickle its FP8 delayed-scaling state unless
    NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1, so a kernels.fp8=delayed run could not resume from its own
    checkpoint. The opt-in is set for this load only, only when the extra state was read from the checkpoint,
    and only after ``safe.check_extra_state`` unpickled every payload through an allowlist (TE's recipe classes,
    tensors, containers): what TE then unpickles can construct nothing else."""
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

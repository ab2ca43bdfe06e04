"""Resumable checkpoints with torch.distributed.checkpoint (DCP), and the Hugging Face export of a run.

Layout: ``checkpoints/step_<N>/`` holds DCP shards of the model and optimizer, ``meta.json`` (step,
scheduler, source checkpoint, resolved config) and ``COMPLETE``, written last by rank 0: a directory
without it is an interrupted save and is never resumed from.

Every tensor is keyed by its parameter's name, experts one per global expert index, and param groups and the
scheduler are matched by parameter names (``moe_tune.checkpoint.state``): a checkpoint resumes at any layout
(world size, ep, dp_shard, dp_replicate), not only the one it was saved at.

A LoRA run's checkpoint holds the adapters (and trained routers) and their optimizer state only; the frozen base
is not copied into every checkpoint. meta.json's ``source``, ``base_fingerprint`` and ``config.model`` point to
the base, which is checked at resume and read again by ``moe-tune-export`` (``--base`` if it moved).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from dataclasses import replace

import torch

from moe_tune.checkpoint import manifest, safe
from moe_tune.checkpoint.background import CheckpointSaver  # noqa: F401  (the trainer's)
from moe_tune.checkpoint.fit import check_settings, mismatch_fix
from moe_tune.checkpoint.save import prepare_save, save  # noqa: F401  (the trainer's)
from moe_tune.checkpoint.start import RUN_OUTPUTS, check_start, note_finished  # noqa: F401  (the trainer: check_start)
from moe_tune.checkpoint.state import (
    check_base,
    extra_state_file,
    flat_state,
    frozen_names,
    model_entries,
    names_match,
    param_groups_by_name,
    restore_model,
    scheduler_by_name,
)
from moe_tune.checkpoint.state import is_extra_state as _is_extra_state
from moe_tune.config import CheckpointError, TrainConfig, rounds_stochastically
from moe_tune.distributed.dims import BatchLayout

COMPLETE = "COMPLETE"
log = logging.getLogger("moe_tune")


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


def latest(run_dir: str) -> str | None:
    """The complete checkpoint with the highest step (not checked: ``manifest.pick`` checks)."""
    return next(iter(manifest.complete_checkpoints(run_dir)), None)


def maybe_resume(trainer, resume: str) -> int:
    """Returns the step to start from: 0, or the step of the checkpoint resumed."""
    # The newest intact checkpoint (damaged ones passed over with a warning), or the one named, checked.
    path = manifest.pick(trainer.cfg.output_dir, resume)
    if path is not None:
        if trainer.rank == 0:
            log.info("resuming from %s", path)
        load(trainer, path)
        if trainer.rank == 0:
            note_finished(path, trainer.step, trainer.cfg.train.steps)
        named = [*trainer.model.state_dict().items(), *_optimizer_tensors(trainer.optimizer)]
        safe.check_finite(named, f"checkpoint {path}")
    metrics = getattr(trainer, "metrics", None)
    if metrics is not None:
        metrics.drop_after(trainer.step if path is not None else 0)  # rows of steps about to be replayed
    return trainer.step if path is not None else 0


def _optimizer_tensors(optimizer):
    for i, state in enumerate(optimizer.state.values()):
        for name, value in state.items():
            if isinstance(value, torch.Tensor):
                yield f"optimizer state {name} of parameter {i}", value


def load(trainer, path: str) -> None:
    from torch.distributed.checkpoint.state_dict import set_state_dict

    flat, model_sd, optim_sd = flat_state(trainer.model, trainer.optimizer)
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    check_settings(meta, trainer.cfg, path)  # another peft: named in settings, before any tensor is read
    trainer.layout = keep_global_batch(trainer.layout, trainer.cfg.train, meta, path, trainer.rank)
    if frozen_names(trainer.model):  # adapters only: the base is the run's own, and must be the one they fit
        from dataclasses import asdict

        check_base(meta, asdict(trainer.cfg.model), trainer.cfg.train.seed, trainer.source, path)
    # Learning rate, betas etc. as they were at the save (the fresh optimizer holds step 0's values), matched by
    # parameter name: the groups' number and order depend on the layout. CheckpointError if the names differ.
    fix = mismatch_fix(meta, trainer.cfg, path)
    optim_sd["param_groups"], group_of = param_groups_by_name(optim_sd["param_groups"], meta["param_groups"], path, fix)
    with names_match(path, fix):
        safe.dcp_load(flat, path)  # no unpickling of anything but DCP's metadata classes
    restore_model(flat, model_sd)
    extra_keys = [k for k in model_sd if _is_extra_state(k)]
    extra_state_loaded = False
    if extra_keys:
        extra_file = extra_state_file(path, trainer.rank)
        if os.path.isfile(extra_file):
            extra_state = torch.load(extra_file, weights_only=True)  # uint8 tensors only
            safe.check_extra_state(extra_state, extra_file)  # TE unpickles them: only allowlisted classes
            model_sd.update(extra_state)
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
    apply_new_hyperparameters(trainer, meta["config"])


def apply_new_hyperparameters(trainer, saved: dict) -> None:
    """Hyperparameters given anew on a resume take effect from the resumed step, logged (the checkpoint restores
    the groups' and scheduler's values, which would otherwise silently win): ``train.lr`` rescales the schedule's
    peak and the current rate; ``optim.betas`` and ``eps`` replace the groups', and each group's weight decay is this run's rule's
    (``_weight_decays``). The schedule's
    shape (``optim.warmup_steps``, ``schedule``, ``min_lr_ratio``, ``train.steps``) is always this run's config;
    a change is logged too, as the rate follows the new shape from the next step. So are ``train.precision`` and
    ``optim.stochastic_rounding`` (the weights and moments load into this run's dtypes; forgetting them on a
    resume would otherwise change memory and rounding silently) and ``optim.compiled`` (the same maths); so is
    other data (``data.name``, ``path``, ``val_path``, ``val_fraction``: the remaining steps read it), and a
    ``model.path`` other than the checkpoint's (its weights continue; the new path's config and tokenizer are
    used)."""
    t, o, groups = trainer.cfg.train, trainer.cfg.optim, trainer.optimizer.param_groups
    changes = []
    if saved["train"]["lr"] != t.lr:
        ratio = t.lr / saved["train"]["lr"]
        trainer.scheduler.base_lrs = [lr * ratio for lr in trainer.scheduler.base_lrs]
        for group in groups:
            group["initial_lr"], group["lr"] = group["initial_lr"] * ratio, group["lr"] * ratio
        trainer.scheduler._last_lr = [group["lr"] for group in groups]
        changes.append(f"train.lr {saved['train']['lr']} -> {t.lr}")
    for key in ("betas", "eps", "weight_decay"):
        new = getattr(o, key)
        old = saved["optim"].get(key, new)
        if key == "betas":
            old, new = tuple(old), tuple(new)
        if old != new:
            if key != "weight_decay":  # weight decay: per group, below
                for group in groups:
                    group[key] = new
            changes.append(f"optim.{key} {old} -> {new}")
    for group, decay in zip(groups, _weight_decays(trainer)):
        group["weight_decay"] = decay
    changes += _changed(trainer.cfg, saved, [("train", "precision"), ("optim", "decay_norms_and_biases")])
    # As each run applied it (automatic: on for bf16 parameters; a checkpoint from before the key: off).
    was = rounds_stochastically(saved["train"]["precision"], saved["optim"].get("stochastic_rounding", False))
    now = rounds_stochastically(t.precision, o.stochastic_rounding)
    if was != now:
        changes.append(f"optim.stochastic_rounding {was} -> {now}")
    # The remaining steps read this run's data: another set changes what they train on.
    changes += _changed(trainer.cfg, saved, [("data", k) for k in ("name", "path", "val_path", "val_fraction")])
    source = saved["model"].get("path", trainer.cfg.model.path)
    if source != trainer.cfg.model.path and trainer.rank == 0:
        log.warning(other_source_message(trainer.cfg.model.path, source, lora=trainer.cfg.peft.name == "lora"))
    shape = []  # a longer run (train.steps) is the usual reason: logged as information, not as a warning
    keys = [("optim", k) for k in ("warmup_steps", "schedule", "min_lr_ratio", "compiled")] + [("train", "steps")]
    shape += _changed(trainer.cfg, saved, keys)
    if trainer.rank == 0:
        for report, items in ((log.warning, changes), (log.info, shape)):
            if items:
                report("resuming with this run's %s (the checkpoint had the former)", "; ".join(items))


def _weight_decays(trainer) -> list[float]:
    """Each param group's weight decay as this run's config gives it (``moe_tune.optim.param_groups``'s rule):
    the checkpoint's groups may have been split otherwise, or saved with another decay, and norms and biases
    keep 0 unless ``optim.decay_norms_and_biases``."""
    from moe_tune.optim import is_decayed

    o = trainer.cfg.optim
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    return [
        o.weight_decay
        if o.decay_norms_and_biases or any(is_decayed(names.get(id(p), ""), p) for p in group["params"])
        else 0.0
        for group in trainer.optimizer.param_groups
    ]


def _changed(cfg, saved: dict, keys: list[tuple[str, str]]) -> list[str]:
    """``"section.key old -> new"`` for each config value that differs from the checkpoint's (absent there: same)."""
    changed = []
    for section, key in keys:
        new = getattr(getattr(cfg, section), key)
        old = saved[section].get(key, new)
        if old != new:
            changed.append(f"{section}.{key} {old} -> {new}")
    return changed


def keep_global_batch(layout: BatchLayout, train: TrainConfig, meta: dict, path: str, rank: int = 0) -> BatchLayout:
    """The layout a resume trains with, which continues the run's data order: step s reads the rows after those of
    steps 0..s-1, s x the rows per step, so the global batch must stay what it was (another layout with
    train.global_batch_size=-1 would silently replay or skip rows, and change the batch). With
    train.global_batch_size=-1 the checkpoint's is kept by accumulating micro-batches; a global batch that cannot
    be kept, or another one set on purpose, is one line (CheckpointError)."""
    saved = meta.get("rows_per_step") or meta["config"]["train"].get("global_batch_size", -1)
    per_micro, dp = layout.rows_per_micro_batch, layout.dp_size
    if saved == -1 or saved == layout.rows_per_step:  # a checkpoint older than rows_per_step with -1: unknown
        return layout
    if train.global_batch_size == -1 and saved % per_micro == 0:
        kept = replace(layout, accum=saved // per_micro)
        if rank == 0:
            log.info(
                "keeping the checkpoint's global batch of %d rows: %d micro-batches of %d per rank x %d ranks",
                saved,
                kept.accum,
                kept.micro_batch_size,
                dp,
            )
        return kept
    if train.global_batch_size != -1:
        fix = f"set train.global_batch_size={saved} (or -1 to keep the checkpoint's)"
    elif saved == dp:
        fix = "set train.micro_batch_size=1"
    elif saved % dp == 0:
        fix = f"set train.micro_batch_size to a divisor of {saved // dp}"
    else:
        fix = f"resume on a number of data-parallel ranks that divides {saved}"
    raise CheckpointError(
        f"checkpoint {path} was trained with {saved} rows per optimizer step and this run would take "
        f"{layout.rows_per_step} (train.micro_batch_size={layout.micro_batch_size} x {dp} data-parallel "
        f"ranks x {layout.accum} micro-batches), which would replay or skip data; {fix}"
    )


def other_source_message(new: str, source: str, lora: bool) -> str:
    """A resume whose model.path is not the checkpoint's: what each of them gives the run."""
    if lora:  # the checkpoint holds adapters only; the base was checked to have the checkpoint's fingerprint
        return (
            f"model.path {new} is not the checkpoint's ({source}): the checkpoint's adapters continue on {new}'s base "
            "weights, which have the checkpoint's fingerprint"
        )
    return (
        f"model.path {new} is not the checkpoint's ({source}): training continues from the checkpoint's weights, with "
        f"{new}'s config and tokenizer; to start from {new}'s weights, give another output_dir"
    )


def _hint(path: str) -> str:
    """What to give instead of a run directory or a Hugging Face export."""
    found = manifest.complete_checkpoints(path)
    if found:
        return f"; {path} is a run directory: give one of its checkpoints, e.g. {found[0]}"
    for export in (path, os.path.join(path, "hf")):
        if any(os.path.isfile(os.path.join(export, name)) for name in ("config.json", "adapter_config.json")):
            return (
                f"; {export} is a Hugging Face export, not a checkpoint (a run with checkpoint.every=0 saves none): "
                "rerun with checkpoint.every=N, or load it with transformers (a LoRA adapter with PEFT, whose "
                "merge_and_unload() merges it)"
            )
    return ""


def read_meta(path: str):
    """(meta.json, the run's ``Config``) of a complete checkpoint; CheckpointError naming what is missing."""
    from omegaconf import OmegaConf

    from moe_tune.config import Config, comm_config

    meta_path = os.path.join(path, "meta.json")
    if not os.path.isfile(os.path.join(path, COMPLETE)) or not os.path.isfile(meta_path):
        raise CheckpointError(
            f"{path} is not a complete moe-tune checkpoint (needs meta.json and {COMPLETE}){_hint(path)}"
        )
    problem = manifest.verify(path)  # sizes and checksums of every file, before any is read
    if problem:
        raise CheckpointError(f"checkpoint {path} is damaged: {problem}; use another checkpoint")
    with open(meta_path) as f:
        meta = json.load(f)
    saved = dict(meta["config"])
    comm = comm_config(saved.pop("comm", {}))
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), saved))
    cfg.comm = comm
    return meta, cfg


def load_model_weights(model, path: str) -> None:
    """Only the model's tensors of a checkpoint into ``model`` (any layout: experts are stored one per key)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    model_sd = get_model_state_dict(model)
    flat = model_entries(model, model_sd)
    problem = manifest.verify(path, checksums=False)  # read_meta checked the checksums
    if problem:
        raise CheckpointError(f"checkpoint {path} is damaged: {problem}; use another checkpoint")
    with names_match(path):
        safe.dcp_load(flat, path)  # no unpickling of anything but DCP's metadata classes
    restore_model(flat, model_sd)
    set_model_state_dict(model, model_sd)
    safe.check_finite(model.state_dict().items(), f"checkpoint {path}")

"""What a resume takes from the checkpoint and what it takes from this run, decided before anything loads.

The global batch is the checkpoint's (``keep_global_batch``: the data order continues). Hyperparameters given
anew are this run's: ``this_runs_hyperparameters`` writes them into the param groups and scheduler state about to
be loaded (the checkpoint's values would otherwise silently win), so that each component takes them through its
own ``load_state_dict``; ``report`` logs every difference once the load is done.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from moe_tune.checkpoint.fit import DATA_KEYS
from moe_tune.config import CheckpointError, Config, TrainConfig, rounds_stochastically
from moe_tune.distributed.dims import BatchLayout

log = logging.getLogger("moe_tune")


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


def this_runs_hyperparameters(
    cfg: Config, saved: dict, groups: list[dict], scheduler_state: dict, decays: list[float]
) -> tuple[list[str], list[str]]:
    """Write this run's hyperparameters into the checkpoint's param ``groups`` and ``scheduler_state`` (matched to
    the current groups, not loaded yet), so that they take effect from the resumed step: ``train.lr`` rescales the
    schedule's peak, and the resumed step's rate is this run's schedule at that step (``_this_runs_rate``);
    ``optim.betas`` and ``eps`` replace the groups', and each group's weight decay is ``decays``' (this run's rule,
    ``weight_decays``). Returns (the changes warned about, the changes of the schedule's shape), each
    ``"section.key old -> new"``; ``saved`` is the checkpoint's config.

    The schedule's shape (``optim.warmup_steps``, ``schedule``, ``min_lr_ratio``, ``train.steps``) is always this
    run's config; a change is reported as information, as the rate follows the new shape from the resumed step. So
    are ``train.precision`` and ``optim.stochastic_rounding`` (the weights and moments load into this run's dtypes;
    forgetting them on a resume would otherwise change memory and rounding silently) and ``optim.compiled`` (the
    same maths); so is other data or other rows of it (``DATA_KEYS``, ``train.seq_len``, ``train.seed``: the remaining
    steps read them), and under LoRA ``peft.alpha``, ``dropout`` and ``quantize_base`` (the adapters load as saved)."""
    t, o = cfg.train, cfg.optim
    changes = []
    if saved["train"]["lr"] != t.lr:
        changes.append(f"train.lr {saved['train']['lr']} -> {t.lr}")
    _this_runs_rate(cfg, saved["train"]["lr"], groups, scheduler_state)
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
    for group, decay in zip(groups, decays):
        group["weight_decay"] = decay
    changes += _changed(cfg, saved, [("train", "precision"), ("optim", "decay_norms_and_biases")])
    # As each run applied it (automatic: on for bf16 parameters; a checkpoint from before the key: off).
    was = rounds_stochastically(saved["train"]["precision"], saved["optim"].get("stochastic_rounding", False))
    now = rounds_stochastically(t.precision, o.stochastic_rounding)
    if was != now:
        changes.append(f"optim.stochastic_rounding {was} -> {now}")
    # The remaining steps read this run's data: another set, or the same records made into other rows (another
    # sequence length, seed, packing, loss mask or record format), changes what they train on.
    changes += _changed(cfg, saved, [("data", k) for k in DATA_KEYS] + [("train", "seq_len"), ("train", "seed")])
    # The adapters' scale and dropout change what the same weights compute; the frozen base's storage changes its
    # rounding and the memory (a requeue that forgets peft.quantize_base=nf4 may no longer fit).
    if cfg.peft.name != "none" and "peft" in saved:
        changes += _changed(cfg, saved, [("peft", k) for k in ("alpha", "dropout", "quantize_base")])
    # A longer run (train.steps) is the usual reason for a new shape: information, not a warning.
    keys = [("optim", k) for k in ("warmup_steps", "schedule", "min_lr_ratio", "compiled")] + [("train", "steps")]
    return changes, _changed(cfg, saved, keys)


def _this_runs_rate(cfg: Config, saved_lr: float, groups: list[dict], scheduler_state: dict) -> None:
    """The resumed step's learning rate as a fresh run with this run's ``train.lr`` and schedule would apply it,
    written into the param ``groups`` and the scheduler state about to be loaded: the checkpoint's rate is its own
    schedule's for that step (another ``train.steps`` or warm-up would otherwise apply for one step). The peak
    (``base_lrs``, ``initial_lr``) is rescaled when ``train.lr`` differs from ``saved_lr``, divided first so that a
    group at the checkpoint's ``train.lr`` gets this run's exactly; the rate is LambdaLR's own product,
    base x lambda(step), so an unchanged resume keeps the checkpoint's bits."""
    from moe_tune.optim import lr_lambda

    lr = cfg.train.lr
    if saved_lr != lr:
        scheduler_state["base_lrs"] = [base / saved_lr * lr for base in scheduler_state["base_lrs"]]
    rate = lr_lambda(cfg.optim, cfg.train.steps)(scheduler_state["last_epoch"])  # last_epoch: the resumed step, s
    scheduler_state["_last_lr"] = [base * rate for base in scheduler_state["base_lrs"]]  # get_last_lr() after load
    for group, base, step_lr in zip(groups, scheduler_state["base_lrs"], scheduler_state["_last_lr"]):
        group["initial_lr"], group["lr"] = base, step_lr


def weight_decays(model: torch.nn.Module, optimizer: torch.optim.Optimizer, cfg: Config) -> list[float]:
    """Each param group's weight decay as this run's config gives it (``moe_tune.optim.param_groups``'s rule):
    the checkpoint's groups may have been split otherwise, or saved with another decay, and norms and biases
    keep 0 unless ``optim.decay_norms_and_biases``."""
    from moe_tune.optim import is_decayed

    o = cfg.optim
    names = {id(p): n for n, p in model.named_parameters()}
    return [
        o.weight_decay
        if o.decay_norms_and_biases or any(is_decayed(names.get(id(p), ""), p) for p in group["params"])
        else 0.0
        for group in optimizer.param_groups
    ]


def _changed(cfg: Config, saved: dict, keys: list[tuple[str, str]]) -> list[str]:
    """``"section.key old -> new"`` for each config value that differs from the checkpoint's (absent there: same)."""
    changed = []
    for section, key in keys:
        new = getattr(getattr(cfg, section), key)
        old = saved[section].get(key, new)
        if old != new:
            changed.append(f"{section}.{key} {old} -> {new}")
    return changed


def report(cfg: Config, saved: dict, changes: list[str], shape: list[str]) -> None:
    """Rank 0's lines on what the resumed run takes from this run rather than from the checkpoint: a
    ``model.path`` other than the checkpoint's (its weights continue; the new path's config and tokenizer are
    used), then the changes (a warning) and the schedule's new shape (information)."""
    source = saved["model"].get("path", cfg.model.path)
    if source != cfg.model.path:
        log.warning(other_source_message(cfg.model.path, source, lora=cfg.peft.name == "lora"))
    for say, items in ((log.warning, changes), (log.info, shape)):
        if items:
            say("resuming with this run's %s (the checkpoint had the former)", "; ".join(items))


def other_rows_message(cfg: Config, saved: dict, path: str, rows: dict | None) -> str | None:
    """The warning for training data that changed in place: the checkpoint's data settings, but the training set's
    ``identity()`` (records, rows, tokens) is not the checkpoint's (records added, removed or edited in data.path's
    files). Then the remaining steps read other rows in another order, so this epoch would train some records again
    and skip others, silently. None when nothing changed, when a data setting changed (said already) or when either
    side is unknown (a stream; a checkpoint from before ``data_rows``)."""
    was = saved.get("data_rows")
    keys = [("data", k) for k in DATA_KEYS] + [("train", "seq_len"), ("train", "seed")]
    if was is None or rows is None or was == rows or _changed(cfg, saved["config"], keys):
        return None
    where = f"data.path {cfg.data.path}" if cfg.data.path else f"data={cfg.data.name}"
    then, now = (f"{r['records']} records in {r['rows']} rows, {r['tokens']} tokens" for r in (was, rows))
    if then == now:  # as many of each: the rows' own token counts differ (the crc32)
        now = "as many, in rows of other lengths"
    return (
        f"{where} now makes other rows than when {path} was saved (then {then}; now {now}): its files, or the "
        "tokenizer or chat template that renders them, changed since, and the remaining steps read the new rows, so "
        "records of this epoch may be trained again or skipped; put them back as they were to keep the run's data order"
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

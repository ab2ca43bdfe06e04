"""What a run's start makes of its output_dir and ``checkpoint.resume``, before anything is written there.

A finished run is no fresh start (``checkpoint.resume=auto`` over one without a checkpoint would restart at step 1
over its outputs, over one that finished after its newest checkpoint would train its last steps again); a run that
stopped before its first checkpoint (killed, out of memory, a failed node) starts again from step 1, as a requeued
job must, its metrics rows replaced as a resume replaces those past its checkpoint; and a checkpoint past
``train.steps`` leaves nothing to train (a shorter run given by mistake, which would otherwise exit 0 having
trained nothing). The same command after a run finished (summary.json says so, at ``train.steps``) trains and
writes nothing and ends with exit 0, as in torchtitan and Lightning, which a requeued or retried job relies on
(``RunFinished``: its outputs stand). A checkpoint at ``train.steps`` without such a summary (the run stopped while
writing its outputs) trains nothing and writes the outputs again; the trainer says so (``note_finished``).
"""

from __future__ import annotations

import json
import logging
import os

from moe_tune.checkpoint import manifest
from moe_tune.config import CheckpointError

log = logging.getLogger("moe_tune")

# What a run leaves in its output_dir besides checkpoints (a finished or a crashed run).
RUN_OUTPUTS = ("metrics.jsonl", "summary.json", "hf")


class RunFinished(Exception):
    """The run in output_dir finished at this run's ``train.steps``: nothing to train or write (exit 0)."""


def check_start(run_dir: str, resume: str, steps: int, rank: int = 0, cfg=None) -> None:
    """CheckpointError (one line) for a start that would overwrite a run or train nothing; RunFinished for the
    same command again after a finished run."""
    check_finished(run_dir, resume, steps, cfg)
    check_fresh_start(run_dir, resume, rank)
    check_steps_left(run_dir, resume, steps)


def check_resumed_base(cfg) -> None:
    """A LoRA resume whose checkpoint's adapters were trained on a built-in base (a tiny preset's ``base_model/``,
    which the run draws again from model, model.overrides and train.seed) drawn otherwise than this run would draw
    it: CheckpointError naming those settings, read from the checkpoint's meta.json before the run draws its base
    over the one the adapters fit. A checkpoint that cannot be read is left to the resume, which names its damage."""
    from dataclasses import asdict

    from moe_tune.checkpoint.state import check_drawn_alike
    from moe_tune.models.base_model import BASE_MODEL

    resume = cfg.checkpoint.resume
    if cfg.peft.name == "none" or resume == "none":
        return
    path = _newest(cfg.output_dir)[0] if resume == "auto" else resume
    meta = _read_json(os.path.join(path, "meta.json")) if path is not None else None
    config = meta.get("config") if meta is not None else None
    if not isinstance(config, dict) or not all(isinstance(config.get(k), dict) for k in ("model", "train", "peft")):
        return
    if config["peft"].get("name", "none") == "none":  # a full fine-tune's checkpoint holds the whole model
        return
    source = os.path.abspath(os.path.join(cfg.output_dir, BASE_MODEL))
    check_drawn_alike(meta, asdict(cfg.model), cfg.train.seed, source, path)


def check_fresh_start(run_dir: str, resume: str, rank: int = 0) -> None:
    """``checkpoint.resume=auto`` in a directory that holds a finished run's outputs (summary.json, hf/) but no
    complete checkpoint would start at step 1 over them: refused. One that holds only the metrics of a run that
    stopped before its first checkpoint starts again, with a warning. ``checkpoint.resume=none`` starts afresh
    either way (metrics.jsonl restarts at step 1)."""
    if resume != "auto" or manifest.complete_checkpoints(run_dir):
        return
    found = [name for name in RUN_OUTPUTS if _not_empty(os.path.join(run_dir, name))]
    if "summary.json" in found and (_summary(run_dir) or {}).get("finished") is not True:
        found.remove("summary.json")  # a divergence stop's: the run never finished
    if found == ["metrics.jsonl"]:  # the run never finished, and it saved no checkpoint
        if rank == 0:
            log.warning(
                "output_dir %s holds a run that stopped before its first checkpoint (metrics.jsonl, no finished "
                "summary.json): starting it again from step 1, its metrics rows replaced (checkpoint.every=N saves "
                "every N steps)",
                run_dir,
            )
        return
    if found:
        raise CheckpointError(
            f"output_dir {run_dir} already holds a run ({', '.join(found)}) but no checkpoint to resume from; give "
            "another output_dir, or checkpoint.resume=none to start afresh and overwrite it"
        )


def check_finished(run_dir: str, resume: str, steps: int, cfg=None) -> None:
    """``checkpoint.resume=auto`` over a run whose summary.json says it ended:
    finished at ``steps`` (a retried command, a requeued job whose node failed after the run's end; with or without
    a checkpoint at ``steps``), RunFinished; ended past its newest checkpoint otherwise (saved every N steps and
    finished between two, or stopped on a signal and resumed to its end), resuming would train those steps again
    over the run's outputs: refused. A run of another model (``cfg``'s peft or model settings not the summary's)
    is no retry of it: refused, not told its outputs stand. Read and decided before anything is written."""
    if resume != "auto":
        return
    path, step = _newest(run_dir)
    summary = _summary(run_dir) or {}
    ended = summary.get("final_step")
    if summary.get("finished") is True and ended == steps:
        _check_same_model(run_dir, steps, summary, cfg)
        longer = _longer_run(run_dir, steps, step)
        if longer:
            more = f"{longer}: a train.steps above {steps} resumes that run, or give another output_dir"
        elif step == steps:  # a longer train.steps resumes from this checkpoint
            more = "raise train.steps to train on, or give another output_dir"
        else:  # a longer train.steps would be refused: no checkpoint at the run's end to go on from
            newest = f", its newest is {os.path.basename(os.path.normpath(path))}" if path else ""
            more = (
                f"to train further, give another output_dir: it has no checkpoint at step {steps} to go on from{newest}"
            )
        raise RunFinished(
            f"output_dir {run_dir} holds a run that finished at train.steps={steps} (summary.json): nothing to train; "
            f"its outputs stand ({more})"
        )
    if summary.get("finished") is True and step is not None and isinstance(ended, int) and step < ended:
        name = os.path.basename(os.path.normpath(path))
        again = f"step {ended}" if step + 1 == ended else f"steps {step + 1}-{ended}"
        raise CheckpointError(
            f"output_dir {run_dir} holds a run that ended at step {ended} (summary.json), after its newest "
            f"checkpoint {name}: resuming would train {again} again over its outputs; give another output_dir, or "
            f"checkpoint.resume={path} to train from it again on purpose"
        )


def _longer_run(run_dir: str, steps: int, newest: int | None) -> str:
    """What a finished run's directory holds past its ``steps`` (a longer run went on from it and stopped): its
    metrics rows and checkpoint, which a resume with a longer train.steps continues from; "" for none."""
    last = 0
    try:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            for line in f:
                try:
                    last = max(last, int(json.loads(line).get("step", 0)))
                except (ValueError, TypeError, AttributeError):
                    continue  # a torn last line: the trainer's own resume drops it
    except OSError:
        return ""
    last = max(last, newest or 0)
    if last <= steps:
        return ""
    checkpoint = f", its checkpoint at step {newest}" if newest and newest > steps else ""
    return (
        f"a longer run went on from it to step {last} and stopped (metrics.jsonl's rows {steps + 1}-{last}{checkpoint})"
    )


def _check_same_model(run_dir: str, steps: int, summary: dict, cfg) -> None:
    """A run of another model, or of the same one on other data or with other hyperparameters (a sweep's job
    numbered as another job of an earlier sweep), is no retry of the finished one: refused."""
    from moe_tune.checkpoint.fit import data_differ, hyperparameters_differ, settings_differ

    if cfg is None:
        return
    saved = summary.get("config") or {}
    for differ, what in (
        (settings_differ, "other settings"),
        (data_differ, "other data"),
        (hyperparameters_differ, "other hyperparameters"),
    ):
        was, now = differ(saved, cfg)
        if was:
            raise CheckpointError(
                f"output_dir {run_dir} holds a run that finished at train.steps={steps} with {what} (that run: "
                f"{was}; this run: {now}): its outputs are not this run's; give another output_dir, or "
                "checkpoint.resume=none to start afresh over it"
            )


def _summary(run_dir: str) -> dict | None:
    """summary.json (this history's: a rollback or restart sets an earlier run's aside, ``set_aside_later``); None
    without one or unreadable."""
    return _read_json(os.path.join(run_dir, "summary.json"))


def _read_json(path: str) -> dict | None:
    """The JSON object in file ``path``; None where there is none, or it is unreadable or no object."""
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            found = json.load(f)
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def check_steps_left(run_dir: str, resume: str, steps: int) -> None:
    """The checkpoint a resume starts from must be before ``train.steps`` (at it: a finished run, allowed). For
    ``auto`` the newest complete one is taken, unchecked (``manifest.pick`` checks it later and may fall back to
    an older one when it is damaged)."""
    if resume == "none":
        return
    path, step = _newest(run_dir) if resume == "auto" else (resume, manifest.saved_step(resume))
    if step is None or step <= steps:
        return
    if resume == "auto":
        what = f"output_dir={run_dir}: its checkpoint {os.path.basename(os.path.normpath(path))} is"
        fix = "give a new output_dir, or checkpoint.resume=none to start afresh over it"
    else:
        what, fix = f"checkpoint.resume={resume} is at step {step},", "or give an earlier checkpoint"
    raise CheckpointError(f"{what} past train.steps={steps}: nothing to train; raise train.steps above {step}, {fix}")


def note_finished(path: str, step: int, steps: int) -> None:
    """A resume at ``train.steps`` (rank 0): what the run does, instead of only 'resuming from'."""
    if step == steps:
        log.info(
            "%s is at train.steps=%d: the run is finished, nothing to train; its outputs are written again (raise "
            "train.steps to train on)",
            path,
            steps,
        )


def set_aside_later(run_dir: str, step: int, resume: str, enabled: bool = True) -> None:
    """Once a run started before the newest checkpoint has resumed at ``step`` (``checkpoint.resume=<path>``, a
    rollback; ``none``, a restart: 0), rank 0 of a run writing its files (``enabled``) moves what holds the history
    it replaces into ``checkpoints/replaced-<time>-<id>/``, with a warning: the complete checkpoints past ``step``
    and the old run's summary.json. Left in place, ``auto`` would resume from those checkpoints after a crash (the
    two histories mixed), ``checkpoint.keep_last`` would keep them over this run's own saves, and the summary would
    say the run had finished. Moved, not deleted: a mistaken ``resume=none`` loses nothing. (``auto`` resumed from
    the newest: past it are damaged ones only, passed over and kept.)"""
    if not enabled or resume == "auto":
        return
    summary = os.path.join(run_dir, "summary.json")
    old = manifest.later_checkpoints(run_dir, step) + ([summary] if os.path.isfile(summary) else [])
    if not old:
        return
    import tempfile
    import time

    os.makedirs(os.path.join(run_dir, "checkpoints"), exist_ok=True)
    prefix = time.strftime("replaced-%Y%m%d-%H%M%S-")
    aside = tempfile.mkdtemp(prefix=prefix, dir=os.path.join(run_dir, "checkpoints"))  # a name no other run took
    for path in old:
        os.rename(path, os.path.join(aside, os.path.basename(path)))
    log.warning(
        "moved %s into %s: they hold the history this run replaces (it starts at step %d, checkpoint.resume=%s); "
        "move a checkpoint back to resume from it, or delete the folder",
        ", ".join(os.path.basename(p) for p in old),
        aside,
        step,
        resume,
    )


def _newest(run_dir: str) -> tuple[str | None, int | None]:
    """The newest complete checkpoint of ``run_dir`` and its step (None, None: there is none)."""
    path = next(iter(manifest.complete_checkpoints(run_dir)), None)
    return path, manifest.saved_step(path) if path is not None else None


def _not_empty(path: str) -> bool:
    if os.path.isdir(path):
        return bool(os.listdir(path))
    return os.path.isfile(path) and os.path.getsize(path) > 0

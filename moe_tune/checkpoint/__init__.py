"""Resumable checkpoints with torch.distributed.checkpoint (DCP), and the Hugging Face export of a run.

Layout: ``checkpoints/step_<N>/`` holds DCP shards of the model and optimizer, ``meta.json`` (step,
scheduler, source checkpoint, resolved config) and ``COMPLETE``, written last by rank 0: a directory
without it is an interrupted save and is never resumed from.

The run hands its components over as a ``RunState`` (model, optimizer, scheduler, batch layout, config): ``save``
reads them, ``maybe_resume`` / ``load`` load into them and return a ``Resumed`` (step, layout, changes) that the
run applies itself (``moe_tune.checkpoint.run_state``).

Every tensor is keyed by its parameter's name, experts one per global expert index, and param groups and the
scheduler are matched by parameter names (``moe_tune.checkpoint.state``): a checkpoint resumes at any layout
(world size, ep, dp_shard, dp_replicate), not only the one it was saved at.

A LoRA run's checkpoint holds the adapters (and trained routers) and their optimizer state only; the frozen base
is not copied into every checkpoint. meta.json's ``source``, ``base_fingerprint`` and ``config.model`` point to
the base, which is checked at resume and read again by ``moe-tune-export`` (``--base`` if it moved).

run_state.py  RunState (what a checkpoint takes), Resumed (what a resume returns)
save.py       save, prepare_save: stage, write (inline or in the background), manifest and COMPLETE
load.py       maybe_resume, load: checks, then the tensors, param groups and scheduler, matched by name
resume.py     the global batch a resume keeps; hyperparameters given anew, written in before the load
fit.py        whether a checkpoint's settings fit this run's model
state.py      the layout-free names of the tensors, param groups and scheduler lists
read.py       read_meta, load_model_weights: a checkpoint outside training (export, build)
start.py      what a start makes of output_dir and checkpoint.resume
manifest.py   COMPLETE's sizes and checksums; picking the checkpoint to resume from
background.py CheckpointSaver: one save in flight, written on a thread
safe.py       loading that never unpickles anything but allowlisted classes
"""

from __future__ import annotations

from moe_tune.checkpoint import manifest
from moe_tune.checkpoint.background import CheckpointSaver
from moe_tune.checkpoint.load import load, maybe_resume
from moe_tune.checkpoint.manifest import COMPLETE
from moe_tune.checkpoint.read import load_model_weights, read_meta
from moe_tune.checkpoint.resume import keep_global_batch, other_source_message
from moe_tune.checkpoint.run_state import Resumed, RunState
from moe_tune.checkpoint.save import prepare_save, save
from moe_tune.checkpoint.start import RUN_OUTPUTS, RunFinished, check_resumed_base, check_start, set_aside_later


def latest(run_dir: str) -> str | None:
    """The complete checkpoint with the highest step (not checked: ``manifest.pick`` checks)."""
    return next(iter(manifest.complete_checkpoints(run_dir)), None)


__all__ = [
    "COMPLETE",
    "RUN_OUTPUTS",
    "CheckpointSaver",
    "Resumed",
    "RunState",
    "RunFinished",
    "check_resumed_base",
    "check_start",
    "set_aside_later",
    "keep_global_batch",
    "latest",
    "load",
    "load_model_weights",
    "maybe_resume",
    "other_source_message",
    "prepare_save",
    "read_meta",
    "save",
]

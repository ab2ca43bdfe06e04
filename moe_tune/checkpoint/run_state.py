"""What checkpointing takes from the run that owns the state, and what a resume gives back.

The trainer hands ``RunState`` (its stateful components and what identifies the run) to ``save`` and
``maybe_resume``, as torchtitan's CheckpointManager takes its ``states``: the checkpoint reads them, and a load
goes into each component through its own ``load_state_dict``. A resume returns ``Resumed`` (the step and batch
layout to continue with, the hyperparameters this run changed), which the trainer applies itself: nothing in
moe_tune.checkpoint writes into the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_tune.config import Config
from moe_tune.distributed.dims import BatchLayout


@dataclass(frozen=True)
class RunState:
    """The stateful components (model, optimizer, scheduler), the data position's layout (step s reads the rows
    after s x ``layout.rows_per_step``), and the run's ``cfg`` (meta.json's ``config``; what a resume checks and
    applies), ``rank``, ``source`` (the model's checkpoint directory: a LoRA base is fingerprinted),
    ``chat_template`` (data.chat_template's text, which moe-tune-export writes) and ``data_rows`` (the training
    set's ``identity()``: a resume compares it, to name data that changed in place)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    cfg: Config
    layout: BatchLayout
    rank: int = 0
    source: str | None = None
    chat_template: str | None = None
    data_rows: dict | None = None


@dataclass(frozen=True)
class Resumed:
    """A load's result for its owner: the checkpoint's ``step``, the ``layout`` to train on (the checkpoint's
    global batch kept), and ``changes``, this run's settings that differ from the checkpoint's and now apply
    (``"section.key old -> new"``, as logged)."""

    path: str
    step: int
    layout: BatchLayout
    changes: tuple[str, ...] = ()

"""The starting checkpoint of a tiny preset (``model=tiny_*``): rank 0 builds it inside ``output_dir`` as
``base_model/``, and checkpoints and exported adapters name it as their base.

A ``base_model/`` built earlier for other settings is set aside, not deleted, until the run that replaced it either
starts (it goes) or is refused while it starts (it comes back).
"""

from __future__ import annotations

import json
import logging
import os
import shutil

from moe_tune.models.source_check import config_differences

log = logging.getLogger("moe_tune")

BASE_MODEL = "base_model"  # a tiny preset's starting checkpoint, built by rank 0 inside output_dir
# An earlier base_model/ built for other settings, kept until the run that replaced it starts (a refused run puts it
# back: restore_base_model).
SET_ASIDE_BASE_MODEL = ".base_model.set_aside"


def drop_stale_base_model(path: str, name: str, overrides: dict, seed: int) -> None:
    """A ``base_model/`` built earlier for another preset, other ``model.overrides`` or drawn with another
    ``train.seed`` is set aside (and rebuilt by the caller): it would otherwise silently win over the config asked
    for. It is the base of that earlier run's
    checkpoints, so it is only moved (to ``SET_ASIDE_BASE_MODEL`` beside it): a run refused while it starts puts it
    back (``restore_base_model``), one that starts deletes it (``discard_set_aside_base_model``)."""
    from transformers import AutoConfig

    from moe_tune.models.presets import PRESETS

    if not os.path.isfile(os.path.join(path, "config.json")):
        return
    try:
        saved = AutoConfig.from_pretrained(path)
    except (OSError, ValueError):  # unreadable: rebuilt like a stale one
        saved = None
    requested = {**PRESETS.get(name, {}), **overrides}
    diffs = ["config.json unreadable"] if saved is None else config_differences(saved, requested)
    drawn = drawn_with_seed(path)
    if drawn is not None and drawn != seed:
        diffs.append(f"train.seed: {drawn} -> {seed}")
    if diffs:
        log.warning("%s was built for other model settings (%s); rebuilding it", path, "; ".join(diffs))
        aside = os.path.join(os.path.dirname(path), SET_ASIDE_BASE_MODEL)
        shutil.rmtree(aside, ignore_errors=True)  # left by a run that neither started nor was refused (killed)
        os.replace(path, aside)


def drawn_with_seed(path: str) -> int | None:
    """The train.seed a tiny preset's ``base_model/`` was drawn with; None where it does not say."""
    from moe_tune.models.hf_io import DRAWN_WITH

    try:
        with open(os.path.join(path, DRAWN_WITH)) as f:
            seed = json.load(f).get("seed")
    except (OSError, ValueError, AttributeError):
        return None
    return seed if isinstance(seed, int) else None


def restore_base_model(output_dir: str) -> None:
    """A run refused while it started: the ``base_model/`` it set aside comes back in place of the one it built."""
    aside = os.path.join(output_dir, SET_ASIDE_BASE_MODEL)
    if os.path.isdir(aside):
        path = os.path.join(output_dir, BASE_MODEL)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(aside, path)


def discard_set_aside_base_model(output_dir: str) -> None:
    """A run that started (rank 0): the earlier ``base_model/`` it replaced goes."""
    shutil.rmtree(os.path.join(output_dir, SET_ASIDE_BASE_MODEL), ignore_errors=True)

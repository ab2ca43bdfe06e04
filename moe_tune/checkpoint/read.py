"""Reading a complete checkpoint outside training: its meta.json and ``Config`` (``read_meta``), and its model
tensors alone (``load_model_weights``), at any layout: what moe-tune-export and ``moe_tune.build`` use."""

from __future__ import annotations

import json
import os

from moe_tune.checkpoint import manifest, safe
from moe_tune.checkpoint.manifest import COMPLETE
from moe_tune.checkpoint.state import model_entries, names_match, restore_model
from moe_tune.config import CheckpointError, ConfigError

LOAD = "load it with transformers (a LoRA adapter with PEFT, whose merge_and_unload() merges it)"


def instead(path: str) -> str:
    """What to give instead of a run directory, its checkpoints/ folder or a Hugging Face export ("" for none)."""
    parent, name = os.path.split(os.path.normpath(path))
    if name == "checkpoints" and (found := manifest.complete_checkpoints(parent)):
        return f"; {path} is a run's checkpoints folder: give one of its checkpoints, e.g. {_newest(parent, found)}"
    found = manifest.complete_checkpoints(path)
    if found:
        return f"; {path} is a run directory: give one of its checkpoints, e.g. {_newest(path, found)}"
    if _is_run_dir(path):  # before _is_export: a run directory's config.json is the run's config, not a model's
        hf = os.path.join(path, "hf")
        what = (
            f"{path} is a run directory without checkpoints (checkpoint.every=0, or the run stopped before its first)"
        )
        if _is_export(hf):
            return f"; {what}: its Hugging Face export is {hf}; {LOAD}"
        return f"; {what} and without a Hugging Face export: rerun with checkpoint.every=N"
    if _is_export(path):
        run = os.path.dirname(os.path.normpath(path))
        of_run = manifest.complete_checkpoints(run)
        if of_run:
            return (
                f"; {path} is the Hugging Face export of the run in {run}: give one of its checkpoints, e.g. "
                f"{_newest(run, of_run)}"
            )
        return f"; {path} is a Hugging Face export, not a checkpoint: rerun with checkpoint.every=N, or {LOAD}"
    return ""


def _newest(run: str, found: list[str]) -> str:
    """The run's newest checkpoint ``found[0]``; where the run ended past it (summary.json's final_step: saved every
    N steps, or on a signal, then resumed to its end), what holds the end instead (its hf/ export)."""
    step, ended = manifest.saved_step(found[0]), None
    try:
        with open(os.path.join(run, "summary.json")) as f:
            ended = json.load(f).get("final_step")
    except (OSError, ValueError, AttributeError):
        pass
    if step is None or not isinstance(ended, int) or ended <= step:
        return found[0]
    hf = os.path.join(run, "hf")
    end = f"step {ended} is only in {hf}: {LOAD}" if _is_export(hf) else f"no checkpoint or export holds step {ended}"
    return f"{found[0]}, though that is step {step} and the run ended at step {ended} (summary.json); {end}"


def check_resume_path(resume: str) -> None:
    """``checkpoint.resume`` naming a directory: a complete checkpoint, else a ConfigError naming what to give
    (before the run reads its data or writes anything)."""
    if resume not in ("auto", "none") and os.path.isdir(resume) and not os.path.isfile(os.path.join(resume, COMPLETE)):
        raise ConfigError(
            f"checkpoint.resume={resume} is not a complete checkpoint (no {COMPLETE} file){instead(resume)}"
        )


def _is_export(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, name)) for name in ("config.json", "adapter_config.json"))


def _is_run_dir(path: str) -> bool:
    """A moe-tune run's output_dir: its export in hf/, or the files a run writes as it trains."""
    return _is_export(os.path.join(path, "hf")) or any(
        os.path.isfile(os.path.join(path, name)) for name in ("metrics.jsonl", "summary.json")
    )


def read_meta(path: str):
    """(meta.json, the run's ``Config``) of a complete checkpoint; CheckpointError naming what is missing."""
    from omegaconf import OmegaConf

    from moe_tune.config import Config, comm_config

    meta_path = os.path.join(path, "meta.json")
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint {path} does not exist; give a run's checkpoints/step_<N> directory")
    if not os.path.isfile(os.path.join(path, COMPLETE)) or not os.path.isfile(meta_path):
        raise CheckpointError(
            f"{path} is not a complete moe-tune checkpoint (needs meta.json and {COMPLETE}){instead(path)}"
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

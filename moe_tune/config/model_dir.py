"""What is wrong with a ``model.path`` that holds no ``config.json``, as one line with the fix: a Hugging Face hub id
(moe_tune downloads nothing), a file, a PEFT adapter directory (named with its base model) or another directory.
Reads only directory listings and ``adapter_config.json``; imports nothing heavy."""

from __future__ import annotations

import json
import os
import re

# owner/name, as the hub spells repository ids; a path that starts with . / or ~ is never one.
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def model_dir_problem(path: str, key: str = "model.path") -> str | None:
    """None when ``path`` holds a config.json; else the line saying what ``path`` is and what to give instead."""
    run = _run_problem(path, key)
    if run is not None:
        return run
    if os.path.isfile(os.path.join(path, "config.json")):
        return None
    if not os.path.exists(path):
        typo = _local_typo(path, key)
        if typo:
            return typo
        full = os.path.abspath(os.path.expanduser(path))
        where = "" if full == path else f" (no directory {full})"
        hub_id = path if HUB_ID.fullmatch(path) else "<hub id>"
        return (
            f"{key}={path} does not exist{where}; moe_tune reads local checkpoints only and downloads nothing from "
            f"the Hugging Face hub: download it first (hf download {hub_id} --local-dir <dir>), then give {key}=<dir>"
        )
    if not os.path.isdir(path):
        return f"{key}={path} is a file; give a local Hugging Face checkpoint directory (config.json, *.safetensors)"
    if os.path.isfile(os.path.join(path, "adapter_config.json")):
        return _adapter_problem(path, key)
    return f"{key}={path} has no config.json; give a local Hugging Face checkpoint directory"


def _local_typo(path: str, key: str) -> str | None:
    """A missing path whose parent directory exists here, and that has a close name there or looks like a hub id
    (``my/ckp``, with ``my/`` here), is a local path mistyped: the parent's entries closest to its last part."""
    import difflib

    parent, name = os.path.split(os.path.expanduser(path.rstrip("/")))
    if not parent or not os.path.isdir(parent):
        return None
    close = difflib.get_close_matches(name, sorted(os.listdir(parent)), n=3, cutoff=0.6)
    if not close and not HUB_ID.fullmatch(path):
        return None
    hint = f"did you mean {' or '.join(os.path.join(parent, c) for c in close)}?" if close else "check the path"
    return f"{key}={path} does not exist (the directory {parent} does, without {name}); {hint}"


def _run_problem(path: str, key: str) -> str | None:
    """A moe-tune run's output_dir (its config.json is moe_tune's, not a model's) or one of its checkpoints: the
    model it exported, or how to export one."""
    if os.path.isfile(os.path.join(path, "metrics.jsonl")) or os.path.isdir(os.path.join(path, "checkpoints")):
        hf = os.path.join(path, "hf")
        if os.path.isfile(os.path.join(hf, "config.json")):
            return f"{key}={path} is a moe-tune run directory, not a model: its exported model is {hf}: give {key}={hf}"
        if os.path.isfile(os.path.join(hf, "adapter_config.json")):
            return _adapter_problem(hf, key)
        export = f"moe-tune-export {_newest_checkpoint(path)} <dir>"
        return f"{key}={path} is a moe-tune run directory with no exported model: run {export} and give {key}=<dir>"
    parent = os.path.dirname(os.path.abspath(path))
    if re.fullmatch(r"step_\d+", os.path.basename(os.path.abspath(path))) and os.path.basename(parent) == "checkpoints":
        return (
            f"{key}={path} is a moe-tune training checkpoint, not a model: export it (moe-tune-export {path} <dir>, "
            f"--merge for LoRA) and give {key}=<dir>; to continue that run, rerun it with output_dir="
            f"{os.path.dirname(parent)}"
        )
    return None


def _adapter_problem(path: str, key: str) -> str:
    """A PEFT adapter directory (moe-tune-export's output for a LoRA run): its base model and how to merge it."""
    try:
        with open(os.path.join(path, "adapter_config.json"), encoding="utf-8") as f:
            adapter = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        adapter = {}
    adapter = adapter if isinstance(adapter, dict) else {}
    names = {"LORA": "LoRA"}  # PEFT's peft_type as its docs spell it
    peft_type = adapter.get("peft_type")
    kind = f"PEFT {names.get(peft_type, peft_type)}" if isinstance(peft_type, str) else "PEFT"
    base = adapter.get("base_model_name_or_path")
    use_base = (
        f"its base model is {base} (adapter_config.json's base_model_name_or_path): give {key}={base}"
        if base
        else f"its adapter_config.json names no base model: give {key}=<the base model's directory>"
    )
    checkpoint = _newest_checkpoint(os.path.dirname(os.path.abspath(path)))
    return (
        f"{key}={path} is a {kind} adapter (adapter_config.json, no config.json), not a full model; {use_base}, or "
        f"merge the adapter into its base first (moe-tune-export {checkpoint} <dir> --merge, or PEFT's "
        f"merge_and_unload) and give {key}=<dir>"
    )


def _newest_checkpoint(run_dir: str) -> str:
    """``<run_dir>/checkpoints/step_<N>`` of the highest N there, or a placeholder for the run's checkpoint."""
    checkpoints = os.path.join(run_dir, "checkpoints")
    steps = [n for n in os.listdir(checkpoints) if re.fullmatch(r"step_\d+", n)] if os.path.isdir(checkpoints) else []
    if not steps:
        return "<run>/checkpoints/step_<N>"
    return os.path.join(checkpoints, max(steps, key=lambda n: int(n.split("_")[1])))


__all__ = ["model_dir_problem"]

"""Whether a checkpoint fits this run's model, said in the settings that differ (meta.json's ``config``), not in
tensor names.

Before anything is loaded: a checkpoint of another ``peft`` (LoRA vs none, another rank, target or
``train_router``) holds other tensors, always; refused naming those settings on both sides. The model's settings
(``model.name``, ``path``, ``overrides``, ``family``) may differ and still fit (a base moved to another path, an
override that changes no shape), so they are named only when the tensors then do not match (``mismatch_fix``);
where meta.json names no difference, the parameter-level message stands alone.
"""

from __future__ import annotations

import os
from dataclasses import asdict

from moe_tune.config import CheckpointError

# The settings a checkpoint's tensors follow: their names (peft.name, target, train_router) and LoRA's shapes.
PEFT_KEYS = ("name", "rank", "target", "train_router")
MODEL_KEYS = ("name", "path", "overrides", "family")
# The data settings that decide which rows a run reads (data.cache_dir and num_proc do not), with train.seq_len
# and train.seed (the same records made into other rows).
DATA_KEYS = (
    "name",
    "path",
    "num_samples",
    "format",
    "chat_template",
    "train_on",
    "prompt_key",
    "response_key",
    "text_key",
    "packing",
    "packing_strategy",
    "packing_buffer",
    "streaming",
    "on_bad_record",
    "val_path",
    "val_fraction",
)

# The hyperparameters that decide what a run's steps compute (a resume may change them, said in its log).
TRAIN_KEYS = ("lr", "precision", "aux_loss_coef", "z_loss_coef", "bias_update_rate", "force_balanced_routing")
OPTIM_KEYS = (
    "weight_decay",
    "decay_norms_and_biases",
    "betas",
    "eps",
    "warmup_steps",
    "schedule",
    "min_lr_ratio",
    "max_grad_norm",
)


def override_value(value) -> str:
    """A value as a Hydra override writes it."""
    if value is None:
        return "null"
    if isinstance(value, list | tuple):
        return "[" + ",".join(override_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{override_value(v)}" for k, v in value.items()) + "}"
    return str(value)


def _differing(saved: dict, now: dict, section: str, keys) -> tuple[str, str]:
    """("section.key=saved, ...", "section.key=now, ...") over the keys whose values differ; ("", "") if none."""
    keys = [k for k in keys if saved.get(k, now[k]) != now[k]]
    was = ", ".join(f"{section}.{k}={override_value(saved[k])}" for k in keys)
    return was, ", ".join(f"{section}.{k}={override_value(now[k])}" for k in keys)


def _peft_differs(saved: dict, now: dict) -> tuple[str, str]:
    if saved.get("name", "none") != now["name"]:  # a group, chosen as peft=lora on the command line
        return tuple(side.replace("peft.name=", "peft=") for side in _differing(saved, now, "peft", ["name"]))
    return _differing(saved, now, "peft", PEFT_KEYS[1:]) if now["name"] != "none" else ("", "")


def _own(cfg, path: str) -> bool:
    """``path`` is a checkpoint of this run's output_dir (not another run's, named by checkpoint.resume)."""
    out, path = os.path.realpath(cfg.output_dir), os.path.realpath(path)
    return os.path.commonpath([out, path]) == out


def _fix(cfg, path: str, was: str) -> str:
    resume = f"resume with the checkpoint's settings ({was})" if was else "resume with the model it was saved from"
    if _own(cfg, path):
        return f"{resume}, or train this model in another output_dir (checkpoint.resume=none starts afresh over it)"
    return f"{resume}, or train this model from its start, without checkpoint.resume={path}"


def check_settings(meta: dict, cfg, path: str) -> None:
    """CheckpointError (one line) when the checkpoint's peft settings are not this run's: its tensors cannot fit."""
    was, now = _peft_differs(meta["config"].get("peft", {}), asdict(cfg.peft))
    if was:
        raise CheckpointError(
            f"checkpoint {path} does not fit this run's model (checkpoint: {was}; this run: {now}); "
            f"{_fix(cfg, path, was)}"
        )


def mismatch_fix(meta: dict, cfg, path: str) -> str:
    """What follows a parameter-level mismatch of ``path``: the model settings that differ, and the fix."""
    saved, now = meta["config"].get("model", {}), asdict(cfg.model)
    keys = MODEL_KEYS if saved.get("name", now["name"]) == now["name"] else MODEL_KEYS[:-1]  # family: the preset's
    was, now = (side.replace("model.name=", "model=") for side in _differing(saved, now, "model", keys))
    fix = _fix(cfg, path, was)
    return f"The checkpoint has {was}; this run has {now}: {fix}" if was else fix[0].upper() + fix[1:]


def settings_differ(saved: dict, cfg) -> tuple[str, str]:
    """The settings of the model a run trained that this run's ``cfg`` does not share, both sides as overrides
    ("", "" if none): its peft settings (``quantize_base`` aside: the same adapters) and its model (name, path,
    overrides). ``saved``: the run's recorded config (summary.json's or meta.json's)."""
    was, now = _peft_differs(saved.get("peft", {}), asdict(cfg.peft))
    model, this = dict(saved.get("model", {})), asdict(cfg.model)
    for side in (model, this):  # one directory, however it was spelt
        if side.get("path"):
            side["path"] = os.path.realpath(side["path"])
    model_was, model_now = (
        part.replace("model.name=", "model=") for part in _differing(model, this, "model", MODEL_KEYS[:-1])
    )
    return ", ".join(x for x in (was, model_was) if x), ", ".join(x for x in (now, model_now) if x)


def data_differ(saved: dict, cfg) -> tuple[str, str]:
    """The data settings (``DATA_KEYS``, ``train.seq_len``, ``train.seed``) of a run's recorded config ``saved``
    that this run's ``cfg`` does not share, both sides as overrides ("", "" if none); paths however spelt."""
    data, this = dict(saved.get("data", {})), asdict(cfg.data)
    for side in (data, this):
        for key in ("path", "val_path", "chat_template"):
            if side.get(key) and os.path.exists(side[key]):
                side[key] = os.path.realpath(side[key])
    was, now = _differing(data, this, "data", [k for k in DATA_KEYS if k in this])
    train, t = saved.get("train", {}), asdict(cfg.train)
    rows_was, rows_now = _differing(train, t, "train", ("seq_len", "seed"))
    return ", ".join(x for x in (was, rows_was) if x), ", ".join(x for x in (now, rows_now) if x)


def hyperparameters_differ(saved: dict, cfg) -> tuple[str, str]:
    """The training hyperparameters (``TRAIN_KEYS``, ``OPTIM_KEYS``) of a run's recorded config ``saved`` that this
    run's ``cfg`` does not share, both sides as overrides ("", "" if none)."""
    train, optim = saved.get("train", {}), dict(saved.get("optim", {}))
    now = asdict(cfg.optim)
    optim["betas"], now["betas"] = list(optim.get("betas", now["betas"])), list(now["betas"])  # JSON has no tuple
    was, this = _differing(train, asdict(cfg.train), "train", TRAIN_KEYS)
    optim_was, optim_now = _differing(optim, now, "optim", OPTIM_KEYS)
    return ", ".join(x for x in (was, optim_was) if x), ", ".join(x for x in (this, optim_now) if x)

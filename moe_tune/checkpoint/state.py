"""The state a training checkpoint holds, named so that it does not depend on the layout it was saved at.

Tensors (DCP shards) are keyed by the fully qualified name (FQN) of their parameter: ``model.<fqn>`` for the
weights and buffers, ``optim.<fqn>.<name>`` for the optimizer's state (AdamW's ``exp_avg``, ``exp_avg_sq``,
``step``; the stochastic-rounding AdamW keeps the same keys). Stacked expert tensors, weights and moments alike,
are stored one expert per key, ``<key>@<j>`` with j the global expert index: each rank reads and writes the
experts it holds, however ep and FSDP split them (whole experts per rank: experts / ep divisible by efsdp). The
per-expert entries are views of the live tensors, so DCP reads straight into place.

Hyperparameters (lr, betas, eps, weight_decay, initial_lr) live in meta.json's ``param_groups``, each group with
its parameters' FQNs. The number and order of groups changes with the layout (with EP the plain expert tensors
outside FSDP2 form a group of their own, ``moe_tune.optim.param_groups``), so each current group takes the
hyperparameters of the saved group that held its parameters, never the group at its position; the scheduler's
per-group lists (``base_lrs``, ``_last_lr``) follow the same matching. A checkpoint whose parameter names differ
from the model's is a CheckpointError naming one missing and one unexpected name.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable

import torch

from moe_tune.checkpoint.fit import override_value
from moe_tune.config import CheckpointError
from moe_tune.models.hf_io import EXPERT_PARAM, expert_offsets, local_rows

# LambdaLR's lists with one entry per param group, in the optimizer's group order.
SCHEDULER_PER_GROUP = ("base_lrs", "_last_lr", "lr_lambdas")


# A checkpoint of another model in output_dir: the safe fix first (checkpoint.resume=none starts over that run).
_MISMATCH_FIX = (
    "Resume it with the model it was saved from (model.* in its meta.json), or train this model in another "
    "output_dir (checkpoint.resume=none would start afresh over that run)"
)


def split_experts(flat: dict, offsets: dict[str, int], fqn_of=lambda k: k) -> dict:
    """Replace each stacked expert entry by one view per expert, keyed by global expert index."""
    out = {}
    for key, value in flat.items():
        fqn = fqn_of(key)
        if EXPERT_PARAM.match(fqn) and isinstance(value, torch.Tensor) and value.dim() >= 2:
            local, first = local_rows(value)
            for i in range(local.shape[0]):
                out[f"{key}@{offsets.get(fqn, 0) + first + i}"] = local[i]
        else:
            out[key] = value
    return out


def is_extra_state(key: str) -> bool:
    return key.endswith("_extra_state")


def frozen_names(model: torch.nn.Module) -> set[str]:
    """Parameters that do not train (LoRA's base): a checkpoint does not hold them, the base model does. Every name
    of a shared parameter counts: tied embeddings are in the state dict as ``lm_head.weight`` too."""
    return {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}


def model_entries(model: torch.nn.Module, model_sd: dict) -> dict:
    """``model.<fqn>`` entries of a model state dict (experts split, modules' extra state and frozen parameters
    left out)."""
    frozen = frozen_names(model)
    kept = {k: v for k, v in model_sd.items() if not is_extra_state(k) and k not in frozen}
    return {f"model.{k}": v for k, v in split_experts(kept, expert_offsets(model)).items()}


RESUME_BASE_FIX = "resume with that base (model.path=<its directory>), or start afresh with checkpoint.resume=none"


def missing_base(checkpoint: str, source: str, given: bool) -> str:
    """The line for a LoRA checkpoint's base that is no model directory: not there, or there without config.json
    (e.g. an adapter directory, a run's hf/); ``given``: ``source`` is what --base named."""
    there = "holds no config.json" if os.path.isdir(source) else "does not exist"
    if os.path.isfile(os.path.join(source, "adapter_config.json")):
        there += " (a PEFT adapter directory, not its base model)"
    if given:
        return f"--base {source} {there}; give --base the directory of the base model {checkpoint} was trained from"
    return (
        f"checkpoint {checkpoint} holds LoRA adapters of the base model {source}, which {there}; put the base model "
        "back at that path, or give its new place with --base <dir>"
    )


def check_base(
    meta: dict, model_cfg: dict, seed: int, source: str | None, path: str, fix: str = RESUME_BASE_FIX
) -> None:
    """A checkpoint of adapters (LoRA) resumes only onto the base it was trained on: a base read from files must
    have the same fingerprint (``base_fingerprint``: config.json and samples of the weight files; the directory
    may have moved); a built-in model drawn at random the same name, overrides and seed. CheckpointError naming
    both otherwise."""
    from moe_tune.models.source_check import base_fingerprint

    saved_fingerprint = meta.get("base_fingerprint")
    if saved_fingerprint is not None and source is not None:
        if base_fingerprint(source) != saved_fingerprint:
            check_drawn_alike(meta, model_cfg, seed, source, path, fix)
            trained_on = meta.get("source")
            if trained_on and os.path.realpath(trained_on) == os.path.realpath(source):
                what = f"{source} have changed since the adapters were trained on them"
            else:
                what = f"{source} differ from those of {trained_on}, which they were trained on"
            raise CheckpointError(
                f"checkpoint {path} holds LoRA adapters of another base model: the config.json or weight files of "
                f"{what}; {fix}"
            )
        return
    saved = meta["config"]["model"]
    keys = ("name", "path", "overrides")
    same = all(saved.get(k) == model_cfg.get(k) for k in keys) and meta["config"]["train"].get("seed") == seed
    if not same:
        was = {k: saved.get(k) for k in keys} | {"seed": meta["config"]["train"].get("seed")}
        now = {k: model_cfg.get(k) for k in keys} | {"seed": seed}
        raise CheckpointError(
            f"checkpoint {path} holds LoRA adapters of the base model {was}, but this run's base is {now}; resume "
            "with the model it was trained on, or start afresh with checkpoint.resume=none"
        )


def check_drawn_alike(
    meta: dict, model_cfg: dict, seed: int, source: str, path: str, fix: str = RESUME_BASE_FIX
) -> None:
    """CheckpointError naming the settings (``drawn_differently``) with which this run draws its built-in base
    ``source`` otherwise than the base the checkpoint's adapters were trained on, and the checkpoint's values."""
    if drawn := drawn_differently(meta, model_cfg, seed):
        now, was = (" ".join(side) for side in zip(*drawn))
        raise CheckpointError(
            f"checkpoint {path} holds LoRA adapters of another base model: this run draws {source} with "
            f"{now}, and they were trained on one drawn with {was}; give {was}, or {fix}"
        )


def drawn_differently(meta: dict, model_cfg: dict, seed: int) -> list[tuple[str, str]]:
    """Where the checkpoint's run and this one both draw a built-in model (no ``model.path``): the settings that draw
    it differently, as (this run's, the checkpoint's) overrides (``train.seed=1``, ``train.seed=0``); [] otherwise."""
    saved = meta["config"]["model"]
    if not model_cfg or saved.get("path") is not None or model_cfg.get("path") is not None:
        return []
    pairs = [
        ("model", saved.get("name"), model_cfg.get("name")),
        ("model.overrides", saved.get("overrides"), model_cfg.get("overrides")),
        ("train.seed", meta["config"]["train"].get("seed"), seed),
    ]
    return [(f"{key}={override_value(now)}", f"{key}={override_value(was)}") for key, was, now in pairs if was != now]


def flat_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict, dict]:
    """(everything DCP saves and loads, flat; the model state dict; the optimizer state dict keyed by FQN).
    Modules' extra state (TransformerEngine's FP8 scaling history: a pickled uint8 tensor whose length changes
    once FP8 has run) is left out: DCP loads into tensors of the current size. It is saved per rank instead."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    offsets = expert_offsets(model)
    flat = model_entries(model, model_sd)
    for fqn, state in optim_sd["state"].items():
        for name, value in state.items():
            key = f"optim.{fqn}.{name}"
            if EXPERT_PARAM.match(fqn) and isinstance(value, torch.Tensor) and value.dim() >= 2:
                flat.update(split_experts({key: value}, offsets, fqn_of=lambda k, f=fqn: f))
            else:
                flat[key] = value
    return flat, model_sd, optim_sd


def restore_model(flat: dict, model_sd: dict) -> None:
    """After ``dcp.load(flat)``: the entries DCP replaced back into ``model_sd``. Expert entries were views:
    the stacked tensors are filled already."""
    for key, value in flat.items():
        if key.startswith("model.") and "@" not in key:
            model_sd[key[len("model.") :]] = value


def check_names(names: Iterable[str], saved: Iterable[str], path: str, fix: str = _MISMATCH_FIX) -> None:
    """CheckpointError unless the model's parameter names and the checkpoint's are the same set."""
    names, saved = list(names), set(saved)
    missing = [n for n in names if n not in saved]
    unexpected = sorted(saved - set(names))
    if not missing and not unexpected:
        return
    what = []
    if missing:
        what.append(f"it has no parameter {missing[0]} ({len(missing)} of the model's missing)")
    if unexpected:
        what.append(f"it has a parameter {unexpected[0]} the model lacks ({len(unexpected)} unexpected)")
    raise CheckpointError(f"checkpoint {path} does not match the model: {'; '.join(what)}. {fix}")


def _hypers(group: dict) -> dict:
    """A saved group's hyperparameters, with betas as a tuple again (meta.json holds a list)."""
    out = {k: v for k, v in group.items() if k != "params"}
    if isinstance(out.get("betas"), list):
        out["betas"] = tuple(out["betas"])
    return out


def param_groups_by_name(
    current: list[dict], saved: list[dict], path: str, fix: str = _MISMATCH_FIX
) -> tuple[list[dict], list[int]]:
    """(``current``'s groups, each with the hyperparameters of the saved group that held its parameters; for each
    current group the index of that saved group). Groups' ``params`` are FQNs (DCP's optimizer state dict)."""
    owner = {fqn: i for i, group in enumerate(saved) for fqn in group["params"]}
    check_names([fqn for group in current for fqn in group["params"]], owner, path, fix)
    groups, mapping = [], []
    for group in current:
        sources = sorted({owner[fqn] for fqn in group["params"]}) or [0]
        hypers = _hypers(saved[sources[0]])
        for i in sources[1:]:
            if _hypers(saved[i]) != hypers:
                raise CheckpointError(
                    f"checkpoint {path}: parameters {group['params'][0]} and {saved[i]['params'][0]}, in one param "
                    f"group now, were saved with different hyperparameters ({hypers} vs {_hypers(saved[i])})"
                )
        groups.append({**hypers, "params": group["params"]})
        mapping.append(sources[0])
    return groups, mapping


def scheduler_by_name(state: dict, mapping: list[int], num_saved: int, path: str) -> dict:
    """The scheduler's state with its per-group lists reordered to the current groups (``mapping``)."""
    out = dict(state)
    for key in SCHEDULER_PER_GROUP:
        value = state.get(key)
        if value is None:
            continue
        if not isinstance(value, list) or len(value) != num_saved:
            raise CheckpointError(
                f"checkpoint {path}: the scheduler's {key} has {len(value) if isinstance(value, list) else value!r} "
                f"entries, not one per saved param group ({num_saved}); meta.json is not one moe-tune wrote"
            )
        out[key] = [value[i] for i in mapping]
    return out


@contextlib.contextmanager
def names_match(path: str, fix: str = _MISMATCH_FIX):
    """Around ``dcp.load``: a tensor the checkpoint lacks (an expert index past its experts) or holds at another
    size becomes a CheckpointError naming it, not DCP's traceback of every rank."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as e:
        for exc, _ in e.failures.values():
            if isinstance(exc, (RuntimeError, ValueError)) and str(exc).startswith(("Missing key", "Size mismatch")):
                raise CheckpointError(f"checkpoint {path} does not match the model: {exc} {fix}") from None
        raise


def extra_state_file(path: str, rank: int) -> str:
    """Where rank ``rank`` keeps its modules' extra state in checkpoint ``path``."""
    return os.path.join(path, f"extra_state.rank{rank}.pt")

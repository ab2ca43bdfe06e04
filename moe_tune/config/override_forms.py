"""Hydra's ``+key=`` and ``~key`` forms on a key of the schema, whose keys are fixed: one line naming the form to
write instead."""

from __future__ import annotations

from moe_tune.config import ConfigError
from moe_tune.config.constraints import spelled


def refuse_add_or_delete(o, key: str, cfg) -> None:
    """ConfigError for ``+key=value`` (the key exists: set it without the +) or ``~key`` (no key is removed: leave
    the override out for the default); nothing for ``key=value`` or ``++key=value``."""
    from hydra.core.override_parser.types import OverrideType
    from omegaconf import Container, OmegaConf

    if o.type == OverrideType.ADD:
        raise ConfigError(f"+{key}: {key} is already a key; write {key}=<value> without the +")
    if o.type == OverrideType.DEL:
        default = OmegaConf.select(cfg, key)
        if isinstance(default, Container):
            default = OmegaConf.to_container(default)
        raise ConfigError(
            f"~{key}: the config's keys are fixed by its schema, so ~ removes none; leave out {o.input_line} for "
            f"{key}'s default ({spelled(default)}), or give {key}=<value>"
        )

"""Override forms read before composing: ``+key=`` and ``~key`` on a key of the schema, whose keys are fixed (one
line naming the form to write instead), a misspelt ``hydra/launcher``, and a value naming a home directory (``~/x``,
expanded as bash would)."""

from __future__ import annotations

import os
import re

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


def user_overrides(parsed: list, options: dict[str, list[str]]) -> list:
    """The overrides of the app's config (``hydra.*`` and ``hydra/...`` are Hydra's), once a launcher chosen by
    name (``hydra/launcher=submitit_slurm``, a group ``moe-tune --help`` lists) is found among its options."""
    from moe_tune.config.constraints import spelled_alike

    for o in parsed:
        launchers = options.get(o.key_or_group) if o.key_or_group == "hydra/launcher" else None
        if launchers and not o.is_sweep_override() and o.value() not in launchers:
            alike = spelled_alike(o.value(), launchers)
            extra = f"; did you mean hydra/launcher={alike[0]}?" if len(alike) == 1 else ""
            raise ConfigError(f"hydra/launcher={o.value()} is not one of {', '.join(launchers)}{extra}")
    return [o for o in parsed if not o.key_or_group.startswith("hydra")]


# A value naming a home directory as a shell would expand it: ~/x, ~user/x, ~ (quoted or not; no sweep a,b).
HOME_VALUE = re.compile(r"""^(['"]?)(~[\w.-]*(?:/[^,]*)?)\1$""")


def expand_home(override: str) -> str:
    """``key=~/x`` with the home directory expanded, as bash expands it and zsh or quotes do not: Hydra's grammar
    refuses ``~`` in an unquoted value, and a quoted one would name a directory called ``~``."""
    key, sep, value = override.partition("=")
    match = HOME_VALUE.match(value)
    if not sep or match is None:
        return override
    path = os.path.expanduser(match.group(2))
    return override if re.search(r"['\"\\]", path) else f"{key}='{path}'"

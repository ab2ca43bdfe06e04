"""Override forms read before composing: ``+key=`` and ``~key`` on a key of the schema, whose keys are fixed (one
line naming the form to write instead), a group's option it lacks (a misspelt ``experiment`` or ``hydra/launcher``),
a value naming a home directory (``~/x``, expanded as bash would), and a value Hydra's grammar reads only in quotes
(one line naming the quoted form)."""

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
    """The overrides of the app's config (``hydra.*`` and ``hydra/...`` are Hydra's), once every group chosen by
    name (``experiment=...``, ``hydra/launcher=submitit_slurm``, the groups ``moe-tune --help`` lists) is found among
    its options: Hydra takes a name an optional group lacks (``experiment``) without a word, and the run would
    train the defaults."""
    for o in parsed:
        name = o.value() if o.key_or_group in options and not o.is_sweep_override() else None
        if isinstance(name, str) and name not in options[o.key_or_group]:
            raise ConfigError(not_an_option(o.key_or_group, name, options))
    return [o for o in parsed if not o.key_or_group.startswith("hydra")]


def not_an_option(group: str, name: str, options: dict[str, list[str]]) -> str:
    """One line for ``group=name`` where the group has no such option: its options and the likely fix."""
    from moe_tune.config.constraints import spelled_alike

    extra = "; or model=hf model.path=<local Hugging Face directory>" if group == "model" else ""
    if group == "peft" and name.lower() == "qlora":  # QLoRA is LoRA over a 4-bit base
        extra = "; QLoRA is peft=lora peft.quantize_base=nf4"
    if len(alike := spelled_alike(name, options[group])) == 1:
        extra = f"; did you mean {group}={alike[0]}?"
    return f"{group}={name} is not one of {', '.join(options[group])}{extra}"


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


# A character Hydra's grammar takes in a value only inside quotes (a file named 'chat (1).jsonl', données.jsonl): not a
# letter or digit of ASCII, none of _-/\+.$%*@?|: and no space; a comma makes a sweep (checked apart).
QUOTED_ONLY = re.compile(r"[^A-Za-z0-9_/\\+.$%*@?|:, \t-]")


def grammar_error(msg: str, overrides: list[str]) -> str:
    """One line for overrides Hydra's grammar refuses (``msg``, its error): a ``key=value`` whose value the grammar
    reads only in quotes is told to be quoted, the one form it takes it in; anything else to be written as
    key=value."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    def parses(override: str) -> bool:
        try:
            OverridesParser.create().parse_overrides([override])
        except Exception:  # noqa: BLE001  (Hydra's grammar errors come in several types)
            return False
        return True

    given = next((o for o in overrides if not parses(o)), "")
    key, sep, value = given.partition("=")
    unpaired = value.count("[") != value.count("]") or value.count("{") != value.count("}")
    if sep and unpaired and (value[:1] in "[{" or value[-1:] in "]}"):  # a list or dict missing a bracket
        return f"{given}: its brackets do not pair; close each [ and {{ it opens (a list: '{key}=[a,b]', quoted)"
    char = QUOTED_ONLY.search(value)
    quoted = f"{key}='{value}'" if "'" not in value else f'{key}="{value}"'
    if not sep or char is None or '"' in value and "'" in value or not parses(quoted):
        return f"{msg}; write overrides as key=value"
    shell = f' ("{quoted}" in a shell, so that the shell passes the quotes on)' if "'" not in value else ""
    letter = char.group(0)
    what = f"with letters outside ASCII ({letter!r})" if ord(letter) > 0x7F else f"holding {letter!r}"
    return f"{given}: Hydra reads a value {what} only in quotes; write {quoted}{shell}"


def repeated_keys(overrides: list[str]) -> list[str]:
    """A note for each key the command line sets more than once to different values (Hydra takes the last without a
    word, so a script's default and the user's own value can meet unnoticed)."""
    given: dict[str, list[tuple[str, str]]] = {}
    for o in overrides:
        key, eq, value = o.partition("=")
        if eq and not key.startswith("~"):
            given.setdefault(key.lstrip("+"), []).append((o, value))
    return [
        f"{key} is given {len(seen)} times ({', '.join(o for o, _ in seen)}); the last, {seen[-1][0]}, is used"
        for key, seen in given.items()
        if len({value for _, value in seen}) > 1
    ]

"""The ``moe-tune`` command line before Hydra runs it.

Hydra's own parser tells its flags (``--cfg job``, ``-c job``, ``--package X``, ``--info defaults``...) from the
overrides; every override key is checked against the schema of the composed config, so a typo is one line naming
the closest keys, and ``+key=value`` adds no key the schema lacks (Hydra would add it and the run would ignore it);
a group option that does not exist, a value of the wrong type and any other composition error are one line too.
``--help`` lists the user's config groups (not the ``base_*`` schema entries Hydra's help shows) and the config.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import re
import typing

from moe_tune.config import COMM_CONFIGS, Config, ConfigError
from moe_tune.config.constraints import not_null
from moe_tune.config.override_forms import grammar_error, not_an_option, refuse_add_or_delete, user_overrides
from moe_tune.config.primary import (
    CONF_DIR,
    PACKAGED,
    ConfigSource,
    group_options,
    initialized,
    missing_primary,
    without_schema,
)

# OmegaConf's conversion error: "Value 'abc' of type 'str' could not be converted to Integer full_key: train.steps"
# Keys that take "auto" on moe-tune's command line: the planner's search picks them (moe_tune.plan.auto).
AUTO_KEYS = ("parallel.ep", "parallel.activation_checkpointing", "train.micro_batch_size")
TYPE_ERROR = re.compile(r"Value '(.*?)' of type '\w+' could not be converted to (\w+) full_key: (\S+)")
EXPECTED = {"Integer": "an integer", "Float": "a number", "Boolean": "true or false", "String": "a string"}
# OmegaConf's error for a bool key: "Value 'maybe' is not a valid bool (type str) full_key: data.packing"
BOOL_ERROR = re.compile(r"Value '(.*?)' is not a valid bool \(type \w+\) full_key: (\S+)")
# Flags after which Hydra prints something and runs no job.
SHOW_FLAGS = ("help", "hydra_help", "cfg", "info", "shell_completion")
# Flags that point Hydra at configs relative to its caller or a saved job: composed by Hydra alone (--config-dir and
# --config-name are composed here too: moe_tune.config.primary).
ELSEWHERE_FLAGS = ("config_path", "experimental_rerun")


# Hydra runs one of these per command.
MODE_FLAGS = {"run": "--run", "multirun": "-m", "cfg": "--cfg", "info": "--info", "shell_completion": "-sc"}


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """Hydra's own command-line parser (flags with separate values, ``--cfg job``, are flags, not overrides), with
    flags and overrides in any order. Returns the parsed arguments and the command line for Hydra: its flags first,
    then the overrides (Hydra's parser takes no flag after an override)."""
    from hydra._internal.utils import get_args_parser

    args = get_args_parser().parse_intermixed_args(argv)
    modes = [flag for key, flag in MODE_FLAGS.items() if getattr(args, key)]
    if len(modes) > 1:
        raise ConfigError(f"{' and '.join(modes)} together: Hydra runs one of {', '.join(MODE_FLAGS.values())}")
    flags = list(argv)
    for o in args.overrides:
        flags.remove(o)
    args.multirun = args.multirun or "hydra.mode=MULTIRUN" in args.overrides  # Hydra's other way to say -m
    args.overrides = choose_path_groups(args.overrides)
    return args, flags + args.overrides


# A path given without its group's choice selects the option that takes one: (group, key, option).
PATH_OPTIONS = (("data", "data.path", "jsonl"), ("model", "model.path", "hf"))


def choose_path_groups(overrides: list[str]) -> list[str]:
    """``data.path=<records>`` without a ``data=`` choice reads the user's records as ``data=jsonl``, and
    ``model.path=<dir>`` without a ``model=`` choice loads it as ``model=hf`` (the options that take a path): the
    default groups would otherwise stay in the recorded config (``data.name: arithmetic``, ``model.name:
    tiny_qwen3_moe``) of a run that trained on the file or checkpoint, and a checkpoint of another family than the
    default preset's was refused. A command-line choice also overrides an experiment's; an explicit choice stays
    (a preset with a checkpoint of another family is refused as before)."""
    keys = [o.partition("=")[0].lstrip("+~") for o in overrides]
    chosen = []
    for group, key, option in PATH_OPTIONS:
        given = any(o.startswith(f"{key}=") and o != f"{key}=null" for o in overrides)
        if given and group not in keys:
            chosen.append(f"{group}={option}")
    return [*chosen, *overrides]


def runs_job(args: argparse.Namespace) -> bool:
    return not any(getattr(args, flag) for flag in SHOW_FLAGS)


def composed_by_hydra_alone(args: argparse.Namespace) -> bool:
    return any(getattr(args, flag) for flag in ELSEWHERE_FLAGS)


def to_config(dict_cfg):
    """DictConfig -> the plain ``Config`` dataclass that everything below the CLI takes."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_object(dict_cfg)
    if isinstance(cfg, dict):  # composed without the structured schema: rebuild it
        from moe_tune.config import Config

        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), dict_cfg))
    if cfg.model.path is not None and os.path.exists(os.path.expanduser(cfg.model.path)):
        # Recorded in checkpoints and PEFT adapters as the base model: a relative path would mean another
        # directory for a command run from elsewhere (moe-tune-export, a resume). One that does not exist stays as
        # given, for its error line (a hub id, which moe_tune does not download, reads as one).
        cfg.model.path = os.path.abspath(os.path.expanduser(cfg.model.path))
    for key in ("path", "val_path"):  # the same for records a resume or a rerun reads again
        value = getattr(cfg.data, key)
        if value is not None and os.path.exists(os.path.expanduser(value)):  # a hub name stays as given
            setattr(cfg.data, key, os.path.abspath(os.path.expanduser(value)))
    return cfg


def compose(overrides: list[str], source: ConfigSource = PACKAGED):
    """Compose the config with Hydra's compose API (used by the pre-check, tests and the benchmark)."""
    from hydra import compose as hydra_compose

    with initialized(source):
        return hydra_compose(config_name=source.config_name, overrides=choose_path_groups(overrides))


def check(overrides: list[str], multirun: bool = False, source: ConfigSource = PACKAGED):
    """The composed config of ``overrides`` (DictConfig) on ``source``'s primary config, or ConfigError with one
    line. Sweep values (``a=1,2``) are refused without ``multirun`` (``-m``) and checked for their key only under
    it; ``hydra.*`` and ``hydra/...`` are Hydra's to check."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception as e:  # noqa: BLE001  (Hydra's grammar errors come in several types)
        raise ConfigError(grammar_error(_one_line(e), overrides)) from None
    options = group_options(source)
    parsed = user_overrides(parsed, options)
    choices = [o for o in parsed if o.key_or_group in options or "/" in o.key_or_group]
    fixed = [o.input_line for o in parsed if not o.is_sweep_override()]
    base = _compose([o.input_line for o in choices if not o.is_sweep_override()], options, source)
    if not dataclasses.is_dataclass(OmegaConf.get_type(base)):  # a config of the user's own, without the schema
        raise ConfigError(without_schema(source))
    keys, free_dicts = schema_keys(base)
    for o in parsed:
        if o not in choices:
            _check_key(o, keys, free_dicts, base)
    for o in parsed:
        if o.is_sweep_override():
            _check_sweep(o, multirun, base)
    cfg = _compose(fixed, options, source)
    try:
        to_config(cfg)
    except Exception as e:  # noqa: BLE001  (OmegaConf's validation errors)
        raise ConfigError(_describe(e, fixed)) from None
    lora_keys = [o.input_line for o in parsed if o.key_or_group.lstrip("+~").startswith("peft.")]
    if lora_keys and cfg.peft.name == "none":  # given, even at their defaults (validate sees values only)
        from moe_tune.config.validate import lora_keys_without_lora

        lora_keys_without_lora(lora_keys)
    return cfg


def _compose(overrides: list[str], options: dict[str, list[str]], source: ConfigSource):
    from hydra.errors import MissingConfigException

    try:
        return compose(overrides, source)
    except MissingConfigException as e:
        if e.missing_cfg_file == source.config_name:
            raise ConfigError(missing_primary(source)) from None
        group, _, name = (e.missing_cfg_file or "").rpartition("/")
        if group not in options:
            raise ConfigError(_describe(e, overrides)) from None
        raise ConfigError(not_an_option(group, name, options)) from None
    except Exception as e:  # noqa: BLE001  (Hydra raises many exception types for bad overrides)
        raise ConfigError(_describe(e, overrides)) from None


def schema_keys(cfg) -> tuple[set[str], set[str]]:
    """Every dotted key of a value in the composed config's schema (each group as the class its option chose, e.g.
    the comm backend's own), and the free-form dict keys (``model.overrides``) under which any key may be added."""
    from omegaconf import OmegaConf

    keys: set[str] = set()
    free_dicts: set[str] = set()

    def walk(node, cls, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            key = prefix + f.name
            if dataclasses.is_dataclass(hints[f.name]):
                child = node[f.name]
                walk(child, OmegaConf.get_type(child), key + ".")
                continue
            keys.add(key)
            if typing.get_origin(hints[f.name]) is dict:
                free_dicts.add(key)

    walk(cfg, OmegaConf.get_type(cfg), "")
    return keys, free_dicts


def _check_key(o, keys: set[str], free_dicts: set[str], cfg) -> None:
    from hydra.core.override_parser.types import OverrideType
    from omegaconf import OmegaConf

    key, plus = o.key_or_group, o.type in (OverrideType.ADD, OverrideType.FORCE_ADD)
    free = next((d for d in free_dicts if key.startswith(d + ".")), None)
    if free is not None:  # a free-form dict (model.overrides): a key it lacks is added with +
        parent, _, leaf = key.rpartition(".")
        node = OmegaConf.select(cfg, parent)
        if o.type == OverrideType.CHANGE and (node is None or leaf not in node):
            raise ConfigError(f"{key}: {free} has no key {leaf} yet; add it with +{key}={o.value()}")
        return
    if key in free_dicts and isinstance(o.value(), dict) and o.type != OverrideType.FORCE_ADD:
        current = OmegaConf.select(cfg, key) or {}
        if any(k not in current for k in o.value()) or (current and not o.value()):
            raise ConfigError(whole_dict(o, key, current))
    if key in keys:
        refuse_add_or_delete(o, key, cfg)
        return
    if not key:
        raise ConfigError(f"{o.input_line}: no key before '='; write key=value (moe-tune --help lists every key)")
    raise ConfigError(unknown_key_message(key, plus, keys, cfg))


def whole_dict(o, key: str, current) -> str:
    """The line for a free-form dict given whole where Hydra would not do it (``model.overrides={num_hidden_layers:1}``
    is merged into the dict: a key the dict lacks was its 'not in struct' error, ``{}`` removed nothing): the keys
    one by one instead."""
    given = o.value()
    each = " ".join(f"{'' if k in current else '+'}{key}.{k}={v}" for k, v in given.items())
    drop = " ".join(f"~{key}.{k}" for k in current if k not in given)
    keys = " ".join(f"{each} {drop}".split())
    return f"{o.input_line}: Hydra merges a dict into {key}, keys it lacks refused; write {keys}"


def _check_sweep(o, multirun: bool, cfg) -> None:
    """Hydra reads ``key=a,b`` as a sweep (one run per value): without -m it stops with its "Ambiguous value"
    lines and exit 1. A list key needs brackets, or under -m a sweep over lists (``[a],[b]``)."""
    from hydra.core.override_parser.types import ChoiceSweep
    from omegaconf import ListConfig, OmegaConf

    key, value = o.key_or_group, o.input_line.partition("=")[2]
    current, swept = OmegaConf.select(cfg, key), o.value()
    scalars = isinstance(swept, ChoiceSweep) and not all(isinstance(v, list) for v in swept.list)
    if isinstance(current, ListConfig) and scalars:
        lists = f"; to sweep over lists under -m: '{key}={','.join(f'[{v}]' for v in swept.list)}'" if multirun else ""
        raise ConfigError(
            f"{o.input_line} is a sweep to Hydra (a,b: one run per value); {in_brackets(key, value)}{lists}"
        )
    if not multirun:
        text = current is None or isinstance(current, str)  # None: a path or name not given yet (data.path)
        quote = f", or quote a string holding a comma: \"{key}='{value}'\"" if text else ""
        raise ConfigError(
            f"{o.input_line} is a sweep (one run per value), which runs with -m; add -m or give one value{quote}"
        )


def in_brackets(key: str, value: str) -> str:
    return f"{key} is a list; write it in brackets: '{key}=[{value}]' (quoted for the shell)"


# Names Transformers' TrainingArguments, TRL's SFTConfig and PEFT's LoraConfig give what a moe_tune key holds.
PEER_NAMES = {
    "learning_rate": "train.lr",
    "max_steps": "train.steps",
    "per_device_train_batch_size": "train.micro_batch_size",
    "max_seq_length": "train.seq_len",
    "max_length": "train.seq_len",
    "seed": "train.seed",
    "logging_steps": "train.log_every",
    "eval_steps": "train.eval_every",
    "bf16": "train.precision",
    "warmup_steps": "optim.warmup_steps",
    "lr_scheduler_type": "optim.schedule",
    "save_steps": "checkpoint.every",
    "save_total_limit": "checkpoint.keep_last",
    "resume_from_checkpoint": "checkpoint.resume",
    "gradient_checkpointing": "parallel.activation_checkpointing",
    "r": "peft.rank",
    "lora_r": "peft.rank",
    "lora_alpha": "peft.alpha",
    "lora_dropout": "peft.dropout",
    "target_modules": "peft.target",
}
# bitsandbytes' switches for a quantized frozen base (transformers' BitsAndBytesConfig, Unsloth's from_pretrained):
# no key of their name, but the peft.quantize_base that holds moe_tune's frozen routed experts so.
BNB_SWITCHES = {"load_in_4bit": "nf4", "bnb_4bit_quant_type": "nf4", "load_in_8bit": "fp8"}
_BITS = {"nf4": "a 4-bit", "fp8": "an 8-bit"}


def unknown_key_message(key: str, plus: bool, keys: set[str], cfg) -> str:
    """One line: the key is not in the schema, with the closest valid keys (never a ``+`` to add it)."""
    shown = f"+{key}" if plus else key
    fixed = " (+ adds no key: the config's keys are fixed by its schema)" if plus else ""
    group, _, leaf = key.rpartition(".")
    if group == "comm":
        owners = [n for n, c in COMM_CONFIGS.items() if leaf in {f.name for f in dataclasses.fields(c)}]
        if owners:
            choice = " or ".join(f"comm={n}" for n in owners)
            return f"{shown} is an option of {choice}, not of comm={cfg.comm.name}; add {choice}"
    if leaf in BNB_SWITCHES:
        mode = BNB_SWITCHES[leaf]
        base = f"{_BITS[mode]} frozen base (its routed experts) is peft=lora peft.quantize_base={mode}"
        return f"{shown} is not a config key{fixed}; {base} (moe-tune --help lists every key)"
    peer = PEER_NAMES.get(leaf)
    close = [peer] if peer in keys else []
    close += [k for k in sorted(keys) if k.rpartition(".")[2] == leaf and k not in close]
    close += [k for k in difflib.get_close_matches(key, sorted(keys), n=3, cutoff=0.6) if k not in close]
    hint = f"did you mean {' or '.join(close[:3])}? " if close else ""
    return f"{shown} is not a config key{fixed}; {hint}moe-tune --help lists every key"


def _one_line(e: Exception) -> str:
    cause = e.__cause__ or e.__context__
    return " ".join(str(e).split()) + (f": {' '.join(str(cause).split()[:40])}" if cause else "")


# OmegaConf's error for a scalar given to a list key: "Error merging override peft.target=attention: Invalid
# value assigned: str is not a ListConfig, list or tuple. full_key: peft.target ..."
NOT_A_LIST = re.compile(r"override (\S+?)=(\S*): Invalid value assigned: \w+ is not a ListConfig")


def _describe(e: Exception, overrides: list[str]) -> str:
    msg = _one_line(e)
    type_error = TYPE_ERROR.search(msg)
    if type_error:
        value, expected, key = type_error.groups()
        also = " (or auto: the planner picks it)" if key in AUTO_KEYS else ""
        return f"{key}={value!r} is not {EXPECTED.get(expected, expected)}; give {key} a value of that type{also}"
    bool_error = BOOL_ERROR.search(msg)
    if bool_error:
        value, key = bool_error.groups()
        return f"{key}={value!r} is not true or false; give {key}=true or {key}=false"
    not_a_list = NOT_A_LIST.search(msg)
    if not_a_list:
        return in_brackets(*not_a_list.groups())
    not_optional = re.search(r"field '(\S+?)' is not Optional", msg)  # OmegaConf's line for null on a valued key
    if not_optional:
        return not_null(not_optional.group(1), Config)
    return f"{msg} (overrides: {' '.join(overrides) or 'none'})"


def checked_keys() -> list[str]:
    """A line per key whose field carries choices or a range: what it takes and means, in schema order (a comm
    backend's own keys after comm, naming it). A group's ``name`` is left out: its options are the group's."""
    from moe_tune.config import CommConfig, Config
    from moe_tune.config.constraints import constrained_fields

    shared = {f.name for f in dataclasses.fields(CommConfig)}
    lines = []
    for key, _, constraint in constrained_fields(Config):
        if "." in key:
            lines.append(f"  {key}: {constraint.text()}")
        if key == "comm":
            for option, cls in COMM_CONFIGS.items():
                own = [(k, c) for k, f, c in constrained_fields(cls, "comm.") if f.name not in shared]
                lines += [f"  {k}: {c.text()} [comm={option}]" for k, c in own]
    return lines


def help_text(overrides: list[str], source: ConfigSource = PACKAGED) -> str:
    """``moe-tune --help``: usage, config groups and their options, keys' allowed values, Hydra's flags, config."""
    from omegaconf import OmegaConf

    groups = "\n".join(f"  {g}: {', '.join(opts)}" for g, opts in group_options(source).items())
    checked = "\n".join(checked_keys())
    return (
        "moe-tune: fine-tune a Hugging Face Mixture-of-Experts model (a Hydra app: moe_tune/conf).\n\n"
        "Usage: moe-tune [group=option ...] [key=value ...]\n"
        "       torchrun --nproc-per-node N -m moe_tune [group=option ...] [key=value ...]\n\n"
        f"Config groups (group=option):\n{groups}\n\n"
        f"Allowed values (key: what it takes (what it means); checked before anything runs):\n{checked}\n\n"
        f"Planned before the launch, for the world size and GPU memory at hand (moe-tune-plan --search shows how):\n"
        f"  {', '.join(k + '=auto' for k in AUTO_KEYS)}\n\n"
        "Hydra's flags: --cfg job|hydra|all (print the config, run nothing), --package KEY, --resolve,\n"
        "  --info [all|config|defaults|defaults-tree|plugins|searchpath], -m (sweeps and launchers), --hydra-help\n\n"
        f"Config (key=value; with the overrides given):\n{OmegaConf.to_yaml(check(overrides, source=source))}"
    )


__all__ = [
    "AUTO_KEYS",
    "CONF_DIR",
    "ConfigSource",
    "check",
    "checked_keys",
    "compose",
    "help_text",
    "parse",
    "runs_job",
    "schema_keys",
    "to_config",
]

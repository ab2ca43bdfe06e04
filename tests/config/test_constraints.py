"""Each key's choices and range live on its schema field (issue 37, item 4): the one generic check refuses a value
outside any of them, naming the key; every set of choices is spelled once, by the one key it belongs to."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import os
from collections import defaultdict

import pytest

from moe_tune.config import COMM_CONFIGS, Config, ConfigError, data_schema, schema, validate
from moe_tune.config.constraints import Constraint, constrained_fields, constraint_of, key_of
from moe_tune.config.validate import check_values
from tests.harness import ROOT

VALIDATE_SOURCE = inspect.getsource(importlib.import_module("moe_tune.config.validate"))

# A tuple of names in the schema that is no key's choices: the comm backends a rule between keys allows.
NOT_CHOICES = {"OVERLAP_BACKENDS"}


def sections() -> list[tuple[str, object]]:
    """(section name, a default instance) of every config section, each comm backend's options class included."""
    cfg = Config()
    found = [(f.name, getattr(cfg, f.name)) for f in dataclasses.fields(cfg) if f.name != "comm"]
    return [*found, *(("comm", cls()) for cls in COMM_CONFIGS.values())]


def constrained() -> list[tuple[str, object, str, Constraint]]:
    return [
        (name, section, f.name, constraint_of(f))
        for name, section in sections()
        if dataclasses.is_dataclass(section)
        for f in dataclasses.fields(section)
        if constraint_of(f) is not None
    ]


def invalid_values(c: Constraint) -> list:
    """Values just outside each bound the constraint has (and off its multiple, and of the wrong length)."""
    if c.choices is not None:
        return ["not_an_option"]
    bad = [c.ge - 1] if c.ge is not None else []
    bad += [x for x in (c.gt, c.lt) if x is not None] + ([c.le + 1] if c.le is not None else [])
    bad += [c.ge + 1] if c.multiple_of is not None else []
    bad += [float("inf")]
    if c.count is not None:
        return [(x,) * c.count for x in bad] + [(c.ge,) * (c.count - 1)]
    return bad


CASES = [
    pytest.param(name, section, field_name, bad, id=f"{type(section).__name__}.{field_name}={bad}")
    for name, section, field_name, c in constrained()
    for bad in invalid_values(c)
]


@pytest.mark.parametrize("section_name,section,field_name,bad", CASES)
def test_every_constrained_field_is_checked(section_name, section, field_name, bad):
    """Each field's constraint is read by ``check_values`` (the CLI's check before any run), its error first."""
    cfg = Config()
    setattr(cfg, section_name, dataclasses.replace(section, **{field_name: bad}))
    key = key_of(section_name + ".", field_name)
    with pytest.raises(ConfigError) as e:
        check_values(cfg)
    assert str(e.value).startswith(f"{key}="), str(e.value)
    assert "\n" not in str(e.value)


def test_the_checked_keys_cover_the_schema_s_enumerations_and_ranges():
    keys = {key_of(name + ".", f) for name, _, f, _ in constrained()}
    assert {"train.precision", "comm", "comm.num_sms", "comm.max_tokens", "data.val_fraction", "optim.betas"} <= keys


def test_every_default_is_allowed():
    for name, section, field_name, c in constrained():
        assert c.allows(getattr(section, field_name)), (name, field_name)
    validate(Config(), world_size=1)


def test_each_set_of_choices_is_spelled_once():
    """A set of choices is the choices of one key (comm's backends' name fields are all ``comm``), written once in
    moe_tune/ (the tuple a field names, or its own literal), and validate.py names none of them."""
    keys_by_set: dict[frozenset, set[str]] = defaultdict(set)
    for cls in [Config, *COMM_CONFIGS.values()]:
        prefix = "comm." if cls in COMM_CONFIGS.values() else ""
        for key, _, c in constrained_fields(cls, prefix):
            if c.choices is not None:
                keys_by_set[frozenset(c.choices)].add(key)
    assert all(len(keys) == 1 for keys in keys_by_set.values()), keys_by_set
    written = string_tuples(os.path.join(ROOT, "moe_tune"))
    assert {tuple(sorted(s)): written[s] for s in keys_by_set if len(written[s]) != 1} == {}
    named = {
        name: value
        for module in (schema, data_schema)
        for name, value in vars(module).items()
        if name.isupper() and isinstance(value, tuple) and all(isinstance(v, str) for v in value)
    }
    assert {name for name, value in named.items() if frozenset(value) not in keys_by_set} == NOT_CHOICES
    assert "is not one of" not in VALIDATE_SOURCE
    assert [name for name in named if name in VALIDATE_SOURCE] == sorted(NOT_CHOICES)


def string_tuples(top: str) -> dict[frozenset, list[str]]:
    """Where each tuple literal of strings stands in the .py files under ``top`` (file:line), by its set."""
    found: dict[frozenset, list[str]] = defaultdict(list)
    for folder, _, names in os.walk(top):
        for name in (n for n in names if n.endswith(".py")):
            path = os.path.join(folder, name)
            for node in ast.walk(ast.parse(open(path).read())):
                if isinstance(node, ast.Tuple) and node.elts and all(isinstance(e, ast.Constant) for e in node.elts):
                    if all(isinstance(e.value, str) for e in node.elts):
                        found[frozenset(e.value for e in node.elts)].append(f"{path}:{node.lineno}")
    return found

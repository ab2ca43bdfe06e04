"""What one key accepts, written on its schema field: ``field(default, choices=..., ge=..., help=...)``.

``constrained_values`` walks a config and ``Constraint.problem`` words the one-line error, so ``validate`` checks
every field's own constraint in one loop and keeps only rules between keys; ``moe-tune --help`` lists the same
constraints. This module imports nothing of moe_tune (the schema imports it).
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Iterator
from dataclasses import MISSING, dataclass
from typing import Any

METADATA_KEY = "moe_tune"
COUNT_WORDS = {2: "two", 3: "three"}


@dataclass(frozen=True)
class Constraint:
    """One key's allowed values: one of ``choices``, or numbers within the bounds (``also`` and, for a key whose
    default is None, null besides); a tuple key takes ``count`` such numbers."""

    choices: tuple[str, ...] | None = None
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    multiple_of: int | None = None
    also: int | None = None  # one value outside the range that means something of its own (-1: automatic)
    nullable: bool = False  # null means automatic or unset
    count: int | None = None
    help: str = ""
    example: str = ""  # the value the error line's fix suggests

    def allows(self, value: Any) -> bool:
        if value is None:
            return self.nullable
        if self.choices is not None:
            return value in self.choices
        if isinstance(value, (list, tuple)):
            return len(value) == self.count and all(map(self._in_bounds, value))
        return value == self.also or self._in_bounds(value)

    def _in_bounds(self, x: Any) -> bool:
        if not isinstance(x, (int, float)) or (isinstance(x, float) and not math.isfinite(x)):
            return False
        return (
            (self.ge is None or x >= self.ge)
            and (self.gt is None or x > self.gt)
            and (self.le is None or x <= self.le)
            and (self.lt is None or x < self.lt)
            and (self.multiple_of is None or x % self.multiple_of == 0)
        )

    def text(self) -> str:
        """The allowed values in words, as the error line and ``--help`` give them."""
        if self.choices is not None:
            allowed = ", ".join(self.choices) + (" or null" if self.nullable else "")
        else:
            allowed = self._bounds_text()
        return f"{allowed} ({self.help})" if self.help else allowed

    def _bounds_text(self) -> str:
        if (self.ge, self.gt) != (None, None) and (self.le, self.lt) != (None, None):  # an interval
            opening, low = ("[", self.ge) if self.ge is not None else ("(", self.gt)
            closing, high = ("]", self.le) if self.le is not None else (")", self.lt)
            text = f"in {opening}{_number(low)}, {_number(high)}{closing}"
        else:
            signs = ((">=", self.ge), (">", self.gt), ("<=", self.le), ("<", self.lt))
            text = " and ".join(f"{sign} {_number(bound)}" for sign, bound in signs if bound is not None)
        if self.multiple_of is not None:
            text += f" and a multiple of {self.multiple_of}"
        if self.count is not None:
            text = f"{COUNT_WORDS.get(self.count, self.count)} values {text}"
        extras = [str(x) for x in (self.also,) if x is not None] + (["null"] if self.nullable else [])
        return " or ".join([text, *extras])

    def _pick(self, key: str, value: Any) -> str:
        """The fix for a value outside the choices: the one choice it names in other letter case or hyphens
        (NF4, Grouped-MM), else any of them."""
        alike = spelled_alike(value, self.choices)
        return f"did you mean {key}={alike[0]}?" if len(alike) == 1 else "pick one of those"

    def problem(self, key: str, value: Any, hint: str | None = None) -> str | None:
        """The error line for ``key=value``, or None when the value is allowed; ``hint``: the fix for a value
        outside the choices, where the caller knows a better one than these choices (``sibling_hint``)."""
        if self.allows(value):
            return None
        if self.choices is not None:
            # true/false as typed: Hydra parses them to booleans, which reach a text field as 'True'/'False'
            shown = str(value).lower() if str(value) in ("True", "False") else repr(value)
            return f"{key}={shown} is not one of {', '.join(self.choices)}; {hint or self._pick(key, value)}"
        return out_of_range(key, value, self.text(), self.example)


# Keys whose names are alike and whose values are easily given to each other: the quantized base's storage and the
# GEMMs that read it. A value that is the other key's choice is pointed there, not to this key's choices.
SIBLING_KEYS = {"peft.quantize_base": "kernels.quantized_base", "kernels.quantized_base": "peft.quantize_base"}


def sibling_hint(key: str, value: Any, constraints: dict[str, Constraint]) -> str | None:
    """The fix for ``key=value`` where the value is a choice of the key's sibling (``SIBLING_KEYS``) in
    ``constraints`` (key -> its constraint); None otherwise."""
    sibling = SIBLING_KEYS.get(key)
    theirs = constraints.get(sibling) if sibling else None
    alike = spelled_alike(value, theirs.choices or ()) if theirs else []
    if not alike:
        return None
    return f"{alike[0]} is {theirs.help} ({sibling}): did you mean {sibling}={alike[0]}?"


def spelled_alike(value: Any, choices) -> list[str]:
    """The choices ``value`` names in other letter case or with hyphens for underscores (NF4, Grouped-MM)."""

    def folded(v: Any) -> str:
        return str(v).lower().replace("-", "_")

    return [c for c in choices if folded(c) == folded(value)]


def choice_hint(name: str, value: Any, choices, siblings: dict[str, tuple] | None = None) -> str | None:
    """The fix for the Python argument ``name=value`` outside ``choices``, worded as the command line's: the choice
    it names in other letter case or hyphens (NF4), else one spelled closely (nf5), else a choice of a sibling
    argument in ``siblings`` (argument -> its choices) it names; None when none does."""
    import difflib

    alike = spelled_alike(value, choices)
    if not alike and isinstance(value, str):
        folded = {str(c).lower(): c for c in choices}
        alike = [folded[c] for c in difflib.get_close_matches(value.lower(), list(folded), n=1, cutoff=0.6)]
    if alike:
        return f"did you mean {name}={alike[0]!r}?"
    for sibling, theirs in (siblings or {}).items():
        if spelled_alike(value, theirs):
            return f"did you mean {sibling}={spelled_alike(value, theirs)[0]!r}?"
    return None


def not_null(key: str, schema: type) -> str:
    """The line for ``key=null`` where the key takes a value: what it takes, where ``schema`` (Config) says."""
    takes = next((c.text() for k, _, c in constrained_fields(schema) if k == key), "a value")
    return f"{key}=null: {key} takes {takes}, not null; give it one, or leave it out for its default"


def out_of_range(key: str, value: Any, allowed: str, example: str) -> str:
    """The one line for a number outside its range (a rule between keys words its own range the same way)."""
    return f"{key}={spelled(value)} is out of range: it must be {allowed}; try {key}={example}"


def spelled(value: Any) -> str:
    """A value as a command-line override writes it: a list as [a,b], None as null."""
    if isinstance(value, (list, tuple)):
        return f"[{','.join(map(spelled, value))}]"
    return "null" if value is None else str(value)


def _number(x: float) -> str:
    """A bound as the error line writes it: 2**63, not its 19 digits."""
    if isinstance(x, int) and x > 2**32 and x & (x - 1) == 0:
        return f"2**{x.bit_length() - 1}"
    return str(x)


def field(
    default: Any = MISSING,
    *,
    default_factory: Any = MISSING,
    choices: tuple[str, ...] | None = None,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    multiple_of: int | None = None,
    also: int | None = None,
    help: str = "",
    example: str | None = None,
) -> Any:
    """A dataclass field carrying its key's Constraint as metadata (Hydra and OmegaConf ignore metadata); with no
    choices or bound, a plain field. ``example`` is the fix's value, the default unless given."""
    if choices is None and ge is None and gt is None and le is None and lt is None:
        return dataclasses.field(default=default, default_factory=default_factory)
    rule = Constraint(
        choices=choices,
        ge=ge,
        gt=gt,
        le=le,
        lt=lt,
        multiple_of=multiple_of,
        also=also,
        nullable=default is None,
        count=len(default) if isinstance(default, tuple) else None,
        help=help,
        example=spelled(default) if example is None else example,
    )
    return dataclasses.field(default=default, metadata={METADATA_KEY: rule})


def constraint_of(f: dataclasses.Field) -> Constraint | None:
    return f.metadata.get(METADATA_KEY)


def key_of(prefix: str, name: str) -> str:
    """A field's key as the user writes it: a group's ``name`` is chosen as ``<group>=<option>``."""
    return prefix.rstrip(".") if name == "name" and prefix else prefix + name


def constrained_values(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any, Constraint]]:
    """(key, value, constraint) of every constrained field of the config ``obj``, sections in schema order; a
    section is walked as the class its value has (each comm backend's own keys)."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from constrained_values(value, f"{prefix}{f.name}.")
        elif constraint_of(f) is not None:
            yield key_of(prefix, f.name), value, constraint_of(f)


def constrained_fields(cls: type, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field, Constraint]]:
    """(key, field, constraint) of every constrained field of the schema class ``cls``, sections in schema order."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from constrained_fields(hints[f.name], f"{prefix}{f.name}.")
        elif constraint_of(f) is not None:
            yield key_of(prefix, f.name), f, constraint_of(f)

"""What LoRA adapts and how (``peft.*``), as a plain dataclass the model is built with."""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, fields

import torch

# Target words naming groups of modules: every linear of the attention; the dense MLPs and shared experts (the
# linears of the MLP block that are neither the router nor a gate); the routed experts.
LINEAR_GROUPS = ("attention", "mlp")
TARGET_GROUPS = (*LINEAR_GROUPS, "experts")

# Adapter parameters: ``<linear>.lora.{A,B}`` and ``<experts>.lora.{gate_up,down}_{A,B}``.
ADAPTER = re.compile(r"(^|\.)lora\.(A|B|gate_up_A|gate_up_B|down_A|down_B)$")


def is_adapter(name: str) -> bool:
    return ADAPTER.search(name) is not None


def frozen_base_dtype(precision: str) -> torch.dtype:
    """The storage dtype of LoRA's frozen base, unquantized, under ``train.precision``: fp32 where every weight is
    fp32 (``fp32``), bf16 otherwise (a weight that does not train needs no fp32 master copy)."""
    return torch.float32 if precision == "fp32" else torch.bfloat16


@dataclass(frozen=True)
class LoRASpec:
    """``delta_W = alpha / rank * B @ A`` per adapted matrix (``A``: rank x in, ``B``: out x rank), as PEFT.

    ``targets``: words of ``TARGET_GROUPS`` or module names (``q_proj``, ``shared_experts.down_proj``: the end of
    a linear's dotted name). ``train_router``: the routers' weights train fully (frozen otherwise).
    ``base_dtype``: the frozen weights' storage dtype (None: as built); adapters keep the model's dtype.
    """

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ("attention", "experts")
    train_router: bool = False
    base_dtype: torch.dtype | None = None

    def __new__(cls, *args, **kwargs):
        """A keyword that is no field (the CLI's ``target`` for ``targets``) is one line naming the field."""
        names = [f.name for f in fields(cls)]
        for key in kwargs:
            if key not in names:
                close = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
                hint = f"did you mean {close[0]}=...? " if close else ""
                raise TypeError(f"LoRASpec has no field {key!r}; {hint}its fields: {', '.join(names)}")
        return super().__new__(cls)

    def __post_init__(self) -> None:
        problem = spec_problem(self)
        if problem:
            from moe_tune.config.schema import ConfigError

            raise ConfigError(problem)

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    @property
    def experts(self) -> bool:
        return "experts" in self.targets


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def spec_problem(spec: LoRASpec) -> str | None:
    """The line for a value ``peft.*`` would refuse (its range, a bare string or nothing for the targets), one of
    another type (a string for a number, anything but a bool for ``train_router``), or None."""
    if isinstance(spec.targets, str):
        return f"LoRASpec(targets={spec.targets!r}): targets is a tuple of names; write targets=({spec.targets!r},)"
    if not spec.targets or not all(isinstance(t, str) for t in spec.targets):
        return (
            f"LoRASpec(targets={spec.targets!r}): targets names what LoRA adapts (peft.target), words or linear "
            "names; try targets=('attention', 'experts')"
        )
    if isinstance(spec.rank, bool) or not isinstance(spec.rank, int) or spec.rank < 1:
        return f"LoRASpec(rank={spec.rank!r}): rank must be an integer >= 1 (peft.rank); try rank=16"
    if not (_is_number(spec.alpha) and spec.alpha > 0):
        return f"LoRASpec(alpha={spec.alpha!r}): alpha must be a number > 0 (peft.alpha); try alpha=32.0"
    if not (_is_number(spec.dropout) and 0 <= spec.dropout < 1):
        return f"LoRASpec(dropout={spec.dropout!r}): dropout must be a number in [0, 1) (peft.dropout); try dropout=0.0"
    if not isinstance(spec.train_router, bool):
        return f"LoRASpec(train_router={spec.train_router!r}) is not a bool; give train_router=True or False"
    base = spec.base_dtype
    if base is not None and not (isinstance(base, torch.dtype) and base.is_floating_point and base.itemsize > 1):
        return (
            f"LoRASpec(base_dtype={base!r}): the frozen base is stored in a floating-point torch dtype, or None "
            "for the model's; try base_dtype=torch.bfloat16 (FP8 or NF4: ExpertsOptions(quantized_base=...))"
        )
    return None

"""Adapters on single linears: ``y = base(x) + scaling * B(A(dropout(x)))``.

The adapter is a child ``lora`` of the adapted module and is added by a forward hook, so the base module is not
replaced: its parameter names (what checkpoints, loaders and exports key on) and its kind (``nn.Linear`` or
TransformerEngine's ``Linear``) stay as they are.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moe_tune.lora.spec import LoRASpec


class LinearAdapter(nn.Module):
    def __init__(self, in_features: int, out_features: int, spec: LoRASpec, dtype: torch.dtype):
        super().__init__()
        self.A = nn.Parameter(torch.empty(spec.rank, in_features, dtype=dtype))
        self.B = nn.Parameter(torch.empty(out_features, spec.rank, dtype=dtype))
        self.dropout = nn.Dropout(spec.dropout) if spec.dropout > 0 else nn.Identity()
        self.scaling = spec.scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = F.linear(self.dropout(x), self.A.to(x.dtype))
        return F.linear(a, (self.B * self.scaling).to(x.dtype))

    def delta_weight(self) -> torch.Tensor:
        """The update of the base weight (out x in), in fp32."""
        return (self.B.float() @ self.A.float()) * self.scaling


def _add_adapter(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    if module.lora is None:  # merged into the base weight
        return output
    return output + module.lora(args[0]).to(output.dtype)


def apply_linear_adapters(modules: dict[str, nn.Module], spec: LoRASpec, dtype: torch.dtype) -> None:
    """Give each module (a linear: ``in_features``, ``out_features``) a ``lora`` adapter added to its output."""
    for module in modules.values():
        module.lora = LinearAdapter(module.in_features, module.out_features, spec, dtype)
        module.register_forward_hook(_add_adapter)

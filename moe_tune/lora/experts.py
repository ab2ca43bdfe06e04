"""Adapters on the stacked experts: for each adapted projection, A ``[e, rank, in]`` and B ``[e, out, rank]``
stacked per expert like the base weights (and sharded with them under expert parallelism), run with the same
grouped GEMM as the experts, never a loop over experts.

``delta_W[j] = scaling * B[j] @ A[j]`` is an (out x in) update of expert j's projection whatever the family's
in-memory layout: ``out`` counts the projection's outputs in the order the base weight holds them (GPT-OSS's
interleaved gate/up included), so the same A and B describe both layouts, as PEFT's parameter adapters do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moe_tune.lora.spec import LoRASpec

PROJECTIONS = ("gate_up", "down")


class ExpertsAdapter(nn.Module):
    def __init__(self, num_local_experts: int, dim: int, hidden: int, spec: LoRASpec, dtype: torch.dtype):
        super().__init__()
        e, r = num_local_experts, spec.rank
        for proj, (n_in, n_out) in zip(PROJECTIONS, ((dim, 2 * hidden), (hidden, dim))):
            setattr(self, f"{proj}_A", nn.Parameter(torch.empty(e, r, n_in, dtype=dtype)))
            setattr(self, f"{proj}_B", nn.Parameter(torch.empty(e, n_out, r, dtype=dtype)))
        self.dropout = nn.Dropout(spec.dropout) if spec.dropout > 0 else nn.Identity()
        self.scaling = spec.scaling

    def factors(self, proj: str) -> tuple[torch.Tensor, torch.Tensor]:
        return getattr(self, f"{proj}_A"), getattr(self, f"{proj}_B")

    def delta(self, proj: str, x_RK: torch.Tensor, offs_e: torch.Tensor) -> torch.Tensor:
        """``scaling * x @ (B[j] @ A[j])^T`` for the rows of each local expert j (rows sorted by expert)."""
        A_erK, B_eNr = self.factors(proj)
        a_Rr = F.grouped_mm(self.dropout(x_RK), A_erK.transpose(-2, -1).to(x_RK.dtype), offs=offs_e)
        # The scaling goes into B (e x out x rank), not over the [rows, out] result: one pass less over it.
        return F.grouped_mm(a_Rr, (B_eNr * self.scaling).transpose(-2, -1).to(x_RK.dtype), offs=offs_e)

    def delta_one(self, proj: str, x_RK: torch.Tensor, j: int) -> torch.Tensor:
        """``delta`` for the rows of local expert j alone (the per-expert reference loop)."""
        A_erK, B_eNr = self.factors(proj)
        return self.dropout(x_RK) @ A_erK[j].T.to(x_RK.dtype) @ B_eNr[j].T.to(x_RK.dtype) * self.scaling

    def delta_weight(self, proj: str) -> torch.Tensor:
        """The (out x in) update of every local expert's projection, ``[e, out, in]``, in fp32."""
        A_erK, B_eNr = self.factors(proj)
        return torch.bmm(B_eNr.float(), A_erK.float()) * self.scaling

"""Routed experts as stacked weights, run with one grouped GEMM per projection.

Two in-memory layouts exist in Hugging Face transformers v5, and we keep each family's so that parameter
names and shapes equal the Hugging Face model's:
  - "out_in" (Qwen, Mixtral, OLMoE, DeepSeek-V3, GLM-4-MoE): ``gate_up_proj [E, 2I, D]`` (gate rows then up
    rows), ``down_proj [E, D, I]``: each expert's matrix as an ``nn.Linear`` weight (out x in).
  - "in_out" (GPT-OSS): ``gate_up_proj [E, D, 2I]`` with gate and up *interleaved* along the last dim,
    ``down_proj [E, I, D]``, plus ``gate_up_proj_bias [E, 2I]`` and ``down_proj_bias [E, D]``.
On disk, most published checkpoints store one tensor per expert instead (``experts.<j>.gate_proj.weight``...);
``moe_tune.models.families`` maps between the two.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moe_tune.kernels.fp8_grouped import fp8_grouped_mm
from moe_tune.kernels.groups import row_groups
from moe_tune.lora import ExpertsAdapter, LoRASpec
from moe_tune.lora.experts import PROJECTIONS
from moe_tune.moe.quantized_base import PROJECTION_CLASSES


@dataclass(frozen=True)
class ExpertsSpec:
    num_experts: int
    dim: int
    hidden: int
    layout: str = "out_in"
    bias: bool = False
    # "swiglu": silu(gate) * up. "clamped_swiglu": GPT-OSS's clamped gate/up with (up + 1) * gate * sigmoid(alpha*gate).
    activation: str = "swiglu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0


@dataclass(frozen=True)
class ExpertsOptions:
    """How this run computes the experts (not the family's maths, which is ``ExpertsSpec``)."""

    # "grouped_mm": one grouped GEMM per projection; "grouped_mm_fp8": the same GEMMs in FP8 E4M3 with row-wise
    # scales, forward and backward (``moe.fp8_grouped``; LoRA deltas and biases stay bf16); "loop": the
    # per-expert reference.
    impl: str = "grouped_mm"
    # Experts outside FSDP2 (each ep rank alone holds them, ``ParallelDims.experts_outside_fsdp``): the dtype the
    # weights are cast to for the GEMMs (FSDP's mixed precision would do it otherwise), and the data-parallel
    # size their gradients are averaged over (FSDP's gradient divide factor otherwise).
    compute_dtype: torch.dtype | None = None
    grad_divide: float = 1.0
    # "fp8" or "nf4": the weights are frozen (LoRA) and held quantized (``quantized_base``), never as bf16; None:
    # parameters.
    quantized_base: str | None = None
    # Their GEMMs: "torch" or "triton" (kernels.quantized_base).
    quantized_gemm: str = "torch"


def grouped_mm(x_RK: torch.Tensor, w_eKN: torch.Tensor, offs_e: torch.Tensor) -> torch.Tensor:
    """Rows of group j (between offs[j-1] and offs[j]) times w[j]; empty groups are fine."""
    return F.grouped_mm(x_RK, w_eKN, offs=offs_e)


def _autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """Under torch.autocast (train.precision=amp_bf16) the experts' GEMMs run in its dtype, as a linear's do:
    autocast casts no grouped GEMM itself (eager would run them in fp32, and compile's grouped_mm takes bf16 only)."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None


def _with_zero_row(bias_eN: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.cat([bias_eN.to(dtype), bias_eN.new_zeros(1, bias_eN.shape[1], dtype=dtype)])


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the gradient by ``scale`` in backward."""

    @staticmethod
    def forward(ctx, x, scale: float):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


class GroupedExperts(nn.Module):
    """The experts held by this rank: global experts ``[first_expert, first_expert + num_local_experts)``, all
    of them without expert parallelism.

    ``forward(x_RD, counts_e)``: rows sorted by local expert, ``counts_e`` rows per local expert (a device
    tensor: no host sync). Returns ``y_RD`` in the same order.
    """

    def __init__(
        self,
        spec: ExpertsSpec,
        options: ExpertsOptions | None = None,
        first_expert: int = 0,
        num_local_experts: int | None = None,
        lora: LoRASpec | None = None,
    ):
        super().__init__()
        self.spec, self.options = spec, options or ExpertsOptions()
        e = spec.num_experts if num_local_experts is None else num_local_experts
        self.first_expert, self.num_local_experts = first_expert, e
        D, I = spec.dim, spec.hidden  # noqa: E741 (I: expert hidden dim, the moe/ legend)
        if self.options.quantized_base is not None:
            # [e, out, in] whatever the family's layout; filled by ``fill_base_`` as the weights are read.
            projection = PROJECTION_CLASSES[self.options.quantized_base]
            triton = self.options.quantized_gemm == "triton"
            self.gate_up_quantized = projection(e, 2 * I, D, triton)
            self.down_quantized = projection(e, D, I, triton)
        elif spec.layout == "out_in":
            self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * I, D))
            self.down_proj = nn.Parameter(torch.empty(e, D, I))
        else:
            self.gate_up_proj = nn.Parameter(torch.empty(e, D, 2 * I))
            self.down_proj = nn.Parameter(torch.empty(e, I, D))
        if spec.bias:
            self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * I))
            self.down_proj_bias = nn.Parameter(torch.empty(e, D))
        # LoRA on the experts: low-rank updates of both projections, stacked per local expert like the weights.
        self.lora = ExpertsAdapter(e, D, I, lora, torch.get_default_dtype()) if lora is not None else None

    @property
    def ep_sharded(self) -> bool:
        """Whether this rank holds a block of the experts only (expert parallelism)."""
        return self.num_local_experts < self.spec.num_experts

    @property
    def quantized(self) -> bool:
        return self.options.quantized_base is not None

    def _weights_KN(self) -> tuple[torch.Tensor, torch.Tensor]:
        # grouped_mm wants [e, in, out]; the "out_in" layout is read through a transposed view (no copy).
        if self.quantized:
            return tuple(getattr(self, f"{p}_quantized").dequantized().transpose(-2, -1) for p in PROJECTIONS)
        if self.spec.layout == "out_in":
            return self.gate_up_proj.transpose(-2, -1), self.down_proj.transpose(-2, -1)
        return self.gate_up_proj, self.down_proj

    def base_shape(self, proj: str) -> tuple[int, int, int]:
        """This rank's ``<proj>_proj`` as the Hugging Face model holds it (the family's layout): what a checkpoint or
        the random initialisation gives ``fill_base_``."""
        e, D, I = self.num_local_experts, self.spec.dim, self.spec.hidden  # noqa: E741
        out_in = {"gate_up": (2 * I, D), "down": (D, I)}[proj]
        return (e, *(out_in if self.spec.layout == "out_in" else out_in[::-1]))

    @torch.no_grad()
    def fill_base_(self, proj: str, first: int, w: torch.Tensor) -> None:
        """Quantize local experts ``[first, first + len(w))`` of ``<proj>_proj`` (the family's layout) into place."""
        w = w if self.spec.layout == "out_in" else w.transpose(-2, -1)
        getattr(self, f"{proj}_quantized").fill_(first, w)

    def _base_mm(self, proj: str, x_RK: torch.Tensor, offs_e: torch.Tensor) -> torch.Tensor:
        """The frozen or trained weights' grouped GEMM (without the adapters)."""
        if self.quantized:
            return getattr(self, f"{proj}_quantized")(x_RK, offs_e)
        gemm = fp8_grouped_mm if self.options.impl == "grouped_mm_fp8" else grouped_mm
        w = self._weights_KN()[PROJECTIONS.index(proj)]
        return gemm(x_RK, w.to(x_RK.dtype), offs_e)

    def _activation(self, h_RI2: torch.Tensor) -> torch.Tensor:
        s = self.spec
        if s.activation == "swiglu":
            gate, up = h_RI2.chunk(2, dim=-1)
            return F.silu(gate) * up
        gate, up = h_RI2[..., ::2], h_RI2[..., 1::2]
        gate = gate.clamp(max=s.swiglu_limit)
        up = up.clamp(min=-s.swiglu_limit, max=s.swiglu_limit)
        return (up + 1) * (gate * torch.sigmoid(gate * s.swiglu_alpha))

    def forward(self, x_RD: torch.Tensor, counts_e: torch.Tensor) -> torch.Tensor:
        o = self.options
        dtype = o.compute_dtype or _autocast_dtype(x_RD)
        if dtype is not None:
            x_RD = x_RD.to(dtype)
        if o.grad_divide != 1.0:
            # Divide only the weight gradients: scale the output's gradient down and the input's back up.
            x_RD = _ScaleGrad.apply(x_RD, o.grad_divide)
            return _ScaleGrad.apply(self._forward(x_RD, counts_e), 1.0 / o.grad_divide)
        return self._forward(x_RD, counts_e)

    def _forward(self, x_RD: torch.Tensor, counts_e: torch.Tensor) -> torch.Tensor:
        if self.options.impl == "loop":
            return self.forward_loop(x_RD, counts_e)
        offs_e = torch.cumsum(counts_e, dim=0, dtype=torch.int32)
        h = self._base_mm("gate_up", x_RD, offs_e)
        if self.lora is not None:
            h = h + self.lora.delta("gate_up", x_RD, offs_e)
        if self.spec.bias:
            # Rows past the last expert's (a dispatcher's fixed-capacity padding, e.g. symm_mem) get index e, a zero
            # bias row that is no parameter: whatever gradient lands on padding rows (stale buffer contents) never
            # reaches the biases.
            row_expert_R = row_groups(offs_e, x_RD.shape[0])
            h = h + _with_zero_row(self.gate_up_proj_bias, h.dtype)[row_expert_R]
        a = self._activation(h)
        y = self._base_mm("down", a, offs_e)
        if self.lora is not None:
            y = y + self.lora.delta("down", a, offs_e)
        if self.spec.bias:
            y = y + _with_zero_row(self.down_proj_bias, y.dtype)[row_expert_R]
        return y

    def forward_loop(self, x_RD: torch.Tensor, counts_e: torch.Tensor) -> torch.Tensor:
        """Reference: one matmul pair per expert. Used by tests and ``kernels.experts=loop`` only."""
        w1, w2 = self._weights_KN()
        outs, start = [], 0
        for j, n in enumerate(counts_e.tolist()):  # host sync: the reference loop needs Python ints
            x = x_RD[start : start + n]
            h = x @ w1[j].to(x.dtype)
            if self.lora is not None:
                h = h + self.lora.delta_one("gate_up", x, j)
            if self.spec.bias:
                h = h + self.gate_up_proj_bias[j].to(h.dtype)
            a = self._activation(h)
            y = a @ w2[j].to(x.dtype)
            if self.lora is not None:
                y = y + self.lora.delta_one("down", a, j)
            if self.spec.bias:
                y = y + self.down_proj_bias[j].to(y.dtype)
            outs.append(y)
            start += n
        return torch.cat(outs) if outs else x_RD.new_zeros(0, self.spec.dim)

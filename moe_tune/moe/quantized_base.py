"""Frozen stacked expert projections held quantized (``peft.quantize_base``: FP8 or NF4): what ``GroupedExperts`` keeps
in place of a bf16 weight under LoRA, where the experts' weights never change. Each has ``forward(x_RK, offs_e)``,
``fill_(first, w)`` and ``dequantized()``.

The values are the Hugging Face checkpoint's, quantized as they are read (``fill_``: a block of experts at a time, so
neither host nor GPU holds a layer's bf16 experts whole) or as a built-in model's weights are drawn. They are
buffers outside the state dict: a checkpoint of the run holds the adapters, and a resume quantizes the same base
again, bit for bit (the quantization is deterministic).
"""

from __future__ import annotations

import torch
from torch import nn

from moe_tune.kernels import fp8_frozen, nf4_frozen
from moe_tune.kernels.fp8_grouped import E4M3


class FrozenFP8Projection(nn.Module):
    """``[e, out, in]`` E4M3 weights with one power-of-two scale per (expert, output row): 1 byte per weight plus
    4 per row, against 2 per weight in bf16. ``forward(x_RK, offs_e)`` = ``x @ W_j^T`` for the rows of group j,
    differentiable in x only."""

    def __init__(self, num_experts: int, out_features: int, in_features: int, triton: bool = False):
        super().__init__()
        self.triton = triton  # the input gradient through the Triton grouped GEMM (kernels.quantized_base=triton)
        shape = (num_experts, out_features, in_features)
        self.register_buffer("weight", torch.empty(shape, dtype=E4M3), persistent=False)
        self.register_buffer("scale", torch.empty(shape[:2], dtype=torch.float32), persistent=False)

    def forward(self, x_RK: torch.Tensor, offs_e: torch.Tensor) -> torch.Tensor:
        # Off CUDA the Triton GEMM does not exist: the run computes torch's path (the op's own CPU branch for
        # ``triton`` is that kernel's reference, unquantized dy, which would change the numbers there).
        triton = self.triton and x_RK.is_cuda
        return fp8_frozen.frozen_fp8_grouped_mm(x_RK, self.weight, self.scale, offs_e, triton)

    @torch.no_grad()
    def fill_(self, first: int, w_bNK: torch.Tensor) -> None:
        """Quantize the weights of local experts ``[first, first + b)`` (``[b, out, in]``, any float dtype)."""
        q, s = fp8_frozen.quantize_weight(w_bNK.to(self.weight.device))
        self.weight[first : first + q.shape[0]].copy_(q)
        self.scale[first : first + q.shape[0]].copy_(s)

    def dequantized(self) -> torch.Tensor:
        """``[e, out, in]`` in fp32: the values the GEMMs compute with (the per-expert reference loop, tests)."""
        return fp8_frozen.dequantize_weight(self.weight, self.scale)


class FrozenNF4Projection(nn.Module):
    """``[e, out, in]`` weights as NF4 codes (two per byte) with a bf16 scale per block of 64 (or 32) inputs: about
    0.53 bytes per weight. ``forward(x_RK, offs_e)`` = ``x @ W_j^T`` for the rows of group j, differentiable in x
    only; a block of experts at a time is dequantized for its GEMM (``kernels.nf4_frozen``)."""

    def __init__(self, num_experts: int, out_features: int, in_features: int, triton: bool = False):
        super().__init__()
        self.triton = triton  # both directions through the Triton grouped GEMM (kernels.quantized_base=triton)
        # Set for a layer recomputed in backward (activation_checkpoint.apply_ac, mode full): the recompute's
        # dequantized experts serve the input gradient (nf4_frozen.grouped_mm_keeping_dequantized).
        self.recomputed = False
        block = nf4_frozen.block_size(in_features)
        codes = torch.empty(num_experts, out_features, in_features // 2, dtype=torch.uint8)
        scales = torch.empty(num_experts, out_features, in_features // block, dtype=nf4_frozen.SCALE_DTYPE)
        self.register_buffer("codes", codes, persistent=False)
        self.register_buffer("scales", scales, persistent=False)

    def forward(self, x_RK: torch.Tensor, offs_e: torch.Tensor) -> torch.Tensor:
        if self.recomputed and not self.triton and nf4_frozen.fits_one_pass(self.codes, x_RK.dtype):
            return nf4_frozen.grouped_mm_keeping_dequantized(x_RK, self.codes, self.scales, offs_e)
        return nf4_frozen.frozen_nf4_grouped_mm(x_RK, self.codes, self.scales, offs_e, self.triton)

    @torch.no_grad()
    def fill_(self, first: int, w_bNK: torch.Tensor) -> None:
        codes, scales = nf4_frozen.quantize_weight(w_bNK.to(self.codes.device))
        self.codes[first : first + codes.shape[0]].copy_(codes)
        self.scales[first : first + codes.shape[0]].copy_(scales)

    def dequantized(self) -> torch.Tensor:
        return nf4_frozen.dequantize_weight(self.codes, self.scales)


PROJECTION_CLASSES = {"fp8": FrozenFP8Projection, "nf4": FrozenNF4Projection}

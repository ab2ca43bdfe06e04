"""The frozen base's routed experts in FP8 (``peft.quantize_base=fp8``): weights quantized once, at load, and grouped
GEMMs that read them as they are stored.

Storage (``quantize_weight``): each local expert's projection as ``[e, out, in]`` E4M3 with one power-of-two scale per
(expert, output row) over its inputs. That is the forward GEMM's own operand, so no step quantizes a weight again (the
per-step weight quantization is what makes ``kernels.experts=grouped_mm_fp8`` slower than bf16).

``frozen_fp8_grouped_mm(x_RK, w_eNK, s_eN, offs_e)`` is ``x @ W_j^T`` for the rows of group j:
  - forward: x quantized per row (one pass on CUDA: ``triton_fp8``), then ``torch._scaled_grouped_mm``.
  - backward: the input gradient only (the base is frozen), ``dx = dy @ W_j``. It contracts over the weight's
    output rows, and Hopper's FP8 GEMM reads its operands contraction-innermost with scales along the output dims
    only. ``kernels.quantized_base=torch``: the weight's row scales are folded into dy (``dy[r, n] * s[j(r), n]``,
    exact: powers of two) in the pass that quantizes dy per row, and the weight's bytes are copied transposed (e x
    out x in bytes per call, one tiled Triton pass on CUDA) for ``torch._scaled_grouped_mm``. ``triton``: dy as it is
    against the dequantized weights in one Triton grouped GEMM that reads the E4M3 tiles in their stored layout
    (``frozen``). Only the weights and offsets are saved for backward.
Registered as a custom op with its autograd, so torch.compile calls it as it is and traces neither direction. On
the CPU: the FP8 kernel is ``fp8_grouped.emulated_scaled_grouped_mm`` (both quantized operands dequantized, then an
fp32 matmul per group); ``triton``'s input gradient ``frozen.dense_grouped_mm`` of the dequantized weights.

Legend (the moe/ one): R routed rows, K and N a GEMM's in and out dims, e local experts (groups).
"""

from __future__ import annotations

import functools

import torch

from moe_tune.kernels.fp8_grouped import (
    emulated_scaled_grouped_mm,
    quantize_rows,
    quantize_rows_triton,
    scaled_grouped_mm,
    transpose_experts,
)
from moe_tune.kernels.frozen import dense_grouped_mm, quantized_grouped_mm, register_input_grad
from moe_tune.kernels.groups import row_groups

# Hopper's faster FP8 accumulation (no periodic promotion to fp32), as kernels.experts=grouped_mm_fp8 uses.
FAST_ACCUM = True


def quantize_weight(w_eNK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked ``[e, out, in]`` weights -> (E4M3 values, the same shape; dequantization scales ``[e, out]``)."""
    return quantize_rows(w_eNK)


def dequantize_weight(q_eNK: torch.Tensor, s_eN: torch.Tensor) -> torch.Tensor:
    """The fp32 values the quantized weights stand for (exact: E4M3 values times powers of two)."""
    return q_eNK.float() * s_eN.unsqueeze(-1)


def quantize_activation_rows(
    x_RK: torch.Tensor,
    col_scale_GK: torch.Tensor | None = None,
    offs_e: torch.Tensor | None = None,
    triton_kernel: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One power-of-two scale per row of ``x`` -> (E4M3 [R, K], dequantization scales [R]). With ``col_scale_GK``
    (e + 1 rows) and group ends ``offs_e`` (e), each row is first multiplied by its group's row of column scales
    (rows past the last group by row e). ``triton_kernel`` (None: on CUDA): one Triton pass, which finds each
    row's group itself (``fp8_grouped.quantize_rows_triton``); otherwise the same values from PyTorch ops."""
    if not (x_RK.is_cuda if triton_kernel is None else triton_kernel):
        t = x_RK.float()
        if col_scale_GK is not None:
            t = t * col_scale_GK[row_groups(offs_e, x_RK.shape[0])]
        return quantize_rows(t)
    return quantize_rows_triton(x_RK, col_scale_GK, offs_e)


def _kernel(t: torch.Tensor):
    return scaled_grouped_mm if t.is_cuda else emulated_scaled_grouped_mm


@functools.cache
def _ones(e: int, K: int, device: torch.device) -> torch.Tensor:
    """The FP8 input gradient's scales for the transposed weight (its row scales are folded into dy): all ones, made
    once per shape and device, read only."""
    return torch.ones(e, K, dtype=torch.float32, device=device)


@torch.library.custom_op("moe_tune::frozen_fp8_grouped_mm", mutates_args=())
def frozen_fp8_grouped_mm(
    x_RK: torch.Tensor, w_eNK: torch.Tensor, s_eN: torch.Tensor, offs_e: torch.Tensor, triton: bool = False
) -> torch.Tensor:
    """``x @ W_j^T`` for the rows of each group j, W stored as E4M3 ``[e, N, K]`` with scales ``[e, N]``.
    ``triton`` chooses the input gradient's kernel only."""
    xq_RK, sx_R = quantize_activation_rows(x_RK)
    out = _kernel(x_RK)(xq_RK, w_eNK.transpose(-2, -1), sx_R, s_eN, offs_e, FAST_ACCUM)
    return out.to(x_RK.dtype)


@frozen_fp8_grouped_mm.register_fake
def _(x_RK, w_eNK, s_eN, offs_e, triton=False):
    return x_RK.new_empty(x_RK.shape[0], w_eNK.shape[1])


@torch.library.custom_op("moe_tune::frozen_fp8_grouped_mm_input_grad", mutates_args=())
def frozen_fp8_input_grad(
    dy_RN: torch.Tensor, w_eNK: torch.Tensor, s_eN: torch.Tensor, offs_e: torch.Tensor, triton: bool = False
) -> torch.Tensor:
    """``dy @ W_j`` for the rows of each group j: the input gradient of ``frozen_fp8_grouped_mm``.
    - ``triton``: dy as it is against the dequantized weights (exact in dy's dtype); on CUDA one Triton grouped GEMM
      that reads the E4M3 tiles in their stored layout (``frozen.quantized_grouped_mm``), on the CPU
      ``frozen.dense_grouped_mm``.
    - otherwise FP8: the weight's row scales folded into dy as dy is quantized per row, the weight's bytes copied
      transposed (contraction innermost, the layout Hopper's FP8 GEMM reads), then the scaled grouped GEMM."""
    if triton:
        if dy_RN.is_cuda:
            return quantized_grouped_mm(dy_RN, w_eNK, s_eN, offs_e, transpose=False)
        return dense_grouped_mm(dy_RN, dequantize_weight(w_eNK, s_eN), offs_e, transpose=False)
    e, N, K = w_eNK.shape
    col_scale_GN = torch.cat([s_eN, s_eN.new_zeros(1, N)])  # padding rows (group e): zeros
    dyq_RN, sdy_R = quantize_activation_rows(dy_RN, col_scale_GN, offs_e)
    w_eKN = transpose_experts(w_eNK)
    out = _kernel(dy_RN)(dyq_RN, w_eKN.transpose(-2, -1), sdy_R, _ones(e, K, w_eNK.device), offs_e, FAST_ACCUM)
    return out.to(dy_RN.dtype)


@frozen_fp8_input_grad.register_fake
def _(dy_RN, w_eNK, s_eN, offs_e, triton=False):
    return dy_RN.new_empty(dy_RN.shape[0], w_eNK.shape[2])


register_input_grad(frozen_fp8_grouped_mm, frozen_fp8_input_grad)

"""The frozen base's routed experts in 4 bits (``peft.quantize_base=nf4``): NormalFloat-4 codes with one absmax scale
per block of 64 inputs (32 where a dim is no multiple of 64), and grouped GEMMs that dequantize a block of experts at a time.

NF4 (Dettmers et al., QLoRA, 2023): 16 values that are the quantiles of a standard normal, scaled to [-1, 1], so that
normally distributed weights use every code about equally often. Each block of consecutive inputs of an
expert's output row is divided by its largest magnitude (stored in bf16) and each value replaced by the index of the
nearest NF4 value; two codes per byte. 4.25 bits per weight with the scales (4.5 with blocks of 32).

``frozen_nf4_grouped_mm(x_RK, codes, scales, offs_e)`` is ``x @ W_j^T`` for the rows of group j: the experts are
dequantized into the input's dtype (one Triton pass on CUDA: ``triton_nf4``) for bf16 grouped GEMMs: all of a
projection's local experts at once where they fit ``DEQUANT_BUDGET_BYTES`` (one GEMM, no host sync), else in passes
of as many as fit, each over its own rows, found by reading the group offsets on the host (one sync per call). With
``kernels.quantized_base=triton`` on CUDA, one Triton grouped GEMM dequantizes each weight tile in registers instead
(``frozen.quantized_grouped_mm``: no dequantized experts, no sync). Backward gives the input gradient only (the base is
frozen), the same way. A custom op: torch.compile calls it as it is.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from moe_tune.kernels.frozen import quantized_grouped_mm, register_input_grad

# The NF4 values as published with QLoRA (bitsandbytes' table), ascending; code i stands for NF4[i] x the block's scale.
NF4 = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)
BLOCKS = (64, 32)  # inputs per scale: the first that divides the input dim
SCALE_DTYPE = torch.bfloat16
# Bytes of dequantized experts a GEMM holds at once. A projection's local experts that fit dequantize in one pass: one
# grouped GEMM, no host sync (Qwen3-30B-A3B's gate_up, 128 experts, is 0.75 GiB in bf16). Larger ones go in passes of
# as many experts as fit, each finding its rows from the group offsets read on the host: one sync per GEMM, which
# stalls the queue the host keeps ahead of the GPU.
DEQUANT_BUDGET_BYTES = 1 << 30
DEQUANT_BYTES = 512  # code bytes per program of the Triton dequantization
# The Triton dequantization's store (triton_nf4.dequantize_kernel): True, the two nibbles' values interleaved in
# registers and stored as one contiguous run; False, two stores each to every other element. benchmarks/
# quantized_base_gemms.py times both (benchmarks/README.md: the joined store is faster on an H100, even on an H200).
DEQUANT_JOINED = True


def block_size(in_features: int) -> int | None:
    """Inputs per scale for a projection with ``in_features`` inputs; None if no block size divides it."""
    return next((b for b in BLOCKS if in_features % b == 0), None)


@functools.cache
def _table(device: torch.device) -> torch.Tensor:
    """The NF4 values in fp32, made once per device (a copy to a GPU would wait for its stream), read only."""
    return torch.tensor(NF4, dtype=torch.float32, device=device)


def quantize_weight(w_eNK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked ``[e, out, in]`` weights (``in`` divisible by a block size) -> (codes ``[e, out, in / 2]`` uint8, the
    lower nibble first; scales ``[e, out, in / block]``)."""
    e, N, K = w_eNK.shape
    block = block_size(K)
    # Contiguous in fp32 (one copy at most): an [e, in, out] family's experts (GPT-OSS) arrive as a transposed view,
    # which would reach bucketize strided; it copies such an input itself, and warns. ``to`` converts another dtype
    # into a contiguous copy but returns an fp32 view as it is, whatever the memory format asked: ``contiguous``
    # copies that one.
    fp32 = w_eNK.to(torch.float32, memory_format=torch.contiguous_format).contiguous()
    blocks = fp32.reshape(e, N, K // block, block)
    scale = blocks.abs().amax(-1).to(SCALE_DTYPE)
    normalized = blocks / scale.float().clamp(min=torch.finfo(SCALE_DTYPE).tiny).unsqueeze(-1)
    table = _table(w_eNK.device)
    # The nearest NF4 value: the count of midpoints between neighbours that lie below the value.
    midpoints = (table[1:] + table[:-1]) / 2
    codes = torch.bucketize(normalized.reshape(e, N, K), midpoints).to(torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.contiguous(), scale.contiguous()


def dequantize_weight(
    codes: torch.Tensor, scales: torch.Tensor, dtype=torch.float32, triton_kernel: bool | None = None
) -> torch.Tensor:
    """``[e, out, in]`` in ``dtype``: each code's NF4 value times its block's scale (the product in fp32).
    ``triton_kernel`` (None: on CUDA): one Triton pass; otherwise PyTorch ops, the same values."""
    e, N, half = codes.shape
    table = _table(codes.device)
    if codes.is_cuda if triton_kernel is None else triton_kernel:
        from moe_tune.kernels.triton_nf4 import dequantize_kernel

        out = torch.empty(e, N, 2 * half, dtype=dtype, device=codes.device)
        if out.numel():
            grid = (e * N, -(-half // DEQUANT_BYTES))
            block = 2 * half // scales.shape[-1]
            dequantize_kernel[grid](
                codes, scales, table, out, half, block, BLOCK_BYTES=DEQUANT_BYTES, JOINED=DEQUANT_JOINED
            )
        return out
    values = torch.stack([table[(codes & 0xF).long()], table[(codes >> 4).long()]], dim=-1).reshape(e, N, 2 * half)
    blocks = values.reshape(e, N, scales.shape[-1], -1) * scales.float().unsqueeze(-1)
    return blocks.reshape(e, N, 2 * half).to(dtype)


def _grouped(a_RK: torch.Tensor, codes, scales, offs_e: torch.Tensor, transpose: bool, triton: bool) -> torch.Tensor:
    """``a @ W_j^T`` (``transpose``) or ``a @ W_j`` for the rows of each group j; rows past the last group are 0.
    ``triton`` on CUDA: one Triton grouped GEMM that dequantizes each weight tile in registers
    (``frozen.quantized_grouped_mm``); otherwise the experts dequantized in passes of ``DEQUANT_BUDGET_BYTES``, one
    grouped GEMM each."""
    if triton and a_RK.is_cuda:
        return quantized_grouped_mm(a_RK, codes, scales, offs_e, transpose=transpose, table=_table(a_RK.device))
    if fits_one_pass(codes, a_RK.dtype):
        w = dequantize_weight(codes, scales, a_RK.dtype)
        return _routed_grouped_mm(a_RK, w.transpose(-2, -1) if transpose else w, offs_e)
    e, N, half = codes.shape
    per_pass = max(1, DEQUANT_BUDGET_BYTES // (N * 2 * half * a_RK.element_size()))
    out_dim = N if transpose else 2 * half
    bounds = [0, *offs_e.tolist()]  # host sync: each pass's rows
    pieces = []
    for j0 in range(0, e, per_pass):
        j1 = min(j0 + per_pass, e)
        start, stop = bounds[j0], bounds[j1]
        if start == stop:
            continue
        w = dequantize_weight(codes[j0:j1], scales[j0:j1], a_RK.dtype)
        w = w.transpose(-2, -1) if transpose else w
        pieces.append(F.grouped_mm(a_RK[start:stop], w, offs=(offs_e[j0:j1] - start).to(torch.int32)))
    if bounds[-1] < a_RK.shape[0]:  # a dispatcher's padding rows
        pieces.append(a_RK.new_zeros(a_RK.shape[0] - bounds[-1], out_dim))
    if not pieces:
        return a_RK.new_zeros(0, out_dim)
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0]


def _routed_grouped_mm(a_RK: torch.Tensor, w: torch.Tensor, offs_e: torch.Tensor) -> torch.Tensor:
    """One grouped GEMM over all rows with every expert's dequantized weights: nothing read on the host. The GEMM
    leaves rows past the last group unwritten; they are set to 0 on the device."""
    out = F.grouped_mm(a_RK, w, offs=offs_e)
    routed = torch.arange(a_RK.shape[0], device=a_RK.device) < offs_e[-1]
    return torch.where(routed.unsqueeze(-1), out, 0)


@torch.library.custom_op("moe_tune::frozen_nf4_grouped_mm", mutates_args=())
def frozen_nf4_grouped_mm(
    x_RK: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, offs_e: torch.Tensor, triton: bool = False
) -> torch.Tensor:
    """``x @ W_j^T`` for the rows of each group j, W stored as NF4 codes ``[e, N, K / 2]`` and scales."""
    return _grouped(x_RK, codes, scales, offs_e, transpose=True, triton=triton)


@frozen_nf4_grouped_mm.register_fake
def _(x_RK, codes, scales, offs_e, triton=False):
    return x_RK.new_empty(x_RK.shape[0], codes.shape[1])


@torch.library.custom_op("moe_tune::frozen_nf4_grouped_mm_input_grad", mutates_args=())
def frozen_nf4_input_grad(
    dy_RN: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, offs_e: torch.Tensor, triton: bool = False
) -> torch.Tensor:
    """``dy @ W_j`` for the rows of each group j: the input gradient of ``frozen_nf4_grouped_mm``."""
    return _grouped(dy_RN, codes, scales, offs_e, transpose=False, triton=triton)


@frozen_nf4_input_grad.register_fake
def _(dy_RN, codes, scales, offs_e, triton=False):
    return dy_RN.new_empty(dy_RN.shape[0], 2 * codes.shape[2])


register_input_grad(frozen_nf4_grouped_mm, frozen_nf4_input_grad)


@torch.library.custom_op("moe_tune::nf4_dequantize", mutates_args=())
def dequantize_op(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``dequantize_weight`` as an op torch.compile calls as it is (the frozen codes take no gradient)."""
    return dequantize_weight(codes, scales, dtype)


@dequantize_op.register_fake
def _(codes, scales, dtype):
    return codes.new_empty(*codes.shape[:-1], 2 * codes.shape[-1], dtype=dtype)


def fits_one_pass(codes: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether a projection's local experts dequantized in ``dtype`` fit ``DEQUANT_BUDGET_BYTES``."""
    e, N, half = codes.shape
    return e * N * 2 * half * dtype.itemsize <= DEQUANT_BUDGET_BYTES


def grouped_mm_keeping_dequantized(x_RK: torch.Tensor, codes, scales, offs_e: torch.Tensor) -> torch.Tensor:
    """``frozen_nf4_grouped_mm`` for a layer recomputed in backward (full activation checkpointing): every expert
    dequantized at once, then a differentiable bf16 grouped GEMM whose autograd saves the dequantized experts for
    the input gradient. Under checkpointing the first forward's saved tensors are dropped and the recompute's live
    until the layer's backward, so a projection is dequantized twice per step (forward, recompute), not three
    times, for one layer's dequantized experts held from its recompute to its backward. Without checkpointing every
    layer would keep them: ``frozen_nf4_grouped_mm`` there. The caller checks ``fits_one_pass``."""
    return _routed_grouped_mm(x_RK, dequantize_op(codes, scales, x_RK.dtype).transpose(-2, -1), offs_e)

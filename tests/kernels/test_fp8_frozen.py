"""The frozen base's FP8 experts (``peft.quantize_base=fp8``, moe_tune/kernels/fp8_frozen.py): weight quantization
round trips, the grouped GEMM and its input gradient against fp32 matmuls of the dequantized operands (the CPU
emulation of the kernel; the GPU test runs the real one), and the Triton quantization pass (through Triton's
interpreter on the CPU) bit for bit against PyTorch's."""

from __future__ import annotations

import pytest
import torch

from moe_tune.kernels.fp8_frozen import (
    dequantize_weight,
    frozen_fp8_grouped_mm,
    quantize_activation_rows,
    quantize_weight,
    transpose_experts,
)
from moe_tune.kernels.fp8_grouped import quantize_rows, quantize_rows_fused
from tests.harness import compile_for_hopper, triton_interpreted
from tests.tiny import rel_err

E4M3_MAX = 448.0
COUNTS = [5, 0, 19, 8]  # an empty group; 4 rows of a dispatcher's padding follow the last group


def _operands(N=32, K=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(len(COUNTS), N, K, generator=g) * torch.linspace(0.1, 4, N).unsqueeze(-1)  # rows of all sizes
    x = torch.randn(sum(COUNTS) + 4, K, generator=g)
    offs = torch.tensor(COUNTS).cumsum(0).to(torch.int32)
    return w, x, offs


def _groups():
    return torch.repeat_interleave(torch.arange(len(COUNTS)), torch.tensor(COUNTS))


def test_weight_round_trip_is_within_e4m3_rounding_with_power_of_two_row_scales():
    w, _, _ = _operands()
    q, s = quantize_weight(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape and s.shape == w.shape[:2]
    assert torch.equal(torch.exp2(torch.log2(s).round()), s)  # powers of two: scaling adds no rounding
    row_max = q.float().abs().amax(-1)
    assert bool((row_max >= E4M3_MAX / 2).all() and (row_max <= E4M3_MAX).all())  # each row in E4M3's top octave
    back = dequantize_weight(q, s)
    # E4M3 keeps 3 mantissa bits: half a step is 2^-4 of the value; below the normal range (2^-6), 2^-10 absolute.
    bound = torch.maximum(w.abs() * 2**-4, s.unsqueeze(-1) * 2**-10)
    assert bool(((back - w).abs() <= bound).all())
    # Values that are E4M3 numbers times a power of two come back exactly.
    assert torch.equal(dequantize_weight(*quantize_weight(back)), back)


def test_grouped_mm_equals_fp32_matmuls_of_the_dequantized_operands():
    """Forward: x quantized per row, times each group's dequantized weights, in fp32 (then bf16): within bf16's
    rounding of the output; within FP8's error of the unquantized product; padding rows are 0."""
    w, x, offs = _operands()
    q, s = quantize_weight(w)
    y = frozen_fp8_grouped_mm(x, q, s, offs)
    xq, sx = quantize_rows(x)
    x_deq = xq.float() * sx.unsqueeze(-1)
    groups, rows = _groups(), sum(COUNTS)
    ref = torch.einsum("rk,rnk->rn", x_deq[:rows], dequantize_weight(q, s)[groups])
    assert rel_err(y[:rows], ref) < 4e-3
    assert rel_err(y[:rows], torch.einsum("rk,rnk->rn", x[:rows], w[groups])) < 6e-2
    assert not y[rows:].any()


def test_input_gradient_folds_the_weight_scales_into_dy():
    """kernels.quantized_base=torch: dx = dy @ W_j, W the dequantized weights, within FP8's error in dy of the fp32
    product, and within bf16's output rounding of dy quantized per row after it is multiplied by the weight's row
    scales (what the kernel computes). No gradient reaches the weights; padding rows get 0."""
    w, x, offs = _operands()
    q, s = quantize_weight(w)
    x = x.requires_grad_()
    dy = torch.randn(x.shape[0], w.shape[1], generator=torch.Generator().manual_seed(1))
    frozen_fp8_grouped_mm(x, q, s, offs).backward(dy)
    groups, rows = _groups(), sum(COUNTS)
    w_deq = dequantize_weight(q, s)
    assert rel_err(x.grad[:rows], torch.einsum("rn,rnk->rk", dy[:rows], w_deq[groups])) < 6e-2
    dyq, sdy = quantize_rows(dy[:rows] * s[groups])
    exact = torch.einsum("rn,rnk->rk", dyq.float() * sdy.unsqueeze(-1), q.float()[groups])
    assert rel_err(x.grad[:rows], exact) < 4e-3
    assert not x.grad[rows:].any()


def test_triton_input_gradient_is_dy_times_the_dequantized_weights():
    """kernels.quantized_base=triton: dx = dy @ W_j with dy as it is (no FP8 rounding of the gradient) and W the
    dequantized weights: the fp32 product per group within fp32 rounding (the CPU's reference of the Triton GEMM,
    tests/kernels/test_frozen_gemm.py). Padding rows get 0."""
    w, x, offs = _operands()
    q, s = quantize_weight(w)
    x = x.requires_grad_()
    dy = torch.randn(x.shape[0], w.shape[1], generator=torch.Generator().manual_seed(1))
    frozen_fp8_grouped_mm(x, q, s, offs, True).backward(dy)
    groups, rows = _groups(), sum(COUNTS)
    assert rel_err(x.grad[:rows], torch.einsum("rn,rnk->rk", dy[:rows], dequantize_weight(q, s)[groups])) < 1e-6
    assert not x.grad[rows:].any()


def _triton_matches_pytorch() -> None:
    """Rows of a width that is no power of two (masked lanes), a zero row, a row whose amax is exactly 448 x 2^-3,
    bf16 input; without and with column scales gathered by each row's group (the input gradient's pass). The
    scales, bit for bit. The E4M3 values are the GPU test's: Triton 3.9's interpreter converts fp32 to E4M3 with
    rounding of its own (-31.6 to -16), where a GPU converts in hardware."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(6, 48, generator=g) * torch.tensor([1, 1e-3, 30, 1, 1, 1]).unsqueeze(-1)).to(torch.bfloat16)
    x[3] = 0
    x[4, 7] = E4M3_MAX / 8
    # Each group's column scales twice the one before: a row read with another group's scales gets another scale.
    col_scale = torch.exp2(torch.randint(-3, 4, (1, 48), generator=g).float()) * torch.tensor([[1.0], [2.0], [4.0]])
    offs = torch.tensor([1, 3], dtype=torch.int32)  # rows 0 | 1, 2 | 3, 4, 5 past the last group (row 2 of scales)
    for args in ((x,), (x, col_scale, offs)):
        got = quantize_activation_rows(*args, triton_kernel=True)
        want = quantize_activation_rows(*args, triton_kernel=False)
        assert torch.equal(got[1], want[1])
    # kernels.experts=grouped_mm_fp8's weights, stacked [e, N, K]: one scale per (expert, row), the same bits.
    w3 = torch.randn(3, 5, 48, generator=g).to(torch.bfloat16) * torch.logspace(-2, 2, 5).view(1, 5, 1)
    (q, s), s_ref = quantize_rows_fused(w3, triton_kernel=True), quantize_rows(w3)[1]
    assert q.shape == w3.shape and s.shape == (3, 5) and torch.equal(s, s_ref)
    # The input gradient's transposed copy of the experts: bytes moved, none changed (dims no multiple of the tile).
    w = quantize_weight(torch.randn(3, 70, 100, generator=g))[0]
    got = transpose_experts(w, triton_kernel=True)
    assert got.is_contiguous() and torch.equal(got.view(torch.uint8), w.transpose(-2, -1).view(torch.uint8))


def test_triton_quantization_equals_pytorch_bit_for_bit():
    triton_interpreted(
        f"import {__name__} as t; t._triton_matches_pytorch()", "test_kernel_on_the_gpu_equals_its_cpu_emulation"
    )


def test_triton_kernels_compile_for_hopper():
    """The quantization and transpose kernels compiled for sm90 on the CPU (what the interpreter cannot check)."""
    from moe_tune.kernels.triton_fp8 import quantize_rows_kernel, transpose_kernel

    for has_col_scale in (False, True):
        compile_for_hopper(
            quantize_rows_kernel,
            dict(x_ptr="*bf16", q_ptr="*fp8e4nv", inv_scale_ptr="*fp32", col_scale_ptr="*fp32", offs_ptr="*i32"),
            dict(num_groups="i32", K="i32", x_row_stride="i64"),
            dict(HAS_COL_SCALE=has_col_scale, BLOCK=2048, BLOCK_GROUPS=128),
        )
    compile_for_hopper(
        transpose_kernel, dict(x_ptr="*u8", out_ptr="*u8"), dict(N="i32", K="i32"), dict(BLOCK_N=64, BLOCK_K=64)
    )


@pytest.mark.gpu
def test_kernel_on_the_gpu_equals_its_cpu_emulation():
    """torch._scaled_grouped_mm with the Triton quantization (sm90) against the CPU path, forward and input
    gradient, Qwen3-30B-A3B's expert dims: within the accumulation order's and fast accumulation's difference."""
    g = torch.Generator().manual_seed(0)
    counts = [300, 0, 1200, 548]
    w = torch.randn(len(counts), 1536, 2048, generator=g) / 40
    x = torch.randn(sum(counts) + 16, 2048, generator=g).to(torch.bfloat16)
    dy = torch.randn(x.shape[0], 1536, generator=g).to(torch.bfloat16)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    results = []
    for device in ("cpu", "cuda"):
        q, s = quantize_weight(w.to(device))
        xi = x.to(device, copy=True).requires_grad_()  # a leaf on each device (x itself stays without grad)
        y = frozen_fp8_grouped_mm(xi, q, s, offs.to(device))
        y.backward(dy.to(device))
        rows = sum(counts)
        results.append((y[:rows].float().cpu(), xi.grad[:rows].float().cpu()))
    (y_cpu, dx_cpu), (y_gpu, dx_gpu) = results
    assert rel_err(y_gpu, y_cpu) < 5e-3 and rel_err(dx_gpu, dx_cpu) < 5e-3
    xg = x.cuda()
    got, want = (quantize_activation_rows(xg, triton_kernel=t) for t in (True, False))
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got[1], want[1])

"""The Triton grouped GEMM on the frozen base's quantized experts (moe_tune/kernels/frozen.py, triton_frozen.py):
both directions (``a @ W^T``, the forward; ``a @ W``, the input gradient) in both formats (FP8 row scales, NF4 block
scales) against one fp32 matmul per group of the dequantized weights. On the CPU through Triton's interpreter in
fp32 (within fp32 rounding); on a GPU in bf16 at Qwen3-30B-A3B's expert dims (within bf16's output rounding)."""

from __future__ import annotations

import pytest
import torch

from moe_tune.kernels import fp8_frozen, nf4_frozen
from moe_tune.kernels.frozen import dense_grouped_mm, quantized_grouped_mm
from tests.harness import compile_for_hopper, triton_interpreted
from tests.tiny import rel_err


def _check(counts, N, K, dtype, device, tolerance, config=None):
    """Groups of ``counts`` rows (empty ones, some past a tile, 5 padding rows after the last group)."""
    g = torch.Generator().manual_seed(0)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32).to(device)
    rows = sum(counts)
    w = (torch.randn(len(counts), N, K, generator=g) / 20).to(device)
    stored = {
        "fp8": (*fp8_frozen.quantize_weight(w), None, fp8_frozen.dequantize_weight),
        "nf4": (*nf4_frozen.quantize_weight(w), nf4_frozen._table(w.device), nf4_frozen.dequantize_weight),
    }
    for name, (q, s, table, dequantize) in stored.items():
        w_deq = dequantize(q, s)
        for transpose, width in ((True, K), (False, N)):
            a = torch.randn(rows + 5, width, generator=g).to(device, dtype)
            got = quantized_grouped_mm(a, q, s, offs, transpose=transpose, table=table, config=config)
            want = dense_grouped_mm(a, w_deq, offs, transpose=transpose)
            assert rel_err(got[:rows], want[:rows]) < tolerance, (name, transpose)
            assert not got[rows:].any(), (name, transpose)


def _interpreted() -> None:
    # N and K no multiple of the tiles (masked lanes); a group of more rows than a tile; NF4 blocks of 64 and 32.
    for K in (128, 96):
        _check([70, 0, 3, 140], 40, K, torch.float32, "cpu", 1e-6, config=(64, 64, 4, 2))


def test_kernel_equals_fp32_matmuls_of_the_dequantized_weights():
    triton_interpreted(f"import {__name__} as t; t._interpreted()", "test_kernel_on_the_gpu_at_qwen3_dims")


def test_kernel_compiles_for_hopper():
    """Compiled ahead of time for sm90 on the CPU: the interpreter runs code that the GPU compiler refuses (code
    after a constexpr if's return is compiled for the other format's pointers too)."""
    from moe_tune.kernels.frozen import BLOCK_M, CONFIGS
    from moe_tune.kernels.triton_frozen import frozen_grouped_mm_kernel

    pointers = dict(a_ptr="*bf16", table_ptr="*fp32", offs_ptr="*i32", tile_ends_ptr="*i32", out_ptr="*bf16")
    sizes = dict.fromkeys(("R", "N", "K", "num_groups", "scales_per_row"), "i32")
    o, c, warps, stages = CONFIGS[0]
    for fmt, weights, scales in ((0, "*fp8e4nv", "*fp32"), (1, "*u8", "*bf16")):
        for transpose in (True, False):
            ptx = compile_for_hopper(
                frozen_grouped_mm_kernel,
                {**pointers, "w_ptr": weights, "s_ptr": scales},
                sizes,
                dict(
                    FORMAT=fmt,
                    SCALE_BLOCK=64,
                    TRANSPOSE=transpose,
                    IEEE=False,
                    BLOCK_M=BLOCK_M,
                    BLOCK_O=o,
                    BLOCK_C=c,
                    BLOCK_GROUPS=256,
                ),  # fmt: skip
                num_warps=warps,
                num_stages=stages,
            )
            assert "mma" in ptx, (fmt, transpose)  # tl.dot became tensor-core instructions


@pytest.mark.gpu
def test_kernel_on_the_gpu_at_qwen3_dims():
    for N, K in ((1536, 2048), (2048, 768)):
        _check([300, 0, 1200, 548, 1], N, K, torch.bfloat16, "cuda", 5e-3)

"""The frozen base's 4-bit experts (``peft.quantize_base=nf4``, moe_tune/kernels/nf4_frozen.py): each weight becomes
the NF4 value nearest to it in its block's scale (checked against a brute-force search), and the grouped GEMM and its
input gradient equal fp32 matmuls of the dequantized weights, across the passes that dequantize a block of experts
at a time (empty groups on both sides of a pass's boundary, rows of a dispatcher's padding)."""

from __future__ import annotations

import pytest
import torch

from moe_tune.kernels import nf4_frozen
from moe_tune.kernels.nf4_frozen import NF4, dequantize_weight, frozen_nf4_grouped_mm, quantize_weight
from tests.harness import triton_interpreted
from tests.tiny import rel_err

PER_PASS = 32  # experts per pass where the dequantization budget is made to hold that many (monkeypatched)
E = PER_PASS + 4  # two passes
COUNTS = [3] * 5 + [0] * (PER_PASS - 5) + [0, 9, 0, 4]  # pass 1 ends empty, pass 2 starts so


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_transposed_weight_quantizes_as_its_contiguous_copy_without_a_warning(dtype):
    """A stacked weight stored transposed (``[e, in, out]`` viewed as ``[e, out, in]``, as GPT-OSS's experts), from a
    bf16 or an fp32 checkpoint: the same codes and scales as its contiguous copy, and no warning of a non-contiguous
    input (torch's searchsorted warns once per process: made to warn always here)."""
    import warnings

    w = torch.randn(3, 96, 40, generator=torch.Generator().manual_seed(0)).to(dtype).transpose(1, 2)
    assert not w.is_contiguous()
    was = torch.is_warn_always_enabled()
    torch.set_warn_always(True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            codes, scales = quantize_weight(w)
    finally:
        torch.set_warn_always(was)
    want_codes, want_scales = quantize_weight(w.contiguous())
    assert torch.equal(codes, want_codes) and torch.equal(scales, want_scales)


@pytest.mark.parametrize("K, block", [(128, 64), (96, 32)])
def test_each_weight_becomes_the_nearest_nf4_value_of_its_block(K, block):
    w = torch.randn(3, 8, K, generator=torch.Generator().manual_seed(0))
    codes, scales = quantize_weight(w)
    assert codes.dtype == torch.uint8 and codes.shape == (3, 8, K // 2) and scales.shape == (3, 8, K // block)
    blocks = w.reshape(3, 8, K // block, block)
    assert torch.equal(scales, blocks.abs().amax(-1).to(torch.bfloat16))
    table = torch.tensor(NF4)
    normalized = blocks / scales.float().unsqueeze(-1)
    nearest = (normalized.unsqueeze(-1) - table).abs().argmin(-1).reshape(3, 8, K)
    want = table[nearest].reshape(3, 8, K // block, block) * scales.float().unsqueeze(-1)
    assert torch.equal(dequantize_weight(codes, scales), want.reshape(3, 8, K))
    back = dequantize_weight(codes, scales)
    assert torch.equal(dequantize_weight(*quantize_weight(back)), back)  # NF4 values times the scale stay as they are


@pytest.mark.parametrize("passes", [1, 2])
def test_grouped_mm_and_input_gradient_equal_fp32_matmuls_of_the_dequantized_weights(monkeypatch, passes):
    """Every expert in one pass (nothing read on the host), and in two passes of PER_PASS experts."""
    per_pass = E if passes == 1 else PER_PASS
    monkeypatch.setattr(nf4_frozen, "DEQUANT_BUDGET_BYTES", per_pass * 24 * 64 * 4)  # fp32 [24, 64] experts
    monkeypatch.setattr(torch.Tensor, "tolist", _no_host_read if passes == 1 else torch.Tensor.tolist)
    g = torch.Generator().manual_seed(1)
    codes, scales = quantize_weight(torch.randn(E, 24, 64, generator=g))
    w = dequantize_weight(codes, scales)
    rows = sum(COUNTS)
    x = torch.randn(rows + 3, 64, generator=g, requires_grad=True)
    offs = torch.tensor(COUNTS).cumsum(0).to(torch.int32)
    y = frozen_nf4_grouped_mm(x, codes, scales, offs)
    dy = torch.randn(rows + 3, 24, generator=g)
    y.backward(dy)
    groups = torch.repeat_interleave(torch.arange(E), torch.tensor(COUNTS))
    assert rel_err(y[:rows], torch.einsum("rk,rnk->rn", x[:rows].detach(), w[groups])) < 1e-6
    assert rel_err(x.grad[:rows], torch.einsum("rn,rnk->rk", dy[:rows], w[groups])) < 1e-6
    assert not y[rows:].any() and not x.grad[rows:].any()


def _no_host_read(t):
    raise AssertionError("one pass reads nothing on the host")


def _triton_matches_pytorch() -> None:
    """Rows whose byte count is no multiple of a program's (masked lanes), blocks of 64 and of 32; in fp32 (Triton
    3.9's interpreter converts fp32 to bf16 by truncation, where a GPU rounds to nearest: the GPU test checks bf16)."""
    g = torch.Generator().manual_seed(2)
    for K, joined in ((640, False), (96, False), (640, True), (96, True)):  # both of the kernel's stores
        nf4_frozen.DEQUANT_JOINED = joined
        codes, scales = quantize_weight(torch.randn(3, 5, K, generator=g))
        got = dequantize_weight(codes, scales, torch.float32, triton_kernel=True)
        assert torch.equal(got, dequantize_weight(codes, scales, torch.float32, triton_kernel=False)), (K, joined)


def test_triton_dequantization_equals_pytorch_bit_for_bit():
    triton_interpreted(
        f"import {__name__} as t; t._triton_matches_pytorch()", "test_dequantization_on_the_gpu_equals_pytorch"
    )


@pytest.mark.gpu
def test_dequantization_on_the_gpu_equals_pytorch(monkeypatch):
    g = torch.Generator().manual_seed(3)
    codes, scales = quantize_weight(torch.randn(4, 1536, 2048, generator=g).cuda())
    want = dequantize_weight(codes, scales, torch.bfloat16, triton_kernel=False)
    for joined in (False, True):
        monkeypatch.setattr(nf4_frozen, "DEQUANT_JOINED", joined)
        assert torch.equal(dequantize_weight(codes, scales, torch.bfloat16, triton_kernel=True), want), joined


def test_the_recompute_gemm_is_the_custom_ops_in_bf16_with_padding_rows_zero():
    """``grouped_mm_keeping_dequantized`` (full activation checkpointing's path) gives ``frozen_nf4_grouped_mm``'s
    output bit for bit in bf16, the dispatcher's padding rows past the last group 0 (the GEMM leaves them unwritten:
    garbage without the mask), and its input gradient is the custom op's."""
    g = torch.Generator().manual_seed(0)
    codes, scales = quantize_weight(torch.randn(3, 16, 64, generator=g))
    x = torch.randn(10, 64, generator=g).to(torch.bfloat16)  # 7 routed rows, 3 of padding
    offs = torch.tensor([2, 5, 7], dtype=torch.int32)
    dy = torch.randn(10, 16, generator=g).to(torch.bfloat16)
    outs, grads = [], []
    for gemm in (nf4_frozen.grouped_mm_keeping_dequantized, frozen_nf4_grouped_mm):
        xg = x.clone().requires_grad_()
        out = gemm(xg, codes, scales, offs)
        out.backward(dy)
        outs.append(out)
        grads.append(xg.grad[:7])  # the padding rows' input gradient is nobody's
    assert outs[0].dtype == torch.bfloat16
    assert torch.equal(outs[0][7:], torch.zeros(3, 16, dtype=torch.bfloat16))
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(grads[0], grads[1])


def test_the_dequantize_ops_fake_gives_its_shape_and_dtype():
    """torch.compile sees ``dequantize_op`` through its fake: ``[e, out, in]`` in the dtype asked (opcheck compares
    fake and real), as ``dequantize_weight`` gives it."""
    codes, scales = quantize_weight(torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(0)))
    for dtype in (torch.bfloat16, torch.float32):
        w = nf4_frozen.dequantize_op(codes, scales, dtype)
        assert w.shape == (2, 8, 64) and w.dtype == dtype
        assert torch.equal(w, dequantize_weight(codes, scales, dtype))
        torch.library.opcheck(nf4_frozen.dequantize_op, (codes, scales, dtype))


def test_one_pass_fits_the_budget_up_to_its_last_byte(monkeypatch):
    """``fits_one_pass``: a projection's experts dequantized in the input's dtype (``e x N x K`` elements, K twice
    the code bytes) against ``DEQUANT_BUDGET_BYTES``, equal included."""
    codes = torch.zeros(4, 16, 32, dtype=torch.uint8)  # K = 64
    for dtype, size in ((torch.bfloat16, 2), (torch.float32, 4)):
        monkeypatch.setattr(nf4_frozen, "DEQUANT_BUDGET_BYTES", 4 * 16 * 64 * size)
        assert nf4_frozen.fits_one_pass(codes, dtype)
        monkeypatch.setattr(nf4_frozen, "DEQUANT_BUDGET_BYTES", 4 * 16 * 64 * size - 1)
        assert not nf4_frozen.fits_one_pass(codes, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_each_pass_dequantizes_as_many_experts_as_fit_the_budget(monkeypatch, dtype):
    """Experts that do not fit ``DEQUANT_BUDGET_BYTES`` at once go in passes of as many as fit: the budget holds
    3 1/2 experts in the input's dtype, so 10 experts go in passes of 3, 3, 3 and 1, none over the budget."""
    e, N, K = 10, 16, 64
    monkeypatch.setattr(nf4_frozen, "DEQUANT_BUDGET_BYTES", 7 * N * K * dtype.itemsize // 2)
    passes = []
    dequantize = nf4_frozen.dequantize_weight

    def recorded(codes, scales, dtype=torch.float32, triton_kernel=None):
        passes.append(codes.shape[0])
        return dequantize(codes, scales, dtype, triton_kernel)

    monkeypatch.setattr(nf4_frozen, "dequantize_weight", recorded)
    codes, scales = quantize_weight(torch.randn(e, N, K, generator=torch.Generator().manual_seed(4)))
    x = torch.randn(2 * e, K, dtype=dtype)
    frozen_nf4_grouped_mm(x, codes, scales, torch.arange(2, 2 * e + 1, 2, dtype=torch.int32))
    assert passes == [3, 3, 3, 1]

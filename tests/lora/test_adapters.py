"""The grouped expert adapters: the grouped GEMM path equals the per-expert loop (forward and adapter gradients),
an adapter with B = 0 leaves the experts as they are, and ``delta_weight`` is the update the forward applies."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe_tune.lora import LoRASpec
from moe_tune.moe.experts import ExpertsOptions, ExpertsSpec, GroupedExperts
from tests.tiny import LORA_TOL, rel_err

SPEC = ExpertsSpec(num_experts=4, dim=24, hidden=20)  # gate/up 40 x 24, down 24 x 20: no square weight
GPT_OSS = ExpertsSpec(num_experts=4, dim=24, hidden=20, layout="in_out", bias=True, activation="clamped_swiglu")


def _experts(spec: ExpertsSpec, impl: str = "grouped_mm", seed: int = 0, lora: LoRASpec | None = None):
    torch.manual_seed(seed)
    m = GroupedExperts(spec, ExpertsOptions(impl=impl), lora=lora or LoRASpec(rank=8, alpha=16))
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)
    return m


def _rows(spec: ExpertsSpec):
    counts = torch.tensor([3, 0, 5, 2])  # an expert without rows included
    return torch.randn(int(counts.sum()), spec.dim, generator=torch.Generator().manual_seed(1)), counts


@pytest.mark.parametrize("spec", [SPEC, GPT_OSS], ids=["out_in", "in_out_gpt_oss"])
def test_grouped_adapters_equal_the_loop(spec):
    grouped, loop = _experts(spec), _experts(spec, impl="loop")
    x, counts = _rows(spec)
    y_grouped, y_loop = grouped(x, counts), loop(x, counts)
    torch.testing.assert_close(y_grouped, y_loop, rtol=1e-5, atol=1e-5)
    y_grouped.square().sum().backward()
    y_loop.square().sum().backward()
    for (name, a), (_, b) in zip(grouped.lora.named_parameters(), loop.lora.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("spec", [SPEC, GPT_OSS], ids=["out_in", "in_out_gpt_oss"])
def test_delta_weight_is_what_forward_adds(spec):
    """Experts with the adapter == plain experts whose weights have delta_weight added (in their layout)."""
    adapted = _experts(spec)
    plain = GroupedExperts(spec)
    with torch.no_grad():
        for name, p in plain.named_parameters():
            p.copy_(dict(adapted.named_parameters())[name])
        for proj in ("gate_up", "down"):
            delta = adapted.lora.delta_weight(proj)
            getattr(plain, f"{proj}_proj").add_(delta if spec.layout == "out_in" else delta.transpose(-2, -1))
    x, counts = _rows(spec)
    assert rel_err(plain(x, counts), adapted(x, counts)) < LORA_TOL


def test_zero_b_leaves_the_experts_unchanged():
    adapted = _experts(SPEC)
    with torch.no_grad():
        adapted.lora.gate_up_B.zero_()
        adapted.lora.down_B.zero_()
    plain = GroupedExperts(SPEC)
    with torch.no_grad():
        for name, p in plain.named_parameters():
            p.copy_(dict(adapted.named_parameters())[name])
    x, counts = _rows(SPEC)
    assert torch.equal(adapted(x, counts), plain(x, counts))


def test_dropout_acts_on_the_adapter_path_only_in_training():
    spec = dataclasses.replace(LoRASpec(rank=8), dropout=0.5)
    m = _experts(SPEC, lora=spec)
    x, counts = _rows(SPEC)
    m.eval()
    assert torch.equal(m(x, counts), m(x, counts))
    m.train()
    assert not torch.equal(m(x, counts), m(x, counts))


@pytest.mark.gpu
def test_grouped_adapters_on_cuda_bf16_equal_the_loop():
    """grouped_mm's CUDA kernels with rank-16 adapters in bf16 (the alignment the rank must keep) against the loop."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    spec = ExpertsSpec(num_experts=8, dim=256, hidden=128)
    lora = LoRASpec(rank=16, alpha=32)
    grouped = _experts(spec, lora=lora).cuda().bfloat16()
    loop = _experts(spec, impl="loop", lora=lora).cuda().bfloat16()
    counts = torch.tensor([64, 0, 17, 3, 128, 1, 40, 7], device="cuda")
    x = torch.randn(int(counts.sum()), spec.dim, device="cuda", dtype=torch.bfloat16)
    y_grouped, y_loop = grouped(x, counts), loop(x, counts)
    torch.testing.assert_close(y_grouped.float(), y_loop.float(), rtol=2e-2, atol=2e-2)
    y_grouped.float().square().sum().backward()
    y_loop.float().square().sum().backward()
    a, b = grouped.lora.gate_up_A.grad.float(), loop.lora.gate_up_A.grad.float()
    assert (a - b).norm() <= 2e-2 * b.norm()

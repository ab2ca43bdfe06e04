"""optim.weight_decay leaves norms, biases and other 1-D parameters alone unless optim.decay_norms_and_biases=true
(Megatron's rule; Transformers' Trainer: norms and biases), in every family's moe_tune model: GPT-OSS's attention
sinks, router bias and stacked expert biases included; DeepSeek-V3's router correction bias is a buffer, never
decayed."""

from __future__ import annotations

import pytest
import torch

from moe_tune.config import OptimConfig
from moe_tune.optim import build_optimizer
from tests.tiny import FAMILIES, save_tiny

LR, WD = 0.5, 0.1  # one zero-gradient step multiplies a decayed weight by 1 - LR x WD = 0.95


def _model(tmp_path, family: str):
    from moe_tune.build import from_pretrained

    return from_pretrained(save_tiny(tmp_path / family, family))


def _expected_decayed(name: str, p: torch.Tensor) -> bool:
    """Written out by kind, not by the rule under test: matrices are decayed; norms, biases, sinks are not."""
    if "norm" in name or name.endswith("bias") or name.endswith("sinks"):
        return False
    assert p.ndim >= 2, name  # no other kind of 1-D parameter in these models
    return True


def _decay_by_name(model, optimizer) -> dict[str, float]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: g["weight_decay"] for g in optimizer.param_groups for p in g["params"]}


@pytest.mark.parametrize("family", FAMILIES)
def test_norms_biases_and_sinks_are_not_decayed(tmp_path, family):
    model = _model(tmp_path, family)
    opt = build_optimizer(model.named_parameters(), OptimConfig(weight_decay=WD), LR)
    decay = _decay_by_name(model, opt)
    assert set(decay) == {n for n, p in model.named_parameters() if p.requires_grad}
    assert {n: d > 0 for n, d in decay.items()} == {n: _expected_decayed(n, p) for n, p in model.named_parameters()}
    assert any(d == 0 for d in decay.values()) and any(d == WD for d in decay.values())
    if family == "gpt_oss":  # the kinds that only GPT-OSS has
        for end in (
            "self_attn.sinks",
            "mlp.router.bias",
            "mlp.experts.gate_up_proj_bias",
            "mlp.experts.down_proj_bias",
        ):
            assert decay[f"model.layers.0.{end}"] == 0, end
    if family == "deepseek_v3":
        assert any("e_score_correction_bias" in n for n, _ in model.named_buffers())
        assert not any("e_score_correction_bias" in n for n in decay)

    everything = build_optimizer(
        model.named_parameters(), OptimConfig(weight_decay=WD, decay_norms_and_biases=True), LR
    )
    assert set(_decay_by_name(model, everything).values()) == {WD}


@pytest.mark.parametrize(
    "cfg",
    [
        OptimConfig(weight_decay=WD),
        OptimConfig(weight_decay=WD, compiled=False),
        OptimConfig(weight_decay=WD, stochastic_rounding=True),
    ],
    ids=["compiled", "torch_fused", "stochastic_rounding"],
)
def test_one_step_decays_exactly_the_decayed_parameters(tmp_path, cfg):
    """A step with zero gradients moves nothing but the decay: decayed parameters become 0.95 x themselves, the
    others stay bit for bit (GPT-OSS: every kind of parameter the rule sorts)."""
    model = _model(tmp_path, "gpt_oss")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = build_optimizer(model.named_parameters(), cfg, LR)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    for name, p in model.named_parameters():
        if _expected_decayed(name, p):
            torch.testing.assert_close(p.detach(), before[name] * (1 - LR * WD), rtol=1e-6, atol=0, msg=name)
        else:
            assert torch.equal(p.detach(), before[name]), name

"""GroupedExperts with a quantized frozen base (``peft.quantize_base=fp8``) against the same experts in fp32, for both
in-memory layouts ("out_in", Qwen and most families; "in_out", GPT-OSS with interleaved gate/up, biases and its
clamped activation): ``fill_base_`` takes the weights as the family holds them, the outputs and the adapters'
gradients follow the fp32 experts within FP8's error (E4M3 on the weights and on each GEMM's activations: about
3e-2 of a random product), and the per-expert reference loop computes what the grouped GEMMs do."""

from __future__ import annotations

import pytest
import torch

from moe_tune.lora import LoRASpec
from moe_tune.lora.experts import PROJECTIONS
from moe_tune.moe.experts import ExpertsOptions, ExpertsSpec, GroupedExperts
from tests.tiny import rel_err

FP8_TOL = 6e-2
E, D, HIDDEN = 4, 32, 48
COUNTS = [7, 0, 21, 12]
SPECS = {
    "out_in": ExpertsSpec(num_experts=E, dim=D, hidden=HIDDEN),
    "in_out": ExpertsSpec(num_experts=E, dim=D, hidden=HIDDEN, layout="in_out", bias=True, activation="clamped_swiglu"),
}


def _pair(layout: str) -> tuple[GroupedExperts, GroupedExperts]:
    """(fp32 experts, the same quantized), with the same nonzero adapters."""
    spec, lora = SPECS[layout], LoRASpec(rank=8, alpha=16.0)
    ref = GroupedExperts(spec, lora=lora)
    quantized = GroupedExperts(spec, ExpertsOptions(quantized_base="fp8"), lora=lora)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        for name, p in quantized.named_parameters():  # biases and adapters
            p.copy_(ref.get_parameter(name))
        for proj in PROJECTIONS:
            quantized.fill_base_(proj, 0, getattr(ref, f"{proj}_proj"))
    return ref, quantized


@pytest.mark.parametrize("layout", list(SPECS))
def test_quantized_experts_follow_the_fp32_experts(layout):
    ref, quantized = _pair(layout)
    x = torch.randn(sum(COUNTS), D, generator=torch.Generator().manual_seed(1))
    counts = torch.tensor(COUNTS)
    outs, grads = [], []
    for experts in (ref, quantized):
        y = experts(x, counts)
        y.square().sum().backward()
        outs.append(y.detach())
        grads.append({n: p.grad for n, p in experts.named_parameters() if "lora" in n})
    assert rel_err(outs[1], outs[0]) < FP8_TOL
    for name, g in grads[0].items():
        assert rel_err(grads[1][name], g) < FP8_TOL, name
    # The reference loop on the dequantized weights: the grouped GEMMs' maths, without the activations' FP8.
    with torch.no_grad():
        assert rel_err(quantized.forward_loop(x, counts), outs[1]) < FP8_TOL


@pytest.mark.parametrize("layout", list(SPECS))
def test_fill_takes_the_family_layout(layout):
    ref, quantized = _pair(layout)
    for proj in PROJECTIONS:
        w = getattr(ref, f"{proj}_proj").detach()
        out_in = w if layout == "out_in" else w.transpose(-2, -1)
        assert quantized.base_shape(proj) == tuple(w.shape)
        assert rel_err(getattr(quantized, f"{proj}_quantized").dequantized(), out_in) < 4e-2


def test_a_built_in_model_draws_the_quantized_experts_as_the_bf16_ones():
    """A preset without a checkpoint (the benchmarks' random initialisation): the quantized experts hold the values
    the bf16 base draws by name, quantized."""
    import dataclasses

    from moe_tune.build import assemble, source_loader
    from moe_tune.models.model import ModelOptions
    from moe_tune.models.presets import preset_config

    lora = LoRASpec(rank=8, alpha=16.0, base_dtype=torch.bfloat16)
    options = ModelOptions(dtype=torch.bfloat16, lora=lora)
    fp8 = dataclasses.replace(options, experts=ExpertsOptions(quantized_base="fp8"))
    config = preset_config("tiny_qwen3_moe", {})
    models = [assemble(config, o, source_loader(None, seed=3)) for o in (options, fp8)]
    quantized_modules = dict(models[1].named_modules())
    pairs = [(m, quantized_modules[n]) for n, m in models[0].named_modules() if isinstance(m, GroupedExperts)]
    assert pairs
    for bf16, quantized in pairs:
        for proj in PROJECTIONS:
            w = getattr(bf16, f"{proj}_proj").float()
            assert rel_err(getattr(quantized, f"{proj}_quantized").dequantized(), w) < 4e-2

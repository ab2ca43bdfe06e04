"""GroupedExperts with a quantized frozen base (``peft.quantize_base=fp8`` and ``nf4``) against the same experts in
fp32, for both in-memory layouts ("out_in", Qwen and most families; "in_out", GPT-OSS with interleaved gate/up,
biases and its clamped activation): ``fill_base_`` takes the weights as the family holds them, the outputs and the
adapters' gradients follow the fp32 experts within the format's error (FP8: E4M3 on the weights and on each GEMM's
activations, about 3e-2 of a random product; NF4: about 1e-1 on the weights), and the per-expert reference loop on the
dequantized weights computes what the grouped GEMMs do."""

from __future__ import annotations

import pytest
import torch

from moe_tune.lora import LoRASpec
from moe_tune.lora.experts import PROJECTIONS
from moe_tune.moe.experts import ExpertsOptions, ExpertsSpec, GroupedExperts
from tests.tiny import rel_err

# Relative error of a random product against fp32, and of the dequantized weights.
TOL = {"fp8": (6e-2, 4e-2), "nf4": (1.5e-1, 1.2e-1)}
E, D, HIDDEN = 4, 32, 96
COUNTS = [7, 0, 21, 12]
SPECS = {
    "out_in": ExpertsSpec(num_experts=E, dim=D, hidden=HIDDEN),
    "in_out": ExpertsSpec(num_experts=E, dim=D, hidden=HIDDEN, layout="in_out", bias=True, activation="clamped_swiglu"),
}


def _pair(layout: str, mode: str, gemm: str = "torch") -> tuple[GroupedExperts, GroupedExperts]:
    """(fp32 experts, the same quantized, their GEMMs ``gemm``: kernels.quantized_base), the same nonzero adapters."""
    spec, lora = SPECS[layout], LoRASpec(rank=8, alpha=16.0)
    ref = GroupedExperts(spec, lora=lora)
    quantized = GroupedExperts(spec, ExpertsOptions(quantized_base=mode, quantized_gemm=gemm), lora=lora)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        for name, p in quantized.named_parameters():  # biases and adapters
            p.copy_(ref.get_parameter(name))
        for proj in PROJECTIONS:
            quantized.fill_base_(proj, 0, getattr(ref, f"{proj}_proj"))
    return ref, quantized


@pytest.mark.parametrize("gemm", ["torch", "triton"])
@pytest.mark.parametrize("mode", list(TOL))
@pytest.mark.parametrize("layout", list(SPECS))
def test_quantized_experts_follow_the_fp32_experts(layout, mode, gemm):
    ref, quantized = _pair(layout, mode, gemm)
    tol = TOL[mode][0]
    x = torch.randn(sum(COUNTS), D, generator=torch.Generator().manual_seed(1))
    counts = torch.tensor(COUNTS)
    outs, grads = [], []
    for experts in (ref, quantized):
        y = experts(x, counts)
        y.square().sum().backward()
        outs.append(y.detach())
        grads.append({n: p.grad for n, p in experts.named_parameters() if "lora" in n})
    assert rel_err(outs[1], outs[0]) < tol
    for name, g in grads[0].items():
        assert rel_err(grads[1][name], g) < tol, name
    # The reference loop on the dequantized weights: the grouped GEMMs' maths (FP8's also quantizes activations).
    with torch.no_grad():
        assert rel_err(quantized.forward_loop(x, counts), outs[1]) < (6e-2 if mode == "fp8" else 1e-5)


@pytest.mark.parametrize("mode", list(TOL))
def test_triton_gemms_off_cuda_compute_what_torch_does(mode):
    """kernels.quantized_base=triton is a CUDA kernel: on the CPU the run computes what torch's path does (the note in
    its log says the setting changes nothing there), the input gradients and adapter gradients bit for bit."""
    results = []
    for gemm in ("torch", "triton"):
        _, quantized = _pair("out_in", mode, gemm)
        x = torch.randn(sum(COUNTS), D, generator=torch.Generator().manual_seed(1)).requires_grad_()
        y = quantized(x, torch.tensor(COUNTS))
        y.square().sum().backward()
        results.append((y.detach(), x.grad, {n: p.grad for n, p in quantized.named_parameters()}))
    (y0, dx0, g0), (y1, dx1, g1) = results
    assert torch.equal(y0, y1) and torch.equal(dx0, dx1)
    assert g0.keys() == g1.keys() and all(torch.equal(g0[n], g1[n]) for n in g0)


@pytest.mark.parametrize("mode", list(TOL))
@pytest.mark.parametrize("layout", list(SPECS))
def test_fill_takes_the_family_layout(layout, mode):
    ref, quantized = _pair(layout, mode)
    for proj in PROJECTIONS:
        w = getattr(ref, f"{proj}_proj").detach()
        out_in = w if layout == "out_in" else w.transpose(-2, -1)
        assert quantized.base_shape(proj) == tuple(w.shape)
        assert rel_err(getattr(quantized, f"{proj}_quantized").dequantized(), out_in) < TOL[mode][1]


@pytest.mark.parametrize("mode", list(TOL))
def test_experts_filled_in_chunks_land_at_their_own_index(mode):
    """The loader quantizes a checkpoint's experts a few at a time (``hf_io.QUANTIZE_BLOCK``): each chunk lands where
    its first expert is, the same bytes as one fill of them all (the tiny models' 8 experts fit one chunk)."""
    ref, whole = _pair("out_in", mode)
    _, chunked = _pair("out_in", mode)
    for proj in PROJECTIONS:
        w = getattr(ref, f"{proj}_proj").detach()
        whole.fill_base_(proj, 0, w)
        for j in range(0, E, 3):  # experts [0, 3), then [3, 4)
            chunked.fill_base_(proj, j, w[j : j + 3])
    held = dict(chunked.named_buffers())
    for name, buf in whole.named_buffers():
        assert torch.equal(buf, held[name]), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16_model", "fp32_model"])
@pytest.mark.parametrize("mode", list(TOL))
def test_a_built_in_model_draws_the_quantized_experts_as_the_bf16_ones(mode, dtype):
    """A preset without a checkpoint (the benchmarks' random initialisation), in a bf16 or an fp32 model whose
    frozen base is bf16: the quantized experts hold the values the bf16 base draws by name, quantized, bit for bit
    what quantizing that base's experts gives."""
    import dataclasses

    from moe_tune.build import assemble, source_loader
    from moe_tune.models.model import ModelOptions
    from moe_tune.models.presets import preset_config

    lora = LoRASpec(rank=8, alpha=16.0, base_dtype=torch.bfloat16)
    options = ModelOptions(dtype=dtype, lora=lora)
    quantized = dataclasses.replace(options, experts=ExpertsOptions(quantized_base=mode))
    config = preset_config("tiny_qwen3_moe", {})
    models = [assemble(config, o, source_loader(None, seed=3)) for o in (options, quantized)]
    quantized_modules = dict(models[1].named_modules())
    pairs = [(m, quantized_modules[n]) for n, m in models[0].named_modules() if isinstance(m, GroupedExperts)]
    assert pairs
    for bf16, quantized in pairs:
        for proj in PROJECTIONS:
            w = getattr(bf16, f"{proj}_proj").detach()
            assert w.dtype == torch.bfloat16
            held = getattr(quantized, f"{proj}_quantized")
            assert rel_err(held.dequantized(), w.float()) < TOL[mode][1]
            want = type(held)(*w.shape)
            want.fill_(0, w)
            assert torch.equal(held.dequantized(), want.dequantized()), proj


@pytest.mark.parametrize(
    "mode, dims, message",
    [
        (
            "fp8",
            (2048, 780),
            # 780 is no multiple of 8 either: bf16 grouped_mm (the default kernels.experts) would refuse it in turn
            "peft.quantize_base=fp8 needs the model dim (2048) and the expert hidden dim (780) to be "
            "multiples of 16 (the FP8 grouped GEMM's alignment); use peft.quantize_base=none kernels.experts=loop "
            "for this model",
        ),
        (
            "nf4",
            (2048, 784),
            "peft.quantize_base=nf4 needs the model dim (2048) and the expert hidden dim (784) to be "
            "multiples of 32 (NF4's blocks of inputs); use peft.quantize_base=fp8 or none for this model",
        ),
        (  # 40 is no multiple of 16 either: fp8 would be refused in turn
            "nf4",
            (64, 40),
            "peft.quantize_base=nf4 needs the model dim (64) and the expert hidden dim (40) to be "
            "multiples of 32 (NF4's blocks of inputs); use peft.quantize_base=none for this model",
        ),
    ],
)
def test_config_refuses_expert_dims_the_format_cannot_hold(mode, dims, message):
    from moe_tune.cli.train import compose, to_config
    from moe_tune.config import ConfigError, validate

    cfg = to_config(compose(["peft=lora", f"peft.quantize_base={mode}"]))
    validate(cfg, world_size=1, expert_dims=(2048, 768))
    with pytest.raises(ConfigError) as e:
        validate(cfg, world_size=1, expert_dims=dims)
    assert str(e.value) == message
    for fix in message.split("; use ")[1].removesuffix(" for this model").split(" or "):  # each passes
        fix = fix if fix.startswith("peft.") else f"peft.quantize_base={fix}"
        validate(to_config(compose(["peft=lora", *fix.split()])), world_size=1, expert_dims=dims)


def test_fp8_base_needs_sm90_on_a_gpu_and_runs_emulated_without_one(monkeypatch):
    from moe_tune.cli.train import compose, to_config
    from moe_tune.config import ConfigError
    from moe_tune.env import backends, require_backends

    cfg = to_config(compose(["peft=lora", "peft.quantize_base=fp8"]))
    assert "frozen_fp8" in backends.backends_needed(cfg)
    monkeypatch.setattr(backends, "_cuda", lambda: None)
    require_backends(cfg)  # the CPU's emulation
    monkeypatch.setattr(backends, "_cuda", lambda: ("NVIDIA A100", (8, 0)))
    with pytest.raises(ConfigError) as e:
        require_backends(cfg)
    assert "peft.quantize_base=fp8 needs compute capability >= 9.0" in str(e.value)
    assert str(e.value).endswith("use peft.quantize_base=none")
    nf4 = to_config(compose(["peft=lora", "peft.quantize_base=nf4"]))
    assert "frozen_fp8" not in backends.backends_needed(nf4)


@pytest.mark.parametrize("gemm", ["torch", "triton"])
@pytest.mark.parametrize("mode", list(TOL))
def test_compiled_experts_give_the_eager_outputs_and_adapter_gradients(mode, gemm):
    """torch.compile calls the quantized GEMMs as opaque custom ops, their autograd registered: compiled and eager
    give the same outputs and adapter gradients in bf16, within its rounding of fused elementwise steps (compiled
    through dynamo's tracing, kernels.experts=grouped_mm_fp8's former autograd Function gave wrong gradients on an
    H200: it is made of custom ops now too)."""
    _, quantized = _pair("out_in", mode, gemm)
    x = torch.randn(sum(COUNTS), D, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    counts = torch.tensor(COUNTS)
    results = []
    for run in (quantized, torch.compile(quantized, backend="inductor", fullgraph=True)):
        quantized.zero_grad()
        y = run(x, counts)
        y.square().sum().backward()
        results.append((y.detach(), {n: p.grad.clone() for n, p in quantized.named_parameters()}))
    (y_eager, g_eager), (y_compiled, g_compiled) = results
    assert rel_err(y_compiled, y_eager) < 1e-2
    assert g_eager.keys() == g_compiled.keys() and all(rel_err(g_compiled[n], g) < 1e-2 for n, g in g_eager.items())


@pytest.mark.parametrize(
    "overrides, options, message",
    [
        (
            {},  # the tiny model: hidden 48, experts of 40
            {"quantized_base": "nf4"},
            "quantized_base='nf4' needs the model dim (48) and the expert hidden dim (40) to be multiples of 32 (NF4's "
            "blocks of inputs); use quantized_base=None for this model",
        ),
        (
            {"hidden_size": 80, "moe_intermediate_size": 80},
            {"quantized_base": "nf4"},
            "quantized_base='nf4' needs the model dim (80) and the expert hidden dim (80) to be multiples of 32 (NF4's "
            "blocks of inputs); use quantized_base='fp8' or None for this model",
        ),
        (
            {"hidden_size": 64, "moe_intermediate_size": 200},
            {"quantized_base": "fp8"},
            "quantized_base='fp8' needs the model dim (64) and the expert hidden dim (200) to be multiples of 16 (the "
            "FP8 grouped GEMM's alignment); use quantized_base=None for this model",
        ),
        (  # 780 is no multiple of 8 either: bf16 grouped GEMMs would refuse quantized_base=None in turn
            {"hidden_size": 64, "moe_intermediate_size": 780},
            {"quantized_base": "fp8", "compute_dtype": torch.bfloat16},
            "quantized_base='fp8' needs the model dim (64) and the expert hidden dim (780) to be multiples of 16 (the "
            "FP8 grouped GEMM's alignment); use quantized_base=None with impl='loop' for this model",
        ),
        (
            {"hidden_size": 64, "moe_intermediate_size": 96},
            {"quantized_base": "int4"},
            "quantized_base='int4' is not one of 'fp8', 'nf4'; pick one of those, or None for experts that are "
            "parameters",
        ),
        # the choice in other letter case, one letter off, or the GEMMs' argument's: named as the CLI names it
        (
            {"hidden_size": 64, "moe_intermediate_size": 96},
            {"quantized_base": "NF4"},
            "quantized_base='NF4' is not one of 'fp8', 'nf4'; did you mean quantized_base='nf4'?",
        ),
        (
            {"hidden_size": 64, "moe_intermediate_size": 96},
            {"quantized_base": "fp9"},
            "quantized_base='fp9' is not one of 'fp8', 'nf4'; did you mean quantized_base='fp8'?",
        ),
        (
            {"hidden_size": 64, "moe_intermediate_size": 96},
            {"quantized_base": "triton"},
            "quantized_base='triton' is not one of 'fp8', 'nf4'; did you mean quantized_gemm='triton'?",
        ),
        # the GEMMs' own choices, and the experts' kernels (a silent torch path, or a bf16 one, otherwise)
        (
            {"hidden_size": 64, "moe_intermediate_size": 96},
            {"quantized_base": "nf4", "quantized_gemm": "Triton"},
            "quantized_gemm='Triton' is not one of 'torch', 'triton'; did you mean quantized_gemm='triton'?",
        ),
        (
            {"hidden_size": 64, "moe_intermediate_size": 96},
            {"quantized_gemm": "nf4"},
            "quantized_gemm='nf4' is not one of 'torch', 'triton'; did you mean quantized_base='nf4'?",
        ),
        (
            {"hidden_size": 64, "moe_intermediate_size": 96},
            {"impl": "grouped_mm_fp9"},
            "impl='grouped_mm_fp9' is not one of 'grouped_mm', 'grouped_mm_fp8', 'loop'; did you mean "
            "impl='grouped_mm_fp8'?",
        ),
        (
            {"hidden_size": 64, "moe_intermediate_size": 96},
            {"quantized_base": "nf4", "lora": None},
            "quantized_base='nf4' holds the routed experts frozen, for LoRA, and lora is None (every weight trains): "
            "add lora=LoRASpec(...), or drop quantized_base",
        ),
        # refused by the CLI (kernels.experts=grouped_mm_fp8 with peft.quantize_base): built, it ignored impl
        (
            {"hidden_size": 64, "moe_intermediate_size": 96},
            {"quantized_base": "nf4", "impl": "grouped_mm_fp8"},
            "impl='grouped_mm_fp8' quantizes trained expert weights at every step; with quantized_base='nf4' the "
            "frozen experts are quantized once, at load, and their GEMMs read them as stored: drop impl (or give "
            "impl='grouped_mm')",
        ),
    ],
)
def test_the_python_api_refuses_a_quantized_base_it_cannot_build(tiny_checkpoint, overrides, options, message):
    """``from_pretrained``'s ``experts=ExpertsOptions(quantized_base=...)`` is checked as ``peft.quantize_base`` is:
    one line naming the values and the fix, before anything is built (dims NF4 cannot block ended in a TypeError, an
    unknown storage in a KeyError, and a quantized base without LoRA trained with its experts silently frozen)."""
    import moe_tune
    from moe_tune.config import ConfigError

    path = tiny_checkpoint("qwen3_moe", **overrides)
    lora = options.pop("lora", LoRASpec(rank=8))
    with pytest.raises(ConfigError) as e:
        moe_tune.AutoModelForCausalLM.from_pretrained(path, experts=ExpertsOptions(**options), lora=lora)
    assert str(e.value) == message


@pytest.mark.parametrize("triton, budget, kept", [(False, None, True), (True, None, False), (False, 1, False)])
def test_a_recomputed_nf4_projection_keeps_its_dequantized_experts_only_where_it_may(monkeypatch, triton, budget, kept):
    """Marked recomputed (full activation checkpointing), an NF4 projection takes ``grouped_mm_keeping_dequantized``
    only through torch's GEMMs and where its experts fit ``DEQUANT_BUDGET_BYTES`` in one pass: the Triton GEMMs
    dequantize no experts to keep, and experts over the budget would be held whole. Elsewhere the custom op; the
    same output either way."""
    from moe_tune.kernels import nf4_frozen
    from moe_tune.moe.quantized_base import FrozenNF4Projection

    proj = FrozenNF4Projection(E, 16, D, triton=triton)
    codes, scales = nf4_frozen.quantize_weight(torch.randn(E, 16, D, generator=torch.Generator().manual_seed(0)))
    proj.codes.copy_(codes)
    proj.scales.copy_(scales)
    x = torch.randn(sum(COUNTS), D, generator=torch.Generator().manual_seed(1))
    offs = torch.tensor(COUNTS, dtype=torch.int32).cumsum(0).to(torch.int32)
    expected = proj(x, offs)  # not recomputed: the custom op
    if budget is not None:
        monkeypatch.setattr(nf4_frozen, "DEQUANT_BUDGET_BYTES", budget)
    calls, keeping = [], nf4_frozen.grouped_mm_keeping_dequantized
    monkeypatch.setattr(nf4_frozen, "grouped_mm_keeping_dequantized", lambda *a: calls.append(1) or keeping(*a))
    proj.recomputed = True
    assert torch.equal(proj(x, offs), expected)
    assert calls == ([1] if kept else [])

"""GroupedExperts against GPT-OSS's own experts where its activation clamps: inputs scaled so that gate and up
pre-activations go well past swiglu_limit (7.0), which a tiny checkpoint's small weights never reach; and the
expert dims grouped GEMMs cannot take."""

from __future__ import annotations

import pytest
import torch

from moe_tune.moe.experts import ExpertsOptions, ExpertsSpec, GroupedExperts

E, D, HIDDEN, ALPHA, LIMIT = 4, 24, 20, 1.702, 7.0  # gate/up 24 x 40: no square weight


def gpt_oss_activation(h_RI2: torch.Tensor) -> torch.Tensor:
    """transformers' GptOssExperts._apply_gate, written out: interleaved gate/up, gate clamped above, up both
    ways, then (up + 1) * gate * sigmoid(alpha * gate)."""
    gate, up = h_RI2[..., ::2], h_RI2[..., 1::2]
    gate = gate.clamp(max=LIMIT)
    up = up.clamp(min=-LIMIT, max=LIMIT)
    return (up + 1) * (gate * torch.sigmoid(gate * ALPHA))


def _experts(impl: str) -> GroupedExperts:
    spec = ExpertsSpec(
        num_experts=E,
        dim=D,
        hidden=HIDDEN,
        layout="in_out",
        bias=True,
        activation="clamped_swiglu",
        swiglu_alpha=ALPHA,
        swiglu_limit=LIMIT,
    )
    experts = GroupedExperts(spec, ExpertsOptions(impl=impl))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(0.5 * torch.randn(p.shape, generator=g))
    return experts


def _inputs(counts: list[int], scale: float = 20.0) -> tuple[torch.Tensor, torch.Tensor]:
    x_RD = scale * torch.randn(sum(counts), D, generator=torch.Generator().manual_seed(1))
    return x_RD, torch.tensor(counts, dtype=torch.int64)


def _reference(experts: GroupedExperts, x_RD: torch.Tensor, counts_e: torch.Tensor):
    """Expert by expert with the hand-written activation; also returns every pre-activation."""
    outs, pre, start = [], [], 0
    for j, n in enumerate(counts_e.tolist()):
        h = x_RD[start : start + n] @ experts.gate_up_proj[j] + experts.gate_up_proj_bias[j]
        pre.append(h)
        outs.append(gpt_oss_activation(h) @ experts.down_proj[j] + experts.down_proj_bias[j])
        start += n
    return torch.cat(outs), torch.cat(pre)


def _assert_clamp_matters(pre_RI2: torch.Tensor) -> None:
    gate, up = pre_RI2[..., ::2], pre_RI2[..., 1::2]
    # Many values on every side of the limit, so that dropping any one clamp changes the output.
    assert (gate > 2 * LIMIT).sum() >= 20, gate.max()
    assert (up > 2 * LIMIT).sum() >= 20 and (up < -2 * LIMIT).sum() >= 20, (up.min(), up.max())
    assert ((gate.abs() < LIMIT) & (up.abs() < LIMIT)).any()  # and some inside it


@pytest.mark.parametrize("impl", ["grouped_mm", "loop"])
def test_clamped_swiglu_beyond_the_limit_matches_gpt_oss(impl):
    experts = _experts(impl)
    x_RD, counts_e = _inputs([9, 0, 13, 10])  # an empty expert included
    calls = []
    if impl == "loop":  # the per-expert reference path of kernels.experts=loop is the one that runs
        experts.forward_loop = lambda *a, f=experts.forward_loop: calls.append(1) or f(*a)
    with torch.no_grad():
        y_RD = experts(x_RD, counts_e)
        ref_RD, pre_RI2 = _reference(experts, x_RD, counts_e)
    assert calls == ([1] if impl == "loop" else [])
    _assert_clamp_matters(pre_RI2)
    torch.testing.assert_close(y_RD, ref_RD, rtol=1e-5, atol=1e-4)


def test_clamped_swiglu_matches_transformers_gpt_oss_experts():
    """The same weights in transformers' GptOssExperts (eager), each token routed to one expert with weight 1."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    config = GptOssConfig(
        hidden_size=D, intermediate_size=HIDDEN, num_local_experts=E, swiglu_limit=LIMIT, num_experts_per_tok=1
    )
    config._experts_implementation = "eager"
    hf = GptOssExperts(config)
    assert hf.limit == LIMIT and hf.alpha == ALPHA
    ours = _experts("grouped_mm")
    hf.load_state_dict(ours.state_dict())
    x_RD, counts_e = _inputs([7, 12, 0, 13])
    expert_R = torch.repeat_interleave(torch.arange(E), counts_e)
    with torch.no_grad():
        ref_RD = hf(x_RD, expert_R[:, None], torch.ones(x_RD.shape[0], 1))
        y_RD = ours(x_RD, counts_e)
        _, pre_RI2 = _reference(ours, x_RD, counts_e)
    _assert_clamp_matters(pre_RI2)
    torch.testing.assert_close(y_RD, ref_RD, rtol=1e-5, atol=1e-4)


def test_clamped_swiglu_gradient_beyond_the_limit():
    """Backward too: clamped values pass no gradient (GPT-OSS trains with the clamp in place)."""
    ours, ref = _experts("grouped_mm"), _experts("grouped_mm")
    x_RD, counts_e = _inputs([8, 8, 8, 8])
    g_RD = torch.randn(x_RD.shape, generator=torch.Generator().manual_seed(2))
    (ours(x_RD, counts_e) * g_RD).sum().backward()
    (_reference(ref, x_RD, counts_e)[0] * g_RD).sum().backward()
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-3, msg=name)


def test_under_autocast_the_experts_compute_in_its_dtype():
    """train.precision=amp_bf16: fp32 weights and tokens under bf16 autocast give the bf16 experts' output (a
    grouped GEMM is no op autocast casts itself), and the gradients reach the fp32 weights."""
    spec = ExpertsSpec(num_experts=4, dim=32, hidden=48, layout="in_out", bias=True, activation="swiglu")
    ours = GroupedExperts(spec, ExpertsOptions())
    with torch.no_grad():  # bf16 grouped GEMMs want 16-byte rows: dims that are multiples of 8
        for p in ours.parameters():
            p.copy_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(0)))
    ref = GroupedExperts(spec, ExpertsOptions()).to(torch.bfloat16)
    ref.load_state_dict(ours.state_dict())
    x_RD = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
    counts_e = torch.tensor([5, 0, 7, 4])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_RD = ours(x_RD, counts_e)
    assert y_RD.dtype == torch.bfloat16
    torch.testing.assert_close(y_RD, ref(x_RD.bfloat16(), counts_e), rtol=0, atol=0)
    y_RD.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in ours.parameters())


@pytest.mark.parametrize(
    "overrides, dims, message",
    [
        (  # hf-internal-testing's tiny Mixtral: experts of 37
            [],
            (32, 37),
            "kernels.experts=grouped_mm needs the model dim (32) and the expert hidden dim (37) to be multiples of 8 "
            "(the grouped GEMM's 16-byte rows in bf16, train.precision=bf16_fp32_master); use kernels.experts=loop "
            "for this model",
        ),
        (
            ["train.precision=fp32"],
            (36, 22),
            "kernels.experts=grouped_mm needs the model dim (36) and the expert hidden dim (22) to be multiples of 4 "
            "(the grouped GEMM's 16-byte rows in fp32, train.precision=fp32); use kernels.experts=loop for this model",
        ),
    ],
)
def test_config_refuses_expert_dims_without_16_byte_rows(overrides, dims, message):
    """torch's grouped GEMM raises mid-run ('strides should be multiple of 16 bytes') on rows of other lengths: the
    run is refused before anything is written; fp32 rows of 4k values pass, and kernels.experts=loop takes any."""
    from moe_tune.cli.train import compose, to_config
    from moe_tune.config import ConfigError, validate

    cfg = to_config(compose(overrides))
    with pytest.raises(ConfigError) as e:
        validate(cfg, world_size=1, expert_dims=dims)
    assert str(e.value) == message
    validate(to_config(compose(["train.precision=fp32"])), world_size=1, expert_dims=(36, 20))
    validate(to_config(compose([*overrides, "kernels.experts=loop"])), world_size=1, expert_dims=dims)


def test_the_python_api_refuses_expert_dims_without_16_byte_rows_and_loops_over_them(tiny_checkpoint):
    """``from_pretrained`` of a checkpoint whose experts' rows are no multiple of 16 bytes is one line naming the
    dims and ``impl='loop'``, which then gives transformers' logits (fp32, 1e-5 relative)."""
    import moe_tune
    from moe_tune.config import ConfigError
    from tests.tiny import load_hf, rel_err

    path = tiny_checkpoint("mixtral", hidden_size=32, intermediate_size=37, head_dim=8)
    with pytest.raises(ConfigError) as e:
        moe_tune.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    assert str(e.value) == (
        "impl='grouped_mm' needs the model dim (32) and the expert hidden dim (37) to be multiples of 8 (the grouped "
        "GEMM's 16-byte rows in bfloat16); use experts=moe_tune.moe.experts.ExpertsOptions(impl='loop') for this "
        "model"
    )
    ours = moe_tune.AutoModelForCausalLM.from_pretrained(path, experts=ExpertsOptions(impl="loop"))
    ids = torch.randint(0, ours.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert rel_err(ours(input_ids=ids).logits, load_hf(path)(ids).logits) < 1e-5

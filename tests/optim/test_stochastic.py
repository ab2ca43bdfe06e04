"""optim.stochastic_rounding: AdamW over bf16 parameters whose fp32 update is rounded stochastically."""

from __future__ import annotations

import pytest
import torch

from moe_tune.config import OptimConfig
from moe_tune.optim import build_optimizer
from moe_tune.optim.stochastic import StochasticRoundingAdamW, round_stochastic_


def test_rounding_is_unbiased_and_lands_on_a_neighbour():
    x = torch.full((100_000,), 1.0 + 2**-10)  # a quarter of the way from 1.0 to the next bf16 value, 1 + 2^-7
    for sign in (1.0, -1.0):
        out = torch.empty(x.shape, dtype=torch.bfloat16)
        noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, generator=torch.Generator().manual_seed(0))
        round_stochastic_(out, sign * x, noise)
        assert set(out.float().abs().unique().tolist()) == {1.0, 1.0 + 2**-7}
        assert float(out.float().mean()) == pytest.approx(sign * (1.0 + 2**-10), abs=2e-5)  # nearest: 1.0


def test_nan_and_inf_survive_rounding():
    """CUDA writes NaN as 0x7FFFFFFF; adding noise to it must not wrap into -0.0 (a diverged weight would
    silently become zero)."""
    x = torch.tensor([0x7FFFFFFF, 0x7FC00000, 0x7F800000, -8388608], dtype=torch.int32).view(torch.float32)
    out = torch.empty(4, dtype=torch.bfloat16)
    round_stochastic_(out, x, torch.full((4,), 0xFFFF, dtype=torch.int32))
    assert out[:2].isnan().all() and out[2] == float("inf") and out[3] == float("-inf")


def test_each_parameter_and_step_gets_its_own_seed(monkeypatch):
    """Seeds come from each parameter's own step and index: a parameter without a gradient in one step does not
    make another reuse an earlier step's bits."""
    a = torch.nn.Parameter(torch.zeros(8, dtype=torch.bfloat16))
    b = torch.nn.Parameter(torch.zeros(8, dtype=torch.bfloat16))
    opt = StochasticRoundingAdamW([a, b], lr=1e-3, seed=5, shard_index=2)
    seeds = []
    generator = opt._generator
    monkeypatch.setattr(opt, "_generator", lambda d, step, i: seeds.append((step, i)) or generator(d, step, i))
    for a_has_grad in (True, False, True, True):
        a.grad = torch.ones(8, dtype=torch.bfloat16) if a_has_grad else None
        b.grad = torch.ones(8, dtype=torch.bfloat16)
        opt.step()
    assert [s for s in seeds if s[1] == 1] == [(1, 1), (2, 1), (3, 1), (4, 1)]
    assert [s for s in seeds if s[1] == 0] == [(1, 0), (2, 0), (3, 0)]


def _params(n=4096, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g), [torch.randn(n, generator=g) for _ in range(5)]


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_each_step_lands_next_to_fp32_adamw_from_the_same_state(weight_decay):
    """Per step, torch's fp32 AdamW from our parameters and moments (as fp32): every new bf16 value is one of
    the two bf16 neighbours of its result (closer than one bf16 spacing), and the moments stay bf16."""
    init, grads = _params()
    ours = torch.nn.Parameter(init.bfloat16())
    opt = StochasticRoundingAdamW([ours], lr=1e-2, betas=(0.9, 0.95), weight_decay=weight_decay)
    for i, g in enumerate(grads[:3]):
        ref = torch.nn.Parameter(ours.detach().float())
        ref_opt = torch.optim.AdamW([ref], lr=1e-2, betas=(0.9, 0.95), weight_decay=weight_decay)
        if i:
            st = opt.state[ours]
            ref_opt.state[ref] = {
                "step": st["step"].clone(),
                "exp_avg": st["exp_avg"].float(),
                "exp_avg_sq": st["exp_avg_sq"].float(),
            }
        ours.grad, ref.grad = g.bfloat16(), g.bfloat16().float()
        opt.step()
        ref_opt.step()
        exact = ref.detach()
        spacing = torch.exp2(torch.floor(torch.log2(exact.abs())) - 7)
        assert ((ours.detach().float() - exact).abs() < spacing * 1.001).all()
        assert opt.state[ours]["exp_avg"].dtype == torch.bfloat16 and int(opt.state[ours]["step"]) == i + 1


def test_small_updates_accumulate_where_round_to_nearest_loses_them():
    """lr 1e-4 on weights of 1.0 (bf16 spacing below 1.0: 2^-8 = 0.0039): torch's AdamW on bf16 parameters does
    not move them in 40 steps; stochastic rounding ends, on average, where fp32 AdamW does (1 - 40 x 1e-4)."""
    n, steps = 50_000, 40
    nearest = torch.nn.Parameter(torch.ones(n, dtype=torch.bfloat16))
    ours = torch.nn.Parameter(torch.ones(n, dtype=torch.bfloat16))
    fp32 = torch.nn.Parameter(torch.ones(n))
    opts = [
        torch.optim.AdamW([nearest], lr=1e-4, weight_decay=0.0),
        StochasticRoundingAdamW([ours], lr=1e-4),
        torch.optim.AdamW([fp32], lr=1e-4, weight_decay=0.0),
    ]
    for _ in range(steps):
        for p, opt in zip((nearest, ours, fp32), opts):
            p.grad = torch.ones_like(p)
            opt.step()
    assert torch.equal(nearest.detach(), torch.ones_like(nearest))
    target = float(fp32.detach().mean())
    assert target == pytest.approx(1 - steps * 1e-4, abs=1e-6)
    assert float(ours.detach().float().mean()) == pytest.approx(target, abs=5e-5)


def test_same_seed_same_bits_and_a_resumed_optimizer_continues_identically():
    init, grads = _params(seed=1)

    def run(steps, opt_state=None, p_init=None):
        p = torch.nn.Parameter((init if p_init is None else p_init).bfloat16().clone())
        opt = StochasticRoundingAdamW([p], lr=1e-3, seed=7, chunk=1000)  # several chunks per tensor
        if opt_state is not None:
            opt.load_state_dict(opt_state)
        for g in steps:
            p.grad = g.bfloat16()
            opt.step()
        return p.detach().clone(), opt.state_dict()

    straight, _ = run(grads)
    again, _ = run(grads)
    assert torch.equal(straight, again)
    half, state = run(grads[:2])
    resumed, _ = run(grads[2:], opt_state=state, p_init=half.float())
    assert torch.equal(resumed, straight)
    other_seed = torch.nn.Parameter(init.bfloat16())
    opt = StochasticRoundingAdamW([other_seed], lr=1e-3, seed=8, chunk=1000)
    for g in grads:
        other_seed.grad = g.bfloat16()
        opt.step()
    assert not torch.equal(other_seed.detach(), straight)


def test_build_optimizer_picks_it_and_it_refuses_fp32_parameters():
    p = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    opt = build_optimizer([p], OptimConfig(stochastic_rounding=True), 1e-4, seed=3, shard_index=1)
    assert isinstance(opt, StochasticRoundingAdamW) and (opt.seed, opt.shard_index) == (3, 1)
    assert isinstance(build_optimizer([p], OptimConfig(), 1e-4), torch.optim.AdamW)
    with pytest.raises(ValueError, match="needs bf16 parameters, got torch.float32"):
        StochasticRoundingAdamW([torch.nn.Parameter(torch.zeros(4))], lr=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the update is compiled there)")
def test_compiled_cuda_update_matches_eager_cpu_with_the_same_bits():
    """The compiled kernel used on CUDA against the eager function on CPU, same inputs and random bits: equal
    except where fp32 arithmetic differs (the GPU fuses multiply-adds): at most 0.1% of elements, each by one bf16
    step of the value, or by fp32's absolute error (1e-6) where a moment cancels to ~1e-8 (the parameters alone
    would pass without the absolute term; the first moment needs it, as an fp32 emulation of fused multiply-adds
    shows on elements cancelled to ~1e-8). Compiled on CPU, the two are bitwise equal."""
    from moe_tune.optim.stochastic import adamw_chunk_

    g = torch.Generator().manual_seed(0)
    n = 1 << 20
    p, grad, m = (torch.randn(n, generator=g).bfloat16() for _ in range(3))
    v = torch.rand(n, generator=g).bfloat16()
    noise = torch.randint(0, 1 << 16, (3, n), dtype=torch.int32, generator=g)
    hyper = torch.tensor([1e-3, 0.9, 0.95, 1e-8, 0.1, 0.19, 0.0975, 0.0, 2.0])  # skip 0, gradients divided by 2
    cpu = [t.clone() for t in (p, grad, m, v)]
    cuda = [t.cuda() for t in (p, grad, m, v)]
    adamw_chunk_(*cpu, noise, hyper)
    torch.compile(adamw_chunk_, dynamic=True)(*cuda, noise.cuda(), hyper.cuda())
    for a, b in zip(cpu, cuda):
        diff = (a.float() - b.float().cpu()).abs()
        assert (diff > 0).float().mean() < 1e-3
        assert (diff <= torch.maximum(a.float().abs(), b.float().cpu().abs()) * 2**-7 + 1e-6).all()


def test_found_inf_skips_the_update_bitwise():
    """found_inf = 1 (set by the trainer when the gradient norm is not finite) leaves parameters and moments
    bit for bit; found_inf = 0 updates as usual."""
    init, grads = _params(seed=2)
    p = torch.nn.Parameter(init.bfloat16())
    opt = StochasticRoundingAdamW([p], lr=1e-2, weight_decay=0.1)
    p.grad = grads[0].bfloat16()
    opt.step()
    before = [t.clone() for t in (p.detach(), opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"])]
    p.grad = torch.full_like(p, float("nan"))
    opt.found_inf = torch.tensor(1.0)
    opt.step()
    after = (p.detach(), opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"])
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    p.grad = grads[1].bfloat16()
    opt.found_inf = torch.tensor(0.0)
    opt.step()
    assert not torch.equal(p.detach(), before[0]) and p.isfinite().all()


def test_grad_scale_divides_the_gradients():
    """grad_scale (the trainer's gradient clipping) acts as gradients divided by it beforehand: the same
    parameters and moments bit for bit, with the same random bits."""
    init, grads = _params(seed=3)
    scaled, divided = (torch.nn.Parameter(init.bfloat16()) for _ in range(2))
    opts = [StochasticRoundingAdamW([p], lr=1e-2, weight_decay=0.1, seed=5) for p in (scaled, divided)]
    scaled.grad = grads[0].bfloat16()
    opts[0].grad_scale = torch.tensor(4.0)
    divided.grad = (grads[0].bfloat16().float() / 4.0).bfloat16()  # exact: a power of two
    for opt in opts:
        opt.step()
    assert torch.equal(scaled.detach(), divided.detach())
    assert torch.equal(opts[0].state[scaled]["exp_avg_sq"], opts[1].state[divided]["exp_avg_sq"])
    assert not torch.equal(scaled.detach(), init.bfloat16())

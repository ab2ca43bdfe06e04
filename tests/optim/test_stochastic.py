"""optim.stochastic_rounding: AdamW over bf16 parameters whose fp32 update is rounded stochastically."""

from __future__ import annotations

import pytest
import torch

from moe_tune.config import OptimConfig
from moe_tune.optim import build_optimizer
from moe_tune.optim.adamw import adamw_values
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
    seed = opt._seed
    monkeypatch.setattr(opt, "_seed", lambda step, i, segment=0: seeds.append((step, i)) or seed(step, i, segment))
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


def test_build_optimizer_picks_it_and_it_refuses_fp16_parameters():
    p = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    opt = build_optimizer([p], OptimConfig(stochastic_rounding=True), 1e-4, seed=3, shard_index=1)
    assert isinstance(opt, StochasticRoundingAdamW) and (opt.seed, opt.shard_index) == (3, 1)
    assert isinstance(build_optimizer([p], OptimConfig(), 1e-4), torch.optim.AdamW)
    with pytest.raises(ValueError, match="takes bf16 \\(and fp32\\) parameters, got torch.float16"):
        StochasticRoundingAdamW([torch.nn.Parameter(torch.zeros(4, dtype=torch.float16))], lr=1e-4)


_NO_CUDA = "the Triton kernel runs on CUDA only (a CPU runs eagerly)"
_DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason=_NO_CUDA)]),
]


@pytest.mark.parametrize("device", _DEVICES)
def test_fp32_parameters_beside_bf16_ones_update_exactly(device):
    """A bf16 model's fp32 islands (DeepSeek-V3's and GLM-4-MoE's routers) train under the same optimizer: their
    update equals torch's fp32 AdamW to fp32 rounding (1e-6 relative), with fp32 moments, while the bf16
    parameter beside them still lands on a bf16 neighbour of its exact value."""
    init, grads = _params()
    router = torch.nn.Parameter(init.to(device))
    weight = torch.nn.Parameter(init.bfloat16().to(device))
    ref = torch.nn.Parameter(init.clone())
    opt = StochasticRoundingAdamW([weight, router], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    ref_opt = torch.optim.AdamW([ref], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    for g in grads[:3]:
        weight.grad, router.grad, ref.grad = g.bfloat16().to(device), g.to(device), g.clone()
        opt.step()
        ref_opt.step()
        assert torch.allclose(router.detach().cpu(), ref.detach(), rtol=1e-6, atol=1e-7)
    assert opt.state[router]["exp_avg_sq"].dtype == torch.float32
    assert opt.state[weight]["exp_avg"].dtype == torch.bfloat16
    assert not torch.equal(weight.detach().float().cpu(), init.bfloat16().float())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason=_NO_CUDA)
def test_cuda_kernel_lands_next_to_fp32_adamw(monkeypatch):
    """The Triton kernel (its random bits drawn inside) against fp32 AdamW from the same state, computed eagerly on
    the CPU: every new bf16 parameter and moment is one of the two bf16 neighbours of the fp32 value (within one
    bf16 step of it, or fp32's absolute error 1e-6 where a moment cancels to ~1e-8), and NaN stays NaN."""
    g = torch.Generator().manual_seed(0)
    n = 1 << 20
    p, grad, m = (torch.randn(n, generator=g).bfloat16() for _ in range(3))
    v = torch.rand(n, generator=g).bfloat16()
    grad[7] = float("nan")
    lr, betas, wd, step = 1e-3, (0.9, 0.95), 0.1, 2
    param = torch.nn.Parameter(p.cuda())
    opt = StochasticRoundingAdamW([param], lr=lr, betas=betas, weight_decay=wd, seed=3)
    opt.state[param] = {"step": torch.tensor(float(step - 1)), "exp_avg": m.cuda(), "exp_avg_sq": v.cuda()}
    param.grad = grad.cuda()
    opt.grad_scale = torch.tensor(2.0, device="cuda")
    import moe_tune.optim.stochastic as module

    launches, launch = [], module.stochastic_update
    monkeypatch.setattr(module, "stochastic_update", lambda *args: launches.append(1) or launch(*args))
    opt.step()
    assert launches == [1]  # the Triton kernel ran, not the eager update
    hyper = [lr, *betas, 1e-8, wd, 1 - betas[0] ** step, 1 - betas[1] ** step, 0.0, 2.0]
    exact = adamw_values(p, grad, m, v, *torch.tensor(hyper).unbind())
    state = opt.state[param]
    for got, want in zip((param.detach(), state["exp_avg"], state["exp_avg_sq"]), exact):
        got = got.float().cpu()
        assert torch.equal(got.isnan(), want.isnan()) and int(got.isnan().sum()) == 1
        got, want = got[~want.isnan()], want[~want.isnan()]
        spacing = torch.exp2(torch.floor(torch.log2(want.abs().clamp_min(2**-126))) - 7)
        assert ((got - want).abs() <= spacing * 1.001 + 1e-6).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason=_NO_CUDA)
def test_cuda_kernel_rounds_up_with_the_probability_of_the_distance():
    """With betas 0 the moments are g / s and (g / s)^2 and the update is lr: gradients of 1.0 divided by
    s = 1 / (1 + 2^-9) put every new m a quarter of the way from 1.0 to the next bf16 value (1 + 2^-7), every v
    about half way, and lr 2^-10 every parameter a quarter of the way down from 1.0 to 1 - 2^-8. Rounded by the
    kernel, each lands on one of its two neighbours with a mean equal to the exact value within 2e-5 (the
    standard error over 2^20 values is below 4e-6; round-to-nearest is 1e-3 to 2e-3 off)."""
    n = 1 << 20
    param = torch.nn.Parameter(torch.ones(n, dtype=torch.bfloat16, device="cuda"))
    opt = StochasticRoundingAdamW([param], lr=2**-10, betas=(0.0, 0.0), eps=0.0)
    param.grad = torch.ones_like(param)
    opt.grad_scale = torch.tensor(1 / (1 + 2**-9), device="cuda")
    opt.step()
    state = opt.state[param]
    m_exact = 1 / float(opt.grad_scale)
    for got, exact, below, above in (
        (param.detach(), 1 - 2**-10, 1 - 2**-8, 1.0),
        (state["exp_avg"], m_exact, 1.0, 1 + 2**-7),
        (state["exp_avg_sq"], m_exact**2, 1.0, 1 + 2**-7),
    ):
        got = got.float()
        assert set(got.unique().tolist()) == {below, above}
        assert float(got.mean()) == pytest.approx(exact, abs=2e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason=_NO_CUDA)
def test_cuda_kernel_small_updates_accumulate_reproducibly_and_a_skip_keeps_every_bit():
    """On the GPU kernel: lr 1e-4 on weights of 1.0 (below half a bf16 step) ends where fp32 AdamW does after 40
    steps, on average (round-to-nearest would not move them); the same seed gives the same bits, another seed
    others; a 40th step with found_inf = 1 leaves parameters and moments as 39 steps left them, bit for bit."""
    n = 50_000

    def run(steps, seed=0, skip_last=False):
        p = torch.nn.Parameter(torch.ones(n, dtype=torch.bfloat16, device="cuda"))
        opt = StochasticRoundingAdamW([p], lr=1e-4, seed=seed)
        for i in range(steps):
            p.grad = torch.ones_like(p)
            opt.found_inf = torch.tensor(float(skip_last and i == steps - 1), device="cuda")
            opt.step()
        return [t.clone() for t in (p.detach(), opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"])]

    p, *_ = run(40)
    assert float(p.float().mean()) == pytest.approx(1 - 40 * 1e-4, abs=5e-5)
    assert torch.equal(run(40)[0], p) and not torch.equal(run(40, seed=1)[0], p)
    assert all(torch.equal(a, b) for a, b in zip(run(40, skip_last=True), run(39)))


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

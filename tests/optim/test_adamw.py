"""optim.compiled (the default): AdamW as one kernel per large parameter (Triton on a GPU), against torch's fused
AdamW (optim.compiled=false)."""

from __future__ import annotations

import pytest
import torch

from moe_tune.config import OptimConfig
from moe_tune.optim import build_optimizer
from moe_tune.optim.adamw import CompiledAdamW

HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _shapes_and_grads(dtype, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(64, 48), (4, 16, 8), (37,), (1 << 12,)]  # the last at _compiled's one_kernel_min: its own kernel
    init = [torch.randn(s, generator=g).to(dtype) for s in shapes]
    grads = [[torch.randn(s, generator=g).to(dtype) for s in shapes] for _ in range(steps)]
    return init, grads


def _run(make, init, grads, device="cpu", skip_step=None, grad_scale=None, opt_state=None):
    params = [torch.nn.Parameter(t.clone().to(device)) for t in init]
    opt = make(params)
    if opt_state is not None:
        opt.load_state_dict(opt_state)
    for i, step_grads in enumerate(grads):
        for p, g in zip(params, step_grads):
            p.grad = g.clone().to(device)
        opt.found_inf = torch.tensor(float(i == skip_step), device=device)
        if grad_scale is not None:
            opt.grad_scale = torch.tensor(grad_scale, device=device)
        opt.step()
    return params, opt


def _close(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    """Equal to ``tol`` of b's largest magnitude (moments near zero differ in their last bits by cancellation)."""
    return float((a.float() - b.float()).abs().max()) <= tol * float(b.float().abs().max())


def _fused(params):
    return torch.optim.AdamW(params, **HYPER, fused=True)


def _compiled(params):
    return CompiledAdamW(params, **HYPER, one_kernel_min=1 << 12)


def _stochastic(params):
    from moe_tune.optim.stochastic import StochasticRoundingAdamW

    return StochasticRoundingAdamW(params, **HYPER)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 2**-7)])
def test_matches_torch_fused_adamw_with_a_skipped_step_and_clipping(dtype, tol):
    """Four steps, the second skipped on the device (found_inf) and every gradient divided by grad_scale:
    parameters, moments and step counts as torch's fused AdamW (fp32 to 1e-6 of each tensor's scale; bf16 to one
    rounding step at that scale: the kernels round fp32 results of differently ordered sums)."""
    init, grads = _shapes_and_grads(dtype, 4)
    ref, ref_opt = _run(_fused, init, grads, skip_step=1, grad_scale=2.0)
    got, got_opt = _run(_compiled, init, grads, skip_step=1, grad_scale=2.0)
    for a, b in zip(got, ref):
        assert a.dtype == dtype
        assert _close(a, b, tol)
        sa, sb = got_opt.state[a], ref_opt.state[b]
        assert float(sa["step"]) == float(sb["step"]) == 3.0  # the skipped step is not counted
        for key in ("exp_avg", "exp_avg_sq"):
            assert sa[key].dtype == sb[key].dtype
            assert _close(sa[key], sb[key], tol), key
    # The skipped step changed nothing: a run without it (three steps) lands on the same values.
    again, _ = _run(_compiled, init, [grads[0], *grads[2:]], grad_scale=2.0)
    assert all(torch.equal(a, b) for a, b in zip(got, again))


@pytest.mark.parametrize("make", [_compiled, _stochastic], ids=["compiled", "stochastic_rounding"])
def test_a_skipped_step_is_not_counted_by_either_optimizer(make):
    """torch's fused AdamW's rule in both of moe_tune's AdamWs: four steps with the second skipped (found_inf) are
    three updates with the bias correction of three. fp32 parameters (which the stochastic-rounding AdamW updates
    exactly) to 1e-6 of torch's; bf16 parameters count their steps the same way."""
    init, grads = _shapes_and_grads(torch.float32, 4)
    ref, ref_opt = _run(_fused, init, grads, skip_step=1, grad_scale=2.0)
    got, got_opt = _run(make, init, grads, skip_step=1, grad_scale=2.0)
    for a, b in zip(got, ref):
        assert float(got_opt.state[a]["step"]) == float(ref_opt.state[b]["step"]) == 3.0
        assert _close(a, b, 1e-6)
    bf16, _ = _shapes_and_grads(torch.bfloat16, 4)
    got, got_opt = _run(make, bf16, [[g.bfloat16() for g in step] for step in grads], skip_step=1)
    assert all(float(got_opt.state[p]["step"]) == 3.0 for p in got)


def test_checkpoints_move_between_it_and_torch_fused_adamw():
    """Two steps with one optimizer, its state dict loaded into the other, two more steps: the same as four
    steps of torch's fused AdamW throughout (the state layout is torch's)."""
    init, grads = _shapes_and_grads(torch.float32, 4)
    ref, _ = _run(_fused, init, grads)
    for first, second in ((_compiled, _fused), (_fused, _compiled)):
        half, opt = _run(first, init, grads[:2])
        state = opt.state_dict()
        assert set(state["state"][0]) == {"step", "exp_avg", "exp_avg_sq"} and state["param_groups"][0]["fused"]
        got, _ = _run(second, [p.detach() for p in half], grads[2:], opt_state=state)
        for a, b in zip(got, ref):
            assert _close(a, b, 1e-6)


def test_optim_compiled_chooses_the_kernels():
    """optim.compiled (default true) builds CompiledAdamW, false torch's fused AdamW; with stochastic rounding
    it decides whether that optimizer's update is torch.compile'd on a GPU (no refusal either way)."""
    from moe_tune.config import Config, validate
    from moe_tune.optim.stochastic import StochasticRoundingAdamW

    params = [torch.nn.Parameter(torch.zeros(3))]
    assert OptimConfig().compiled
    assert isinstance(build_optimizer(params, OptimConfig(), 1e-3), CompiledAdamW)
    fused = build_optimizer(params, OptimConfig(compiled=False), 1e-3)
    assert type(fused) is torch.optim.AdamW and fused.param_groups[0]["fused"]
    bf16 = [torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))]
    for compiled in (True, False):
        cfg = Config()
        cfg.train.precision, cfg.optim.stochastic_rounding, cfg.optim.compiled = "bf16", True, compiled
        validate(cfg)
        opt = build_optimizer(bf16, cfg.optim, 1e-3)
        assert isinstance(opt, StochasticRoundingAdamW) and opt.compiled is compiled


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the Triton kernel runs on CUDA only (a CPU runs adamw_ eagerly)"
)
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 2**-7)])
def test_compiled_kernel_matches_torch_fused_on_cuda(dtype, tol, monkeypatch):
    import moe_tune.optim.adamw as module

    launches, launch = [], module.nearest_update
    monkeypatch.setattr(module, "nearest_update", lambda *args: launches.append(1) or launch(*args))
    init, grads = _shapes_and_grads(dtype, 3)
    ref, _ = _run(_fused, init, grads, device="cuda", skip_step=1, grad_scale=2.0)
    got, opt = _run(_compiled, init, grads, device="cuda", skip_step=1, grad_scale=2.0)
    assert len(launches) == 3  # the Triton kernel ran, for the one large parameter per step (not adamw_ eagerly)
    for a, b in zip(got, ref):
        assert _close(a, b, tol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="host syncs are CUDA's (a CPU has none to find)")
@pytest.mark.parametrize("make", [_compiled, _stochastic], ids=["nearest", "stochastic_rounding"])
def test_a_step_never_waits_for_the_gpu(make):
    """torch's sync debug mode raises on any host sync inside step (a read of the step count or of a
    hyperparameter copy once cost 9% of a micro-batch-1 step), with either Triton kernel."""
    init, grads = _shapes_and_grads(torch.bfloat16, 3)
    params, opt = _run(make, init, grads[:2], device="cuda", grad_scale=2.0)  # compiled and warm
    for p, g in zip(params, grads[2]):
        p.grad = g.to("cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        opt.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _fsdp_steps(rank: int, result_path: str) -> None:
    """Three steps of a 2-layer MLP sharded by FSDP2 over 2 ranks, once with torch's fused AdamW and once with
    CompiledAdamW updating each parameter's local shard on its own (one_kernel_min below every size); rank 0
    saves both models' full parameters."""
    from torch.distributed.fsdp import fully_shard

    out = {}
    for name, make in (("fused", _fused), ("compiled", lambda p: CompiledAdamW(p, **HYPER, one_kernel_min=1))):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
        fully_shard(model)
        opt = make(list(model.parameters()))
        g = torch.Generator().manual_seed(1 + rank)
        for _ in range(3):
            model(torch.randn(4, 16, generator=g)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        out[name] = {k: v.full_tensor() for k, v in model.state_dict().items()}
    if rank == 0:
        torch.save(out, result_path)


def test_fsdp2_sharded_parameters_update_like_torch_fused(tmp_path):
    """FSDP2 DTensor parameters (2 gloo ranks): each rank's shard updated in place by CompiledAdamW's own-kernel
    path gives the same full parameters as torch's fused AdamW, to 1e-6 of each tensor's scale."""
    from tests.harness import run_ranks

    path = tmp_path / "params.pt"
    run_ranks(_fsdp_steps, 2, str(path))
    got = torch.load(path)
    for key, ref in got["fused"].items():
        assert _close(got["compiled"][key], ref, 1e-6), key
        assert not torch.equal(ref, torch.zeros_like(ref))

"""The optimizers' Triton kernels (moe_tune/kernels/triton_adamw.py) on a CPU, through Triton's interpreter
(TRITON_INTERPRET=1): the same kernel code a GPU compiles, run element by element in NumPy. The GPU tests in
test_adamw.py and test_stochastic.py run them compiled, through the optimizers."""

from __future__ import annotations

import importlib

import pytest
import torch

from moe_tune.kernels import adamw as kernels
from moe_tune.optim.adamw import adamw_values

pytest.importorskip("triton", reason="Triton is not installed (pip install -e '.[dev]' brings it)")


@pytest.fixture(autouse=True)
def interpreted(monkeypatch):
    """Kernels decorated under TRITON_INTERPRET=1 (a module reload), and as before afterwards."""
    import moe_tune.kernels.triton_adamw as module

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    importlib.reload(module)
    yield
    monkeypatch.undo()
    importlib.reload(module)


def _state(n, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    p, grad, m = (torch.randn(n, generator=g).to(dtype) for _ in range(3))
    return p, grad, m, torch.rand(n, generator=g).to(dtype)


HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, wd=0.1)
STEP = 3
BC = (1 - 0.9**STEP, 1 - 0.95**STEP)


def _exact(p, g, m, v, skip=0.0, scale=2.0):
    h = HYPER
    values = [h["lr"], h["beta1"], h["beta2"], h["eps"], h["wd"], *BC, skip, scale]
    return adamw_values(p, g, m, v, *torch.tensor(values).unbind())


def _flags(skip=0.0, scale=2.0):
    return torch.tensor(skip), torch.tensor(scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nearest_kernel_is_fp32_adamw_rounded_to_nearest(dtype):
    """Over 3 programs (the last one partial), parameters and moments are the eager fp32 AdamW values rounded to
    their dtype: within one rounding step of the value (fp32 results may differ in their last bits: fused or
    reordered operations), or 1e-6 of the tensor's largest magnitude where a moment cancels towards 0; a skipped
    update leaves every bit."""
    n = 2 * kernels.BLOCK + 100
    p, g, m, v = _state(n, dtype=dtype)
    got = [t.clone() for t in (p, g, m, v)]
    kernels.nearest_update(*got, *_flags(), torch.tensor(BC), *HYPER.values())
    for out, want in zip((got[0], got[2], got[3]), _exact(p, g, m, v)):
        bound = torch.finfo(dtype).eps * want.abs() + 1e-6 * want.abs().max()
        assert ((out.float() - want.to(dtype).float()).abs() <= bound).all()
    same = [t.clone() for t in (p, g, m, v)]
    kernels.nearest_update(*same, *_flags(skip=1.0), torch.tensor(BC), *HYPER.values())
    assert all(torch.equal(a, b) for a, b in zip(same, (p, g, m, v)))


def test_stochastic_kernel_lands_on_a_neighbour_keeps_nan_and_skips_bitwise():
    """Every new bf16 value is one of the two bf16 neighbours of the fp32 AdamW value (within one bf16 step, or
    fp32's absolute error where a moment cancels); a NaN gradient gives NaN; the same seed gives the same bits,
    another seed others; found_inf = 1 leaves every bit. (The interpreter's NaN is 0x7FC00000, which the random
    bits cannot carry into the sign; CUDA's 0x7FFFFFFF can, which the GPU test covers.)"""
    n = 2 * kernels.STOCHASTIC_BLOCK + 100
    p, g, m, v = _state(n, seed=1)
    g[5] = float("nan")
    runs = {}
    for seed in (7, 7, 8):
        out = [t.clone() for t in (p, g, m, v)]
        kernels.stochastic_update(*out, *_flags(), torch.tensor(seed), torch.tensor(BC), *HYPER.values())
        runs.setdefault(seed, []).append(out)
    got = runs[7][0]
    for out, want in zip((got[0], got[2], got[3]), _exact(p, g, m, v)):
        out = out.float()
        assert torch.equal(out.isnan(), want.isnan()) and bool(out[5].isnan())
        out, want = out[~want.isnan()], want[~want.isnan()]
        spacing = torch.exp2(torch.floor(torch.log2(want.abs().clamp_min(2**-126))) - 7)
        assert ((out - want).abs() <= spacing * 1.001 + 1e-6).all()
    assert all(_bits(runs[7][0][i]).equal(_bits(runs[7][1][i])) for i in (0, 2, 3))
    assert not torch.equal(runs[7][0][0], runs[8][0][0])
    same = [t.clone() for t in (p, g, m, v)]
    kernels.stochastic_update(*same, *_flags(skip=1.0), torch.tensor(7), torch.tensor(BC), *HYPER.values())
    assert all(_bits(a).equal(_bits(b)) for a, b in zip(same, (p, g, m, v)))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)  # NaN-aware equality of bf16 tensors


def test_stochastic_kernel_rounds_up_with_the_probability_of_the_distance():
    """Betas 0, eps 0: m = g / s and v = m^2 exactly, and the update is lr. Gradients of 1.0 divided by
    s = 1 / (1 + 2^-9) put every m a quarter of the way from 1.0 to 1 + 2^-7, every v about half way, and lr 2^-10
    every parameter a quarter of the way down from 1.0 to 1 - 2^-8. Each lands on a neighbour, with a mean within
    4e-5 of the exact value (6 standard errors over 2^16 values; round-to-nearest, or a fixed half step in place
    of the random bits, is 1e-3 to 2e-3 off)."""
    n = 1 << 16
    p, g = torch.ones(n, dtype=torch.bfloat16), torch.ones(n, dtype=torch.bfloat16)
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    scale = torch.tensor(1 / (1 + 2**-9))
    key, bc = torch.tensor(123), torch.tensor([1.0, 1.0])
    kernels.stochastic_update(p, g, m, v, torch.tensor(0.0), scale, key, bc, 2**-10, 0.0, 0.0, 0.0, 0.0)
    m_exact = 1 / float(scale)
    for got, exact, below, above in (
        (p, 1 - 2**-10, 1 - 2**-8, 1.0),
        (m, m_exact, 1.0, 1 + 2**-7),
        (v, m_exact**2, 1.0, 1 + 2**-7),
    ):
        got = got.float()
        assert set(got.unique().tolist()) == {below, above}
        assert float(got.mean()) == pytest.approx(exact, abs=4e-5)

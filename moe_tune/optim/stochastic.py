"""AdamW for bf16 parameters with stochastic rounding (``optim.stochastic_rounding=true``, ``train.precision=bf16``).

With bf16 parameters and round-to-nearest, an update smaller than half a bf16 step of the weight is lost: a weight
near 0.5 has a step of 2^-8 ~ 0.004, while AdamW moves it by about the learning rate (3e-5 in fine-tuning). On an
H200 such runs stalled (+159% final loss after 100 steps, ``benchmarks/results/2026-11-30-1xH200/precision.md``).
Here the update is computed in fp32 and rounded to bf16 up or down with probability proportional to the distance,
so the rounding is unbiased (E[round(x)] = x) and small updates accumulate on average. The two moments are kept in
bf16 and rounded the same way. State: 4 bytes per parameter, against 12 for fp32 master weights with fp32 moments.

The random bits come from a generator seeded per parameter by (``seed``, its step, ``shard_index``, its index),
so a run resumed from a checkpoint (which holds the steps) draws the same bits as one that never stopped, and
replicas of one shard (HSDP, ``parallel.dp_replicate > 1``: same shard index) round identically and stay equal.
Work is done per chunk of ``chunk`` elements to bound the fp32 temporaries; on CUDA the per-chunk arithmetic is
one compiled kernel (eager with ``optim.compiled=false``).
"""

from __future__ import annotations

import torch

from moe_tune.optim.adamw import _local, adamw_values, run_closure

_CHUNK = 1 << 25


def round_stochastic_(out: torch.Tensor, x: torch.Tensor, noise: torch.Tensor) -> None:
    """out (bf16) <- x (fp32) rounded to bf16 by adding 16 random low bits, then truncating them. NaN stays NaN
    (CUDA's NaN, 0x7FFFFFFF, would otherwise overflow into -0.0 and silently zero a diverged weight)."""
    bits = x.view(torch.int32) + noise
    rounded = (bits & -65536).view(torch.float32)  # low 16 bits zero: the bf16 cast is exact
    out.copy_(torch.where(x.isnan(), x, rounded))


def adamw_chunk_(p, g, m, v, noise, hyper):
    """One AdamW update of bf16 chunks p, m, v from gradient g, computed in fp32, written back rounded.
    ``hyper``: fp32 tensor [lr, beta1, beta2, eps, weight_decay, bias_correction1, bias_correction2, skip,
    grad_scale] (a tensor, so a changing learning rate does not recompile, and skip and the gradients' divisor can
    come from the device); ``noise``: int32 [3, n] in [0, 2^16). With skip > 0 every value is written back
    unchanged (a bf16 value rounds to itself)."""
    p32, m32, v32 = adamw_values(p, g, m, v, *hyper.unbind())
    round_stochastic_(p, p32, noise[0])
    round_stochastic_(m, m32, noise[1])
    round_stochastic_(v, v32, noise[2])


class StochasticRoundingAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias correction) over bf16 parameters, rounding stochastically.

    Like torch's fused AdamW it honours ``found_inf`` (a 0-dim tensor set on the optimizer before ``step``; 1
    skips the update on the device, no host sync) and ``grad_scale`` (a 0-dim tensor every gradient is divided
    by: gradient clipping). A skipped step still counts in the bias correction.
    """

    def __init__(
        self,
        params,
        lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        weight_decay=0.0,
        seed=0,
        shard_index=0,
        chunk=_CHUNK,
        compiled=True,
    ):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype != torch.bfloat16:
                    raise ValueError(f"stochastic rounding AdamW needs bf16 parameters, got {p.dtype}")
        self.seed, self.shard_index, self.chunk, self.compiled = seed, shard_index, chunk, compiled
        self._generators: dict[torch.device, torch.Generator] = {}  # reseeded per parameter and step
        self._update = None

    def _kernel(self, device: torch.device):
        if self._update is None:
            on_gpu = device.type == "cuda" and self.compiled
            self._update = torch.compile(adamw_chunk_, dynamic=True) if on_gpu else adamw_chunk_
        return self._update

    def _generator(self, device: torch.device, step: int, index: int) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = self._generators[device] = torch.Generator(device)
        gen.manual_seed((((self.seed * 1_000_003 + step) * 65_537 + self.shard_index) * 4_099 + index) % (1 << 63))
        return gen

    @torch.no_grad()
    def step(self, closure=None):
        loss = run_closure(closure)
        found_inf, grad_scale = getattr(self, "found_inf", None), getattr(self, "grad_scale", None)
        index = -1
        for group in self.param_groups:
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            hypers: dict[tuple, torch.Tensor] = {}
            for p in group["params"]:
                index += 1
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                step = int(state["step"])
                views = [_local(t).view(-1) for t in (p, p.grad, state["exp_avg"], state["exp_avg_sq"])]
                device = views[0].device
                gen = self._generator(device, step, index)
                hyper = hypers.get((device, step))
                if hyper is None:
                    values = torch.tensor([lr, beta1, beta2, eps, wd, 1 - beta1**step, 1 - beta2**step, 0.0, 1.0])
                    if device.type == "cuda":  # from pinned memory without blocking: no host sync per step
                        values = values.pin_memory().to(device, non_blocking=True)
                    on_device = [values[:-2]]  # found_inf and grad_scale stay on the device
                    for given, default in ((found_inf, values[-2:-1]), (grad_scale, values[-1:])):
                        on_device.append(default if given is None else given.to(device, torch.float32).reshape(1))
                    values = torch.cat(on_device)
                    hyper = hypers[(device, step)] = values
                update = self._kernel(device)
                for start in range(0, views[0].numel(), self.chunk):
                    chunk = [t[start : start + self.chunk] for t in views]
                    noise = torch.randint(
                        0, 1 << 16, (3, chunk[0].numel()), dtype=torch.int32, device=device, generator=gen
                    )
                    update(*chunk, noise, hyper)
        return loss

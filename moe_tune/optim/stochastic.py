"""AdamW for bf16 parameters with stochastic rounding (``optim.stochastic_rounding``: automatic with
``train.precision=bf16``).

With bf16 parameters and round-to-nearest, an update smaller than half a bf16 step of the weight is lost: a weight
near 0.5 has a step of 2^-8 ~ 0.004, while AdamW moves it by about the learning rate (3e-5 in fine-tuning). On an
H200 such runs stalled (+159% final loss after 100 steps, ``benchmarks/results/2026-11-30-1xH200/precision.md``).
Here the update is computed in fp32 and rounded to bf16 up or down with probability proportional to the distance,
so the rounding is unbiased (E[round(x)] = x) and small updates accumulate on average. The two moments are kept in
bf16 and rounded the same way. State: 4 bytes per parameter, against 12 for fp32 master weights with fp32 moments.
An fp32 parameter (DeepSeek-V3's and GLM-4-MoE's routers stay fp32 in a bf16 model) is updated exactly, in fp32.

The random bits are seeded per parameter by (``seed``, its step, ``shard_index``, its index), so a run resumed
from a checkpoint (which holds the steps) draws the same bits as one that never stopped, and replicas of one shard
(HSDP, ``parallel.dp_replicate > 1``: same shard index) round identically and stay equal. On a GPU (with
``optim.compiled=true``, the default) each parameter is one Triton pass that draws its bits inside the kernel,
from a hash of each element's offset and the parameter's seed (``moe_tune.optim.kernels.stochastic_update``: 20.8
ms per step for 5.6 B parameters on an H200, as round-to-nearest's 20.3); elsewhere, and with ``optim.compiled=false``, the update
runs eagerly per chunk of ``chunk`` elements (bounding the fp32 temporaries) with bits from ``torch.randint``. The
two draw different bits from the same seed: a run is reproducible on one kind of device.
"""

from __future__ import annotations

import torch

from moe_tune.optim.adamw import _local, adamw_values, run_closure
from moe_tune.optim.kernels import SEGMENT, stochastic_update

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
    """AdamW (decoupled weight decay, bias correction) over bf16 parameters, rounding stochastically (fp32 ones
    exactly).

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
                if p.dtype not in (torch.bfloat16, torch.float32):
                    raise ValueError(f"stochastic rounding AdamW takes bf16 (and fp32) parameters, got {p.dtype}")
        self.seed, self.shard_index, self.chunk, self.compiled = seed, shard_index, chunk, compiled
        self._generators: dict[torch.device, torch.Generator] = {}  # reseeded per parameter and step

    def _seed(self, step: int, index: int, segment: int = 0) -> int:
        """The random bits' seed of parameter ``index`` at its ``step`` (``segment``: which SEGMENT elements of it,
        on a GPU)."""
        mixed = (((self.seed * 1_000_003 + step) * 65_537 + self.shard_index) * 4_099 + index) * 1_009 + segment
        return mixed % (1 << 62)

    def _generator(self, device: torch.device, seed: int) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = self._generators[device] = torch.Generator(device)
        return gen.manual_seed(seed)

    @staticmethod
    def _hyper(scalars: tuple, step: int, skip, scale) -> torch.Tensor:
        """``adamw_chunk_``'s hyperparameter tensor on skip's device (from pinned memory, without blocking)."""
        lr, beta1, beta2, eps, wd = scalars
        values = torch.tensor([lr, beta1, beta2, eps, wd, 1 - beta1**step, 1 - beta2**step])
        if skip.device.type == "cuda":
            values = values.pin_memory()
        return torch.cat([values.to(skip.device, non_blocking=True), skip.reshape(1), scale.reshape(1)])

    def _eager(self, views, step: int, index: int, hyper: torch.Tensor) -> None:
        """One parameter's update per chunk, with ``torch.randint``'s bits (a CPU, or ``optim.compiled=false``)."""
        gen = self._generator(views[0].device, self._seed(step, index))
        for start in range(0, views[0].numel(), self.chunk):
            chunk = [t[start : start + self.chunk] for t in views]
            noise = torch.randint(
                0, 1 << 16, (3, chunk[0].numel()), dtype=torch.int32, device=hyper.device, generator=gen
            )
            adamw_chunk_(*chunk, noise, hyper)

    @staticmethod
    def _exact(views, hyper: torch.Tensor) -> None:
        """An fp32 parameter (the routers that DeepSeek-V3 and GLM-4-MoE keep in fp32 in a bf16 model): its
        update and moments are stored as computed, with nothing to round."""
        for t, value in zip((views[0], views[2], views[3]), adamw_values(*views, *hyper.unbind())):
            t.copy_(value)

    @torch.no_grad()
    def step(self, closure=None):
        loss = run_closure(closure)
        found_inf, grad_scale = getattr(self, "found_inf", None), getattr(self, "grad_scale", None)
        index = -1
        for group in self.param_groups:
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            flags: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
            hypers: dict[tuple, torch.Tensor] = {}  # the eager update's, one per device and step
            for p in group["params"]:
                index += 1
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1  # on the host: a skipped step counts too
                step = int(state["step"])
                views = [_local(t).view(-1) for t in (p, p.grad, state["exp_avg"], state["exp_avg_sq"])]
                device = views[0].device
                if device not in flags:  # found_inf and grad_scale stay on the device
                    skip = torch.zeros((), device=device) if found_inf is None else found_inf.to(device, torch.float32)
                    scale = (
                        torch.ones((), device=device) if grad_scale is None else grad_scale.to(device, torch.float32)
                    )
                    flags[device] = (skip, scale)
                skip, scale = flags[device]
                exact = p.dtype == torch.float32
                if exact or device.type != "cuda" or not self.compiled:
                    if (device, step) not in hypers:
                        hypers[(device, step)] = self._hyper((lr, beta1, beta2, eps, wd), step, skip, scale)
                    if exact:
                        self._exact(views, hypers[(device, step)])
                    else:
                        self._eager(views, step, index, hypers[(device, step)])
                    continue
                bc = (1 - beta1**step, 1 - beta2**step)
                for segment, start in enumerate(range(0, views[0].numel(), SEGMENT)):
                    part = [t[start : start + SEGMENT] for t in views]
                    seed = self._seed(step, index, segment)
                    stochastic_update(*part, skip, scale, seed, lr, beta1, beta2, eps, wd, *bc)
        return loss

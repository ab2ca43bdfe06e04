"""AdamW for bf16 parameters with stochastic rounding (``optim.stochastic_rounding``: automatic with
``train.precision=bf16``).

With bf16 parameters and round-to-nearest, an update smaller than half a bf16 step of the weight is lost: a weight
near 0.5 has a step of 2^-8 ~ 0.004, while AdamW moves it by about the learning rate (3e-5 in fine-tuning), so
such runs stall (benchmarks/README.md, "Precision and kernel sets").
Here the update is computed in fp32 and rounded to bf16 up or down with probability proportional to the distance,
so the rounding is unbiased (E[round(x)] = x) and small updates accumulate on average. The two moments are kept in
bf16 and rounded the same way. State: 4 bytes per parameter, against 12 for fp32 master weights with fp32 moments.
An fp32 parameter (DeepSeek-V3's and GLM-4-MoE's routers stay fp32 in a bf16 model) is updated exactly, in fp32.

The step count is torch's fused AdamW's (and ``CompiledAdamW``'s): an fp32 tensor on the parameter's device that a
skipped update (``found_inf``) does not advance, so the bias correction 1 - beta^step follows the updates made, and
a checkpoint's optimizer state moves between the three optimizers.

The random bits are seeded per parameter by (``seed``, its step, ``shard_index``, its index), so a run resumed
from a checkpoint (which holds the steps) draws the same bits as one that never stopped, and replicas of one shard
(HSDP, ``parallel.dp_replicate > 1``: same shard index) round identically and stay equal. (A skipped step and the
update after it share a step and so a seed: the skipped one writes nothing back.) On a GPU (with
``optim.compiled=true``, the default) each parameter is one Triton pass that draws its bits inside the kernel,
from a hash of each element's offset and a key derived from the parameter's seed on the device, so the step count
is never read by the host (``moe_tune.kernels.adamw.stochastic_update``, as fast as rounding to nearest because the
pass is bound by memory: benchmarks/README.md, "Stochastic rounding's update"); elsewhere, and with
``optim.compiled=false``, the update runs eagerly per chunk of ``chunk`` elements (bounding the fp32 temporaries)
with bits from ``torch.randint``, seeded on the host.
The two draw different bits from the same seed: a run is reproducible on one kind of device.
"""

from __future__ import annotations

import torch

from moe_tune.distributed.shard import local
from moe_tune.kernels.adamw import SEGMENT, stochastic_update
from moe_tune.optim.adamw import adamw_values, run_closure

_CHUNK = 1 << 25
# ``_seed`` is linear in the step: seed(step) = (seed(0) + step * _STEP_FACTOR) mod 2^62, which the device computes.
_STEP_FACTOR = 65_537 * 4_099 * 1_009
_MASK62 = (1 << 62) - 1


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
    skips the update on the device, no host sync, and the step is not counted: the bias correction is that of
    the updates made) and ``grad_scale`` (a 0-dim tensor every gradient is divided by: gradient clipping).
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

    def _state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        step = state.get("step", torch.zeros(()))
        # fp32 on the parameter's device, as torch's fused AdamW keeps it (a state saved with a host step moves).
        state["step"] = step.to(device=local(p).device, dtype=torch.float32)
        return state

    @staticmethod
    def _hyper_P9(scalars: tuple, bc_P2: torch.Tensor, skip, scale) -> torch.Tensor:
        """``adamw_chunk_``'s hyperparameters, one row per parameter (its own bias corrections), on the device;
        the scalars come from pinned memory without blocking."""
        values = torch.tensor(scalars)
        if skip.device.type == "cuda":
            values = values.pin_memory()
        P = bc_P2.shape[0]
        columns = [values.to(skip.device, non_blocking=True).expand(P, -1), bc_P2]
        return torch.cat([*columns, skip.reshape(1, 1).expand(P, 1), scale.reshape(1, 1).expand(P, 1)], dim=1)

    @staticmethod
    def _keys(bases_L: list[int], steps_L: torch.Tensor) -> torch.Tensor:
        """The Triton kernel's 31-bit keys of ``_seed(step, index, segment)`` from each launch's ``_seed(0, ...)``
        (``bases_L``) and its parameter's step (a device tensor): int64 device arithmetic, no host read. Each
        term stays below 2^62, so the sum never overflows (steps below 1.7e7)."""
        bases = torch.tensor(bases_L, dtype=torch.int64)
        if steps_L.device.type == "cuda":
            bases = bases.pin_memory()
        seed_L = (bases.to(steps_L.device, non_blocking=True) + (steps_L.long() * _STEP_FACTOR & _MASK62)) & _MASK62
        return (seed_L ^ (seed_L >> 31)) & 0x7FFFFFFF

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
        first = 0  # parameters are indexed across groups, in order
        for group in self.param_groups:
            indexed = [(first + i, p) for i, p in enumerate(group["params"]) if p.grad is not None]
            first += len(group["params"])
            if indexed:
                self._update_group(group, indexed)
        return loss

    def _update_group(self, group: dict, indexed: list[tuple[int, torch.Tensor]]) -> None:
        """One update of ``indexed`` ((index, parameter) with a gradient, on one device)."""
        found_inf, grad_scale = getattr(self, "found_inf", None), getattr(self, "grad_scale", None)
        device = local(indexed[0][1]).device
        skip = torch.zeros((), device=device) if found_inf is None else found_inf.to(device, torch.float32)
        scale = torch.ones((), device=device) if grad_scale is None else grad_scale.to(device, torch.float32)
        lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        states = [self._state(p) for _, p in indexed]
        steps = [s["step"] for s in states]
        # As torch's fused kernel: a skipped update is not counted. A list of device tensors: foreach's
        # single-tensor overload reads a CUDA scalar to the host (a sync per step).
        torch._foreach_add_(steps, [1 - skip] * len(steps))
        step_P = torch.stack(steps)
        bc_P2 = torch.stack([1 - beta1**step_P, 1 - beta2**step_P], dim=1)  # each parameter's own step
        on_kernel = device.type == "cuda" and self.compiled
        fp32 = [p.dtype == torch.float32 for _, p in indexed]
        hyper_P9 = None
        if not on_kernel or any(fp32):  # fp32 parameters, or eager updates
            hyper_P9 = self._hyper_P9((lr, beta1, beta2, eps, wd), bc_P2, skip, scale)
        # host sync on a GPU only with optim.compiled=false: torch.randint's generator takes its seed on the host.
        host_steps = step_P.tolist() if not on_kernel and not all(fp32) else None
        launches = []  # (j, segment, start) of each Triton launch
        for j, (index, p) in enumerate(indexed):
            state = states[j]
            views = [local(t).view(-1) for t in (p, p.grad, state["exp_avg"], state["exp_avg_sq"])]
            if fp32[j]:
                self._exact(views, hyper_P9[j])
            elif not on_kernel:
                self._eager(views, int(host_steps[j]), index, hyper_P9[j])
            else:
                launches += [(j, k, start) for k, start in enumerate(range(0, views[0].numel(), SEGMENT))]
        if not launches:
            return
        bases = [self._seed(0, indexed[j][0], k) for j, k, _ in launches]
        keys_L = self._keys(bases, torch.stack([steps[j] for j, _, _ in launches]))
        for L, (j, _, start) in enumerate(launches):
            p, state = indexed[j][1], states[j]
            views = [local(t).view(-1) for t in (p, p.grad, state["exp_avg"], state["exp_avg_sq"])]
            part = [t[start : start + SEGMENT] for t in views]
            stochastic_update(*part, skip, scale, keys_L[L], bc_P2[j], lr, beta1, beta2, eps, wd)

"""AdamW with one Triton kernel per large parameter on a GPU (``optim.compiled=true``).

torch's fused AdamW is bound by memory (it reads p, g, m, v and writes p, m, v) and was the largest single item of
a micro-batch-1 step (benchmarks/README.md, "Host syncs per step, and the optimizer"). Here each parameter's update
is one pass over its flattened storage: the same maths in fp32, written back rounded to nearest, as torch's
``_fused_adamw_`` does (``adamw_values`` is the reference; on a CPU it runs eagerly; ``moe_tune.optim.stochastic``
rounds the same values stochastically). torch.compile's kernel for it was slower than torch's own with bf16
(dynamic shapes; the same section), hence Triton.

It is ``torch.optim.AdamW`` with another ``step``: the same parameter groups and state (``step`` a float32
tensor on the parameter's device, ``exp_avg``, ``exp_avg_sq``), so checkpoints move between the two, and the
same ``found_inf`` (1 skips the update on the device and does not count the step, as torch's fused kernel) and
``grad_scale`` (every gradient is divided by it: clipping). A step only queues work on the device: the
hyperparameters go by value with each launch and the step counts add device tensors, so nothing is read back
(a read per step makes the host wait for the GPU: benchmarks/README.md, "Host syncs per step, and the optimizer").
"""

from __future__ import annotations

import torch

from moe_tune.distributed.shard import local
from moe_tune.kernels.adamw import nearest_update


def adamw_values(p, g, m, v, lr, beta1, beta2, eps, weight_decay, bc1, bc2, skip, grad_scale):
    """fp32 (p, m, v) after one AdamW update of p, m, v (any float dtype) by gradient g, as torch's fused kernel
    computes it; the scalars are 0-dim tensors (``bc1``/``bc2``: the bias corrections 1 - beta^step; the
    gradient is divided by ``grad_scale``). With ``skip`` > 0 the values are p, m, v unchanged."""
    g32 = g.float() / grad_scale
    m32 = m.float() * beta1 + g32 * (1 - beta1)
    v32 = v.float() * beta2 + g32 * g32 * (1 - beta2)
    p32 = p.float() * (1 - lr * weight_decay) - (lr / bc1) * m32 / (v32.sqrt() / bc2.sqrt() + eps)
    keep = skip > 0
    return torch.where(keep, p.float(), p32), torch.where(keep, m.float(), m32), torch.where(keep, v.float(), v32)


def adamw_(p, g, m, v, hyper, step) -> None:
    """One update written back into p, m and v (rounded to nearest in their dtypes). ``hyper``: fp32
    [lr, beta1, beta2, eps, weight_decay, skip, grad_scale] (a tensor: a changing learning rate does not
    recompile, and skip and the divisor come from the device); ``step``: the update's number from 1 (a tensor)."""
    lr, beta1, beta2, eps, wd, skip, grad_scale = hyper.unbind()
    p32, m32, v32 = adamw_values(
        p, g, m, v, lr, beta1, beta2, eps, wd, 1 - beta1**step, 1 - beta2**step, skip, grad_scale
    )
    p.copy_(p32)
    m.copy_(m32)
    v.copy_(v32)


def run_closure(closure):
    """An optimizer's ``step(closure)``: the loss the closure computes, with gradients enabled (None without)."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


# Parameters this large get their own kernel; smaller ones go through torch's fused multi-tensor kernel (a few
# launches for all of them). In the 8-layer Qwen3 workload 18 parameters (experts, embeddings, lm_head) hold 97% of
# the elements. (One Triton launch for each of its 114 parameters measured slower in whole steps than torch's fused
# kernel alone, in a version that also read a step scalar to the host every step; not re-measured since.)
ONE_KERNEL_MIN = 1 << 24


class CompiledAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` (decoupled weight decay, bias correction, no amsgrad) whose ``step`` runs one
    Triton kernel (``kernels.nearest_update``) per parameter of ``one_kernel_min`` elements or more on a GPU
    (``adamw_`` eagerly on a CPU)
    and torch's fused kernel for the rest."""

    def __init__(self, params, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, one_kernel_min=ONE_KERNEL_MIN):
        # fused=True in the groups, as torch's fused AdamW has them: load_state_dict restores a group's flags, so
        # a checkpoint of either optimizer resumes the other without turning it into the single-tensor loop.
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=True)
        self.one_kernel_min = one_kernel_min

    def _state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    @staticmethod
    def _fused_small(indices, params, states, group, skip, scale) -> None:
        """torch's fused kernel for the parameters below ``one_kernel_min`` elements (a few multi-tensor launches
        for all of them), their steps already counted."""
        beta1, beta2 = group["betas"]
        for dtype in {params[i].dtype for i in indices}:
            chosen = [i for i in indices if params[i].dtype == dtype]
            torch._fused_adamw_(
                [local(params[i]) for i in chosen],
                [local(params[i].grad) for i in chosen],
                [local(states[i]["exp_avg"]) for i in chosen],
                [local(states[i]["exp_avg_sq"]) for i in chosen],
                [],
                [states[i]["step"] for i in chosen],
                amsgrad=False,
                lr=group["lr"],
                beta1=beta1,
                beta2=beta2,
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=False,
                grad_scale=scale,
                found_inf=skip,
            )

    @torch.no_grad()
    def step(self, closure=None):
        loss = run_closure(closure)
        found_inf, grad_scale = getattr(self, "found_inf", None), getattr(self, "grad_scale", None)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            device = params[0].device
            skip = torch.zeros((), device=device) if found_inf is None else found_inf.to(device, torch.float32)
            scale = torch.ones((), device=device) if grad_scale is None else grad_scale.to(device, torch.float32)
            beta1, beta2 = group["betas"]
            scalars = (group["lr"], beta1, beta2, group["eps"], group["weight_decay"])
            states = [self._state(p) for p in params]
            steps = [s["step"] for s in states]
            # As torch's fused kernel: a skipped update is not counted. A list of device tensors: foreach's
            # single-tensor overload reads a CUDA scalar to the host (a sync per step).
            torch._foreach_add_(steps, [1 - skip] * len(steps))
            big = [i for i, p in enumerate(params) if p.numel() >= self.one_kernel_min]
            if len(big) < len(params):
                self._fused_small(
                    [i for i in range(len(params)) if i not in set(big)], params, states, group, skip, scale
                )
            if not big:
                continue
            step_B = torch.stack([steps[i] for i in big])
            bc_B2 = torch.stack([1 - beta1**step_B, 1 - beta2**step_B], dim=1)  # each parameter's own step
            on_cpu = device.type != "cuda"
            hyper = torch.cat([torch.tensor(scalars), skip.reshape(1), scale.reshape(1)]) if on_cpu else None
            for j, i in enumerate(big):
                state = states[i]
                views = [local(t).view(-1) for t in (params[i], params[i].grad, state["exp_avg"], state["exp_avg_sq"])]
                if on_cpu:
                    adamw_(*views, hyper, state["step"])
                else:
                    nearest_update(*views, skip, scale, bc_B2[j], *scalars)
        return loss


__all__ = ["CompiledAdamW", "adamw_", "adamw_values"]

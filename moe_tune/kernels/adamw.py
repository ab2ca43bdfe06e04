"""The optimizers' Triton kernels: one pass over a parameter's flattened storage per launch.

Both compute AdamW in fp32 (``triton_kernels.adamw``, the same maths as ``moe_tune.optim.adamw.adamw_values``) from
p, g, m, v of any float dtype and write p, m, v back in their dtypes:
- ``nearest_update`` rounds to nearest (``optim.compiled=true``, ``CompiledAdamW``);
- ``stochastic_update`` rounds bf16 stochastically (``optim.stochastic_rounding=true``): each value gets 16 random
  low bits added before they are cut, drawn inside the kernel from the element's offset and a per-launch key, so
  nothing random is stored or read (drawing the bits with ``torch.randint`` first wrote and read 12 bytes per
  parameter, more than the update's own 14 with bf16). The bits are murmur3's 32-bit finalizer (a bijection with
  full avalanche) of offset x golden ratio + key: p takes the low 16, m the high 16 and v their XOR (independent
  of each alone, so each rounding is unbiased). Three integer multiplies per element, because Triton's Philox (40)
  made the kernel compute-bound and two such hashes per element were slower too (benchmarks/README.md,
  "Stochastic rounding's update").
Hyperparameters are passed by value with each launch; ``skip``/``scale`` (found_inf and grad_scale), the bias
corrections and the random bits' key are device tensors, so a launch copies nothing from the host and nothing is
read back. The kernels live in ``triton_kernels``, imported on
first launch (CPU installs have no Triton; the CPU tests run them through Triton's interpreter where it is
installed).
"""

from __future__ import annotations

BLOCK = 4096  # elements per program: a bandwidth-bound pass, 8 warps of 16-byte accesses
# Stochastic rounding has more arithmetic per element, so smaller programs won the block sweep (benchmarks/README.md,
# "Stochastic rounding's update").
STOCHASTIC_BLOCK, STOCHASTIC_WARPS = 1024, 4
# The random bits are drawn from the elements' 32-bit offsets: a launch covers at most this many elements (the
# caller splits larger parameters into segments, each with its own seed).
SEGMENT = 1 << 30


def nearest_update(p, g, m, v, skip, scale, bc, lr, beta1, beta2, eps, wd) -> None:
    """p, m, v (flat, contiguous) <- one AdamW update by g, rounded to nearest; ``bc``: this parameter's two bias
    corrections, 1 - beta^step, on the device."""
    from moe_tune.kernels.triton_adamw import nearest_kernel as kernel
    from moe_tune.kernels.triton_adamw import triton

    n = p.numel()
    kernel[(triton.cdiv(n, BLOCK),)](
        p, g, m, v, skip, scale, bc, n, lr, beta1, beta2, eps, wd, BLOCK=BLOCK, num_warps=8
    )


def stochastic_update(p, g, m, v, skip, scale, key, bc, lr, beta1, beta2, eps, wd) -> None:
    """p, m, v (flat, contiguous bf16, at most ``SEGMENT`` elements) <- one AdamW update by g, rounded
    stochastically with the random bits of ``key`` (a 0-dim int64 device tensor in [0, 2^31), derived from the
    parameter's seed on the device); ``bc``: this parameter's two bias corrections, 1 - beta^step, on the device."""
    from moe_tune.kernels.triton_adamw import stochastic_kernel as kernel
    from moe_tune.kernels.triton_adamw import triton

    n = p.numel()
    if n > SEGMENT:
        raise ValueError(f"stochastic_update takes at most {SEGMENT} elements per launch, got {n}")
    grid = (triton.cdiv(n, STOCHASTIC_BLOCK),)
    kernel[grid](
        p,
        g,
        m,
        v,
        skip,
        scale,
        key,
        bc,
        n,
        lr,
        beta1,
        beta2,
        eps,
        wd,
        BLOCK=STOCHASTIC_BLOCK,
        num_warps=STOCHASTIC_WARPS,
    )

"""The optimizers' Triton kernels: one pass over a parameter's flattened storage per launch.

Both compute AdamW in fp32 (``adamw`` below, the same maths as ``moe_tune.optim.adamw.adamw_values``) from
p, g, m, v of any float dtype and write p, m, v back in their dtypes:
- ``nearest_update`` rounds to nearest (``optim.compiled=true``, ``CompiledAdamW``);
- ``stochastic_update`` rounds bf16 stochastically (``optim.stochastic_rounding=true``): each value gets 16 random
  low bits added before they are cut, drawn inside the kernel from the element's offset and a per-launch key, so
  nothing random is stored or read (drawing the bits with ``torch.randint`` first wrote and read 12 bytes per
  parameter, more than the update's own 14 with bf16). The bits are murmur3's 32-bit finalizer (a bijection with
  full avalanche) of offset x golden ratio + key: p takes the low 16, m the high 16 and v their XOR (independent
  of each alone, so each rounding is unbiased). Two integer multiplies per element: Triton's Philox (40) made
  the kernel compute-bound on an H200, 53 against 20 ms for the 5.6 B parameters of the 8-layer workload, and two
  such hashes per element 32 ms (benchmarks/README.md).
Hyperparameters are passed by value with each launch and ``skip``/``scale`` (found_inf and grad_scale) are 0-dim
fp32 device tensors, so a launch copies nothing from the host. Triton is imported on first use (CPU installs have
none).
"""

from __future__ import annotations

import functools

BLOCK = 4096  # elements per program: a bandwidth-bound pass, 8 warps of 16-byte accesses
STOCHASTIC_BLOCK, STOCHASTIC_WARPS = 1024, 4  # more arithmetic per element: smaller programs (20.8 vs 31.3 ms at 4096, 8)
# The random bits are drawn from the elements' 32-bit offsets: a launch covers at most this many elements (the
# caller splits larger parameters into segments, each with its own seed).
SEGMENT = 1 << 30


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def adamw(p0, g, m0, v0, scale, lr, beta1, beta2, eps, wd, bc1, bc2):
        g = g.to(tl.float32) / scale
        m = m0.to(tl.float32) * beta1 + g * (1 - beta1)
        v = v0.to(tl.float32) * beta2 + g * g * (1 - beta2)
        p = p0.to(tl.float32) * (1 - lr * wd) - (lr / bc1) * m / (tl.sqrt_rn(v) / tl.sqrt_rn(bc2) + eps)
        return p, m, v

    @triton.jit
    def load4(p_ptr, g_ptr, m_ptr, v_ptr, offs, mask):
        return (
            tl.load(p_ptr + offs, mask=mask, other=0.0),
            tl.load(g_ptr + offs, mask=mask, other=0.0),
            tl.load(m_ptr + offs, mask=mask, other=0.0),
            tl.load(v_ptr + offs, mask=mask, other=0.0),
        )

    @triton.jit
    def mix32(x):
        """murmur3's finalizer: uint32 -> uint32, a bijection in which every input bit flips each output bit with
        probability about 1/2."""
        x ^= x >> 16
        x *= 0x85EBCA6B
        x ^= x >> 13
        x *= 0xC2B2AE35
        x ^= x >> 16
        return x

    @triton.jit
    def round_stochastic(x, bits):
        """x (fp32) to bf16, up or down with probability by distance: 16 random bits added below the cut. NaN
        stays NaN (CUDA's 0x7FFFFFFF would carry into the sign bit)."""
        summed = x.to(tl.uint32, bitcast=True) + (bits & 0xFFFF)
        rounded = ((summed >> 16) << 16).to(tl.float32, bitcast=True)  # low 16 bits zero: exact in bf16
        return tl.where(x != x, x, rounded).to(tl.bfloat16)

    @triton.jit
    def nearest_kernel(
        p_ptr, g_ptr, m_ptr, v_ptr, skip_ptr, scale_ptr, bc_ptr, n, lr, beta1, beta2, eps, wd, BLOCK: tl.constexpr
    ):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        p0, g, m0, v0 = load4(p_ptr, g_ptr, m_ptr, v_ptr, offs, mask)
        bc1, bc2 = tl.load(bc_ptr), tl.load(bc_ptr + 1)
        p, m, v = adamw(p0, g, m0, v0, tl.load(scale_ptr), lr, beta1, beta2, eps, wd, bc1, bc2)
        keep = tl.load(skip_ptr) > 0
        tl.store(p_ptr + offs, tl.where(keep, p0, p.to(p0.dtype)), mask=mask)
        tl.store(m_ptr + offs, tl.where(keep, m0, m.to(m0.dtype)), mask=mask)
        tl.store(v_ptr + offs, tl.where(keep, v0, v.to(v0.dtype)), mask=mask)

    @triton.jit(do_not_specialize=["key"])  # a new key every launch: one compiled kernel for all
    def stochastic_kernel(
        p_ptr,
        g_ptr,
        m_ptr,
        v_ptr,
        skip_ptr,
        scale_ptr,
        n,
        key,
        lr,
        beta1,
        beta2,
        eps,
        wd,
        bc1,
        bc2,
        BLOCK: tl.constexpr,
    ):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # int32: n <= SEGMENT
        mask = offs < n
        p0, g, m0, v0 = load4(p_ptr, g_ptr, m_ptr, v_ptr, offs, mask)
        p, m, v = adamw(p0, g, m0, v0, tl.load(scale_ptr), lr, beta1, beta2, eps, wd, bc1, bc2)
        # 2^32 / golden ratio is odd: a bijection of the offsets, spread over the 32 bits before mixing.
        bits = mix32(offs.to(tl.uint32) * 0x9E3779B9 + key.to(tl.uint32))
        keep = tl.load(skip_ptr) > 0  # a bf16 value written back as it was
        tl.store(p_ptr + offs, tl.where(keep, p0, round_stochastic(p, bits)), mask=mask)
        tl.store(m_ptr + offs, tl.where(keep, m0, round_stochastic(m, bits >> 16)), mask=mask)
        tl.store(v_ptr + offs, tl.where(keep, v0, round_stochastic(v, bits ^ (bits >> 16))), mask=mask)

    return triton, nearest_kernel, stochastic_kernel


def nearest_update(p, g, m, v, skip, scale, bc, lr, beta1, beta2, eps, wd) -> None:
    """p, m, v (flat, contiguous) <- one AdamW update by g, rounded to nearest; ``bc``: this parameter's two bias
    corrections, 1 - beta^step, on the device."""
    triton, kernel, _ = _kernels()
    n = p.numel()
    kernel[(triton.cdiv(n, BLOCK),)](
        p, g, m, v, skip, scale, bc, n, lr, beta1, beta2, eps, wd, BLOCK=BLOCK, num_warps=8
    )


def stochastic_update(p, g, m, v, skip, scale, seed, lr, beta1, beta2, eps, wd, bc1, bc2) -> None:
    """p, m, v (flat, contiguous bf16, at most ``SEGMENT`` elements) <- one AdamW update by g, rounded
    stochastically with the random bits of ``seed`` (an int, folded to a 31-bit key so that Triton passes it
    as int32 whatever its value)."""
    triton, _, kernel = _kernels()
    n = p.numel()
    if n > SEGMENT:
        raise ValueError(f"stochastic_update takes at most {SEGMENT} elements per launch, got {n}")
    kernel[(triton.cdiv(n, STOCHASTIC_BLOCK),)](
        p,
        g,
        m,
        v,
        skip,
        scale,
        n,
        (seed ^ (seed >> 31)) & 0x7FFFFFFF,
        lr,
        beta1,
        beta2,
        eps,
        wd,
        bc1,
        bc2,
        BLOCK=STOCHASTIC_BLOCK,
        num_warps=STOCHASTIC_WARPS,
    )


def launched() -> bool:
    """Whether a Triton kernel was built in this process (tests check the GPU path ran, not the eager one)."""
    return _kernels.cache_info().currsize > 0

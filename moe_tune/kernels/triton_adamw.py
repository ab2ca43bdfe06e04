"""The optimizers' Triton kernels (``moe_tune.kernels.adamw`` launches them; see there). Module-level functions,
so that Triton's interpreter (``TRITON_INTERPRET=1``, how the CPU tests run them) resolves them by name; imported
only when a kernel is launched (CPU installs need not have Triton)."""

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


@triton.jit
def stochastic_kernel(
    p_ptr,
    g_ptr,
    m_ptr,
    v_ptr,
    skip_ptr,
    scale_ptr,
    key_ptr,
    bc_ptr,
    n,
    lr,
    beta1,
    beta2,
    eps,
    wd,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # int32: n <= SEGMENT
    mask = offs < n
    p0, g, m0, v0 = load4(p_ptr, g_ptr, m_ptr, v_ptr, offs, mask)
    bc1, bc2 = tl.load(bc_ptr), tl.load(bc_ptr + 1)
    p, m, v = adamw(p0, g, m0, v0, tl.load(scale_ptr), lr, beta1, beta2, eps, wd, bc1, bc2)
    # 2^32 / golden ratio is odd: a bijection of the offsets, spread over the 32 bits before mixing.
    bits = mix32(offs.to(tl.uint32) * 0x9E3779B9 + tl.load(key_ptr).to(tl.uint32))
    keep = tl.load(skip_ptr) > 0  # a bf16 value written back as it was
    tl.store(p_ptr + offs, tl.where(keep, p0, round_stochastic(p, bits)), mask=mask)
    tl.store(m_ptr + offs, tl.where(keep, m0, round_stochastic(m, bits >> 16)), mask=mask)
    tl.store(v_ptr + offs, tl.where(keep, v0, round_stochastic(v, bits ^ (bits >> 16))), mask=mask)

"""Row-wise E4M3 quantization in one pass (``moe_tune.kernels.fp8_grouped.quantize_rows_triton`` launches it on
CUDA) and a tiled transpose of stacked FP8 experts (``fp8_frozen.transpose_experts``). Module-level functions, so
that Triton's interpreter (``TRITON_INTERPRET=1``) resolves them by name; imported only when a kernel is launched
(CPU installs need not have Triton)."""

import triton
import triton.language as tl


@triton.jit
def quantize_rows_kernel(
    x_ptr,
    q_ptr,
    inv_scale_ptr,
    col_scale_ptr,
    offs_ptr,
    num_groups,
    K,
    x_row_stride,
    HAS_COL_SCALE: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_GROUPS: tl.constexpr,
):
    """One program per row of ``x`` [R, K]: optionally multiplied by the row's group's column scales
    (``col_scale[g, :]``, g the row's group: how many of the ``num_groups`` group ends ``offs`` are at or before
    the row, so rows past the last group read row ``num_groups``, a row of zeros), then scaled by the largest power of two that maps the row's largest magnitude
    to at most 448 and rounded to E4M3 into ``q`` [R, K]; ``inv_scale[row]`` holds what to multiply the E4M3 values
    by. The power of two is read off the amax's bits as ``fp8_grouped._pow2_scale`` does with frexp: bitwise the
    same result. Unfused, PyTorch ran about eight passes over the row block (abs, amax, scale, clamp, cast)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < K
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_COL_SCALE:
        groups = tl.arange(0, BLOCK_GROUPS)
        ends = tl.load(offs_ptr + groups, mask=groups < num_groups, other=2**31 - 1).to(tl.int64)
        group = tl.sum((ends <= row).to(tl.int64), axis=0)
        x = x * tl.load(col_scale_ptr + group * K + cols, mask=mask, other=0.0)
    amax = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-30)
    bits = amax.to(tl.int32, bitcast=True)
    biased = (bits >> 23) & 0xFF
    # amax = 1.m x 2^(biased - 127); 448 = 1.75 x 2^8: the power is 8 - (biased - 127), one less when 1.m > 1.75.
    power = 135 - biased - ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    scale = ((power + 127) << 23).to(tl.float32, bitcast=True)
    q = tl.minimum(tl.maximum(x * scale, -448.0), 448.0)
    tl.store(q_ptr + row * K + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(inv_scale_ptr + row, 1.0 / scale)


@triton.jit
def transpose_kernel(x_ptr, out_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``out[j] = x[j]^T`` for each of the stacked matrices ``x`` [e, N, K] into ``out`` [e, K, N], both contiguous:
    program (n, k, j) reads a [BLOCK_N, BLOCK_K] tile along K (coalesced) and writes it transposed along N
    (coalesced), the exchange in registers and shared memory. A strided element-wise copy reads one byte per
    32-byte sector for 1-byte values."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    base = tl.program_id(2).to(tl.int64) * N * K
    mask = (n[:, None] < N) & (k[None, :] < K)
    tile = tl.load(x_ptr + base + n[:, None] * K + k[None, :], mask=mask, other=0)
    tl.store(out_ptr + base + k[:, None] * N + n[None, :], tl.trans(tile), mask=tl.trans(mask))
